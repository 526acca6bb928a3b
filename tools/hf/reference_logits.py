#!/usr/bin/env python3
"""External reference: run transformers' own kimi_linear model on a checkpoint written by
`k3 synth` and save its fp32 logits, so the engine's CPU reference can be compared with an
implementation it shares no code with.

usage: reference_logits.py CHECKPOINT_DIR OUT_JSON [token ids...]
Needs torch and transformers (>= 5) with the kimi_linear model; runs on the CPU.
"""
import json
import sys

import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM


def main():
    ckpt, out_path = sys.argv[1], sys.argv[2]
    tokens = [int(t) for t in sys.argv[3:]] or [256, 72, 101, 108, 108, 111, 44, 32, 75, 51]
    cfg = AutoConfig.from_pretrained(ckpt)
    model, info = AutoModelForCausalLM.from_pretrained(
        ckpt, dtype=torch.float32, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
    logits = out.logits[0].float()
    hidden = [h[0].float().tolist() for h in out.hidden_states]
    json.dump({
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "config_class": type(cfg).__name__,
        "loading_info": {k: sorted(map(str, v)) for k, v in info.items()},
        "tokens": tokens,
        "logits": logits.tolist(),
        "hidden_states": hidden,
    }, open(out_path, "w"))
    missing = info.get("missing_keys", [])
    unexpected = info.get("unexpected_keys", [])
    print(f"{ckpt}: {type(cfg).__name__}, {len(missing)} missing, {len(unexpected)} unexpected keys")
    for k in list(missing)[:20]:
        print("  missing", k)
    for k in list(unexpected)[:20]:
        print("  unexpected", k)


if __name__ == "__main__":
    main()
