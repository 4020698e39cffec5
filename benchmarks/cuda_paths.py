"""Does every implemented method run on this device, through each of its attention paths?

For each implemented method (the conformance suite's compressing settings, so that the
prompt is compressed) and, where the method reads ``fused_attention``, both values of it:
a random llama of head_dim 128 in float16 prefills a prompt in chunks, then decodes
greedily; the same run on the CPU stream (same weights, same dtype) is the reference. A row says whether
the device run completed (or the error it raised, first line), and how far its logits
and greedy tokens are from the CPU's. A path that fails must fail with an error that
names what is missing, never return garbage: a large logit error is flagged.

    python benchmarks/cuda_paths.py                    # every implemented method
    python benchmarks/cuda_paths.py --methods kivi gear --prompt 700 --decode 8
    python benchmarks/cuda_paths.py --forced --methods skvq   # both fed the CPU's tokens

On a random model the top two logits can be close (skvq's first step: 2.6e-2 of the
logit scale apart in float32), so without ``--forced`` a 1e-2 difference can flip one
greedy token and every later step then differs by the logits' whole scale.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (before mlx: it sets up the CPU back-end's BLAS)
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from conformance import config, profile  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

from veloxquant_mlx import make_prompt_cache  # noqa: E402
from veloxquant_mlx.cache.config import CONFIG_FIELD_USERS  # noqa: E402
from veloxquant_mlx.registry import implemented_methods  # noqa: E402

SHAPE = dict(hidden_size=256, num_hidden_layers=2, intermediate_size=512,
             num_attention_heads=4, num_key_value_heads=2, head_dim=128)


def run(model, tokens, cfg, decode, chunk, stream, forced=None):
    with mx.stream(stream):
        cache = make_prompt_cache(model, cfg)
        logits = None
        for start in range(0, len(tokens) - 1, chunk):
            logits = model(tokens[None, start : min(start + chunk, len(tokens) - 1)], cache=cache)
            mx.eval(logits)
        out, y = [], tokens[-1:]
        for _ in range(decode + 1):
            logits = model(y[None], cache=cache)[:, -1].astype(mx.float32)
            mx.eval(logits)
            out.append(logits)
            y = mx.argmax(logits, axis=-1) if forced is None else forced[len(out) - 1 : len(out)]
        return mx.concatenate(out, axis=0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--methods", nargs="+", default=None)
    ap.add_argument("--prompt", type=int, default=400)
    ap.add_argument("--decode", type=int, default=6)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--forced", action="store_true",
                    help="feed the device run the CPU run's greedy tokens (teacher forcing): each "
                         "step's logit error alone, not compounded by an earlier flipped token")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"],
                    help="the model's and caches' dtype, on both devices")
    args = ap.parse_args()
    methods = args.methods or implemented_methods()
    gpu = mx.default_device()
    print(f"device: {gpu}; {len(methods)} methods; {args.dtype}", flush=True)
    mx.random.seed(0)
    tokens = mx.random.randint(0, 256, (args.prompt,), key=mx.random.key(1))
    dtype = getattr(mx, args.dtype)
    model_gpu = tiny_model("llama", seed=0, dtype=dtype, **SHAPE)
    model_cpu = tiny_model("llama", seed=0, dtype=dtype, **SHAPE)
    rows = []
    for i, method in enumerate(methods, 1):
        try:
            settings = dict(profile(method).compressing)
        except AssertionError as exc:  # no conformance profile yet
            rows.append((method, f"skipped: {str(exc).splitlines()[0][:80]}", "", ""))
            continue
        variants = [True, False] if method in CONFIG_FIELD_USERS["fused_attention"] else [None]
        for fused in variants:
            s = dict(settings) if fused is None else {**settings, "fused_attention": fused}
            label = method if fused is None else f"{method} fused={fused}"
            t0 = time.perf_counter()
            try:
                reference = run(model_cpu, tokens, config(method, s), args.decode, args.chunk, mx.cpu)
                forced = mx.argmax(reference, axis=-1) if args.forced else None
                got = run(model_gpu, tokens, config(method, s), args.decode, args.chunk, gpu, forced)
                err = float(mx.abs(got - reference).max() / mx.abs(reference).max())
                same = int((mx.argmax(got, -1) == mx.argmax(reference, -1)).sum())
                status = "ok" if err < 0.05 else "LARGE ERROR"
                rows.append((label, status, f"{err:.2e}", f"{same}/{args.decode + 1}"))
            except Exception as exc:  # reported in the table
                first = str(exc).splitlines()[0][:110] if str(exc) else type(exc).__name__
                rows.append((label, f"error: {type(exc).__name__}: {first}", "", ""))
            print(f"[{i}/{len(methods)}] {label}: {rows[-1][1]} ({time.perf_counter() - t0:.1f} s)", flush=True)
    print("\n| method | on the device | logits vs CPU (rel. max) | greedy tokens equal |")
    print("|---|---|---:|---:|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
