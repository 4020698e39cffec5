"""Saved prompt-cache sizes: cachegen and kvtc against kivi at the same bit width.

Prefills the embedded reference model on ``--context`` tokens of its held-out text, once
per setting, saves the cache with ``veloxquant_mlx.save_prompt_cache`` (the entropy-coded
methods' coded form; mlx-lm's own save writes their resident form) and reports the file
size, the bytes per token, the cache's resident ``nbytes`` (what attention reads) and,
for the entropy-coded methods, ``stored_nbytes`` (the arrays of the saved form), with the
ratio of each file to kivi's at the same width. Widths: kivi ``kv_bits``; cachegen
``cachegen_resolved_bits`` (every layer) and its default depth schedule; kvtc a budget of
``bits * H * d`` bits a token (``bits`` a channel on average). Every cache keeps the
model's dtype for its full-precision rows and kivi its scales (``--dtype``: bfloat16 by
default, 2 bytes as the model's float16, whose CPU kernels are ~7x slower here: a 4k
float16 prefill took 196 s against 29 s in float32 on the 2-core machine).

    .venv/bin/python benchmarks/saved_size.py [--context 4096] [--out benchmarks/results/saved_size.md]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import veloxquant_mlx  # noqa: F401  (before mlx: the system BLAS)
from veloxquant_mlx import REFERENCE_MODEL, KVCacheConfig, make_prompt_cache, save_prompt_cache

import mlx.core as mx
import mlx_lm


def settings(h: int, d: int):
    return [
        ("kivi", 2, {"kv_bits": 2}),
        ("cachegen", 2, {"cachegen_resolved_bits": 2}),
        ("kvtc", 2, {"kvtc_bit_budget": 2 * h * d}),
        ("kivi", 4, {"kv_bits": 4}),
        ("cachegen", 4, {"cachegen_resolved_bits": 4}),
        ("cachegen", "4/5 schedule", {}),
        ("kvtc", 4, {"kvtc_bit_budget": 4 * h * d}),
    ]


def _config(method, fields):
    own = {k: v for k, v in fields.items() if k in ("kv_bits", "residual_window")}
    return KVCacheConfig.from_dict({"method": method, "options": {k: v for k, v in fields.items() if k not in own}, **own})


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--out", default=None, help="write the table (Markdown) here too")
    args = ap.parse_args(argv)

    model, tokenizer = mlx_lm.load(str(REFERENCE_MODEL))
    model.set_dtype(getattr(mx, args.dtype))
    text = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()
    ids = tokenizer.encode(text)
    while len(ids) < args.context:
        ids = ids + ids
    tokens = mx.array(ids[: args.context])
    a = model.args
    h, d = a.num_key_value_heads, getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads

    rows, kivi_size = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        for method, width, fields in settings(h, d):
            cache = make_prompt_cache(model, _config(method, fields))
            start = time.perf_counter()
            for i in range(0, tokens.shape[0], 512):
                model(tokens[i : i + 512][None], cache=cache)
            path = os.path.join(tmp, f"{method}.safetensors")
            save_prompt_cache(path, cache)
            elapsed = time.perf_counter() - start
            size = os.path.getsize(path)
            if method == "kivi":
                kivi_size[width] = size
            resident = sum(c.nbytes for c in cache)
            stored = sum(getattr(c, "stored_nbytes", c.nbytes) for c in cache)
            ref = kivi_size.get(width if isinstance(width, int) else 4)
            rows.append((method, str(width), ", ".join(f"{k}={v}" for k, v in fields.items()) or "defaults",
                         size, size / args.context, resident, stored, size / ref, elapsed))
            print(f"{method:9s} {str(width):13s} file {size:>10,} B  ratio vs kivi {size / ref:.3f}", file=sys.stderr)

    head = (f"Saved prompt caches of the reference model ({len(model.layers)} layers, {h} KV heads x "
            f"head_dim {d}, {args.dtype}), {args.context:,} tokens of held-out text, "
            "`veloxquant_mlx.save_prompt_cache`; `.venv/bin/python benchmarks/saved_size.py "
            f"--context {args.context} --dtype {args.dtype}`. Resident: the caches' `nbytes` (what "
            "attention reads); stored arrays: the saved form's arrays (`stored_nbytes`; kivi: its "
            "state); the file adds its header and meta.\n\n"
            "| method | bits | settings | file bytes | bytes/token | resident nbytes | stored arrays | file vs kivi (same bits) | prefill+save s |\n"
            "|---|---|---|---:|---:|---:|---:|---:|---:|\n")
    body = "".join(f"| {m} | {w} | {s} | {f:,} | {t:,.1f} | {r:,} | {st:,} | {q:.3f} | {e:.1f} |\n"
                   for m, w, s, f, t, r, st, q, e in rows)
    table = head + body
    print(table)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(table)


if __name__ == "__main__":
    main()
