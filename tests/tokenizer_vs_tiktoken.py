#!/usr/bin/env python3
"""Reference token ids from the `tiktoken` package, for TokenizerVsTiktoken (test_tokenizer_vs_tiktoken.cpp).

Builds tiktoken.Encoding the way Kimi's tokenization_kimi.py does (its pat_str, the ranks of
tiktoken.model, the specials of tokenizer_config.json's added_tokens_decoder with
<|reserved_token_{id}|> names for the rest of the 256 ids above the ranks) and encodes like its
encode(): 400000-code-point windows, runs of > 25000 (non-)whitespace cut, each chunk with
allowed_special="all" or as ordinary text.

usage: tokenizer_vs_tiktoken.py IN.json OUT.json
  IN:  {"dirs": [tokenizer dirs], "texts": [strings]}
  OUT: {"tiktoken": version, "pattern": pat_str,
        "results": {dir: {"ordinary": [[ids] per text], "special": [[ids] per text]}}}
"""

import base64
import json
import sys

import tiktoken

# tokenization_kimi.py's pat_str (Kimi-K2 / Kimi-Linear / K3), the same eight alternatives.
PAT_STR = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
RESERVED = 256
WINDOW = 400_000
MAX_RUN = 25_000


def load_encoding(d):
    # Parsed here rather than with tiktoken.load (which caches by path, and test paths repeat).
    ranks = {}
    with open(f"{d}/tiktoken.model", "rb") as f:
        for line in f.read().splitlines():
            if line:
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    specials = {}
    try:
        with open(f"{d}/tokenizer_config.json", encoding="utf-8") as f:
            added = json.load(f).get("added_tokens_decoder", {})
    except FileNotFoundError:
        added = {}
    named = {int(k): v["content"] for k, v in added.items()}
    first = max(ranks.values()) + 1
    for i in range(first, first + RESERVED):
        specials[named.get(i, f"<|reserved_token_{i}|>")] = i
    for i, name in named.items():
        specials[name] = i
    return tiktoken.Encoding(name="k3-test", pat_str=PAT_STR, mergeable_ranks=ranks,
                             special_tokens=specials)


def runs(s):
    """Cuts s so that no piece has more than MAX_RUN consecutive (non-)whitespace code points."""
    start, length, in_space = 0, 0, s[0].isspace() if s else False
    for i, c in enumerate(s):
        space = c.isspace()
        if space != in_space:
            length, in_space = 1, space
        else:
            length += 1
            if length > MAX_RUN:
                yield s[start:i]
                start, length = i, 1
    yield s[start:]


def encode(enc, text, allow_special):
    ids = []
    for w in range(0, len(text), WINDOW):
        for chunk in runs(text[w:w + WINDOW]):
            if allow_special:
                ids += enc.encode(chunk, allowed_special="all")
            else:
                ids += enc.encode(chunk, disallowed_special=())
    return ids


def main():
    with open(sys.argv[1], encoding="utf-8") as f:
        job = json.load(f)
    results = {}
    for d in job["dirs"]:
        enc = load_encoding(d)
        results[d] = {
            "ordinary": [encode(enc, t, False) for t in job["texts"]],
            "special": [encode(enc, t, True) for t in job["texts"]],
        }
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump({"tiktoken": tiktoken.__version__, "pattern": PAT_STR, "results": results}, f)


if __name__ == "__main__":
    main()
