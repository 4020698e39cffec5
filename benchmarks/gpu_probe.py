"""Probes for the GPU back-end: where a method's decode step reads array values on the
host (which breaks mlx-lm's overlapped decode loop), and which function's graph fails to
run when a prefill fails there.

    python benchmarks/gpu_probe.py --syncs kivi knorm --context 4096
    python benchmarks/gpu_probe.py --failing kvquant --context 4096

``--syncs``: prefill, a few steps, then steps run as ``generate_step`` runs them while every
host read of an array (``item``, ``tolist``, ``__bool__``, ``mx.eval``, numpy conversion)
made from package code is recorded with its file:line (the recorder of
tests/decode_steps.py). ``--failing``: the prefill runs with every package function's
returned arrays evaluated as it returns, so the first failing evaluation names the
innermost function whose graph the device cannot run.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections import Counter
from pathlib import Path

from veloxquant_mlx import KVCacheConfig, make_prompt_cache  # first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
import decode  # noqa: E402
from decode_steps import recording_host_reads  # noqa: E402

PACKAGE = str(Path(sys.modules["veloxquant_mlx"].__file__).resolve().parent)


def config_of(name: str) -> KVCacheConfig:
    return decode.METHODS.get(name) or KVCacheConfig(method=name)


def prompt_tokens(model, context):
    return mx.random.randint(0, model.args.vocab_size, (1, context), key=mx.random.key(context))


def prefill(model, cache, tokens, chunk=2048):
    for start in range(0, tokens.shape[1] - 1, chunk):
        model(tokens[:, start:min(start + chunk, tokens.shape[1] - 1)], cache=cache)
        mx.eval([c.state for c in cache])
    return mx.argmax(model(tokens[:, -1:], cache=cache)[:, -1], axis=-1)


def probe_syncs(model, name, context, steps=8):
    cache = make_prompt_cache(model, config_of(name))
    y = prefill(model, cache, prompt_tokens(model, context))
    for _ in range(4):
        y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(y)
    mx.async_eval(y)
    with recording_host_reads() as reads:
        for _ in range(steps):
            next_y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
            mx.async_eval(next_y)
            y = next_y
    mx.eval(y)
    counts = Counter(str(r) for r in reads)
    print(f"{name}: {len(reads)} host reads in {steps} steps" + "".join(f"\n    {n:4d} x {w}" for w, n in counts.most_common(8)), flush=True)


def probe_failing(model, name, context):
    stack = []

    def profiler(frame, event, arg):
        if event != "return" or not frame.f_code.co_filename.startswith(PACKAGE):
            return
        arrays = [a for _, a in tree_flatten(arg) if isinstance(a, mx.array)] if isinstance(arg, (tuple, list, dict)) else (
            [arg] if isinstance(arg, mx.array) else [])
        if arrays:
            try:
                mx.eval(arrays)
            except Exception as exc:  # noqa: BLE001 - the point is to name where it fails
                if "function transformations" in str(exc):  # traced inside mx.compile: not evaluable
                    return
                sys.setprofile(None)
                where = f"{Path(frame.f_code.co_filename).relative_to(PACKAGE)}:{frame.f_code.co_name}"
                stack.append((where, f"{type(exc).__name__}: {exc}", [tuple(a.shape) for a in arrays], [str(a.dtype) for a in arrays]))
                raise

    cache = make_prompt_cache(model, config_of(name))
    sys.setprofile(profiler)
    try:
        prefill(model, cache, prompt_tokens(model, context))
        print(f"{name}: prefill ran", flush=True)
    except Exception:  # noqa: BLE001
        if stack:
            where, err, shapes, dtypes = stack[0]
            print(f"{name}: first failing evaluation in {where}, outputs {shapes} {dtypes}: {err}", flush=True)
        else:
            print(f"{name}: failed outside any package function:\n{traceback.format_exc(limit=6)}", flush=True)
    finally:
        sys.setprofile(None)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama3-8b", choices=list(decode.PRESETS))
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--syncs", nargs="*", default=[])
    ap.add_argument("--failing", nargs="*", default=[])
    args = ap.parse_args()
    model = decode.build_model(args.preset, mx.float32 if mx.default_device() == mx.cpu else mx.float16)
    print(f"device {mx.default_device()}, preset {args.preset}, context {args.context}", flush=True)
    for name in args.syncs:
        probe_syncs(model, name, args.context)
    for name in args.failing:
        probe_failing(model, name, args.context)


if __name__ == "__main__":
    main()
