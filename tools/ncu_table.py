#!/usr/bin/env python3
"""Reads `ncu --csv` output of a k3_bench_step run (one row per kernel and metric) and prints
the kernels of the last decode step (from the last embedding kernel on), then a summary per
kernel name: launches, total us, MB read, TB/s."""
import collections
import csv
import sys


def kernels(path):
    rows, hdr, k = list(csv.reader(open(path))), None, {}
    for r in rows:
        if r and r[0] == "ID":
            hdr = r
            continue
        if hdr and len(r) == len(hdr):
            d = dict(zip(hdr, r))
            e = k.setdefault(int(d["ID"]), {"name": d["Kernel Name"], "grid": d["Grid Size"],
                                            "block": d["Block Size"]})
            e[d["Metric Name"]] = float(d["Metric Value"].replace(",", ""))
    return [k[i] for i in sorted(k)]


def short(name):
    base = name.split("(")[0].replace("void ", "").replace("(anonymous namespace)::", "")
    if "skinny_gemm_kernel" in name:
        fmt = "mxfp4" if "Mxfp4" in name else "bf16"
        return f"skinny_gemm<{fmt}>"
    return base.split("<")[0].split("::")[-1]


def main():
    ks = kernels(sys.argv[1])
    starts = [i for i, e in enumerate(ks) if "embed" in e["name"]]
    if not starts:
        sys.exit("no embedding kernel found: not a k3_bench_step profile?")
    step = ks[starts[-1]:]
    total = 0.0
    print(f"{'us':>8} {'MB read':>8} {'TB/s':>6} {'grid':>14} {'block':>12}  kernel")
    per = collections.OrderedDict()
    for e in step:
        us = e.get("gpu__time_duration.sum", 0.0) / 1000.0
        mb = e.get("dram__bytes_read.sum", 0.0) / 1e6
        total += us
        print(f"{us:8.2f} {mb:8.2f} {mb / max(us, 1e-9):6.2f} {e['grid']:>14} {e['block']:>12}  "
              f"{short(e['name'])}")
        p = per.setdefault(short(e["name"]), [0, 0.0, 0.0])
        p[0] += 1
        p[1] += us
        p[2] += mb
    print(f"\n{len(step)} kernels, {total:.1f} us isolated (no PDL overlap)\n")
    print(f"{'kernel':<28} {'n':>4} {'us':>9} {'MB':>9} {'TB/s':>6}")
    for name, (n, us, mb) in sorted(per.items(), key=lambda x: -x[1][1]):
        print(f"{name:<28} {n:>4} {us:9.1f} {mb:9.1f} {mb / max(us, 1e-9):6.2f}")


if __name__ == "__main__":
    main()
