"""Host time of a decode step (building its lazy graph) on the CPU, with the GPU path stubbed.

What a decode step costs the host on a GPU is the model call before ``mx.eval``: Python
and MLX building the graph. The CUDA path of the quantized caches cannot run here, but its
host side can: ``--stub`` (the default) makes ``kivi_decode.gpu_backend()`` answer "cuda"
and makes each ``mx.fast.cuda_kernel`` launch one graph node (zeros of the right shapes
behind a ``Depends`` on its inputs: ``tests/decode_steps.cuda_kernels_as_launch_nodes``),
so the Python that checks layouts, plans the split and builds the launch runs as it would
on CUDA; each ``mx.dequantize`` / ``mx.quantize`` is one node too, as on a GPU (the CPU
builds them as graphs of shifts, which cost its host far more). The stand-in's own cost (one ``mx.depends`` a launch) is not
MLX's cost of a custom-kernel call on CUDA (~12 us, notes): these are CPU host-time
figures with stub kernels, not GPU timings, good for comparing the Python around them.

The model: 8 layers of Llama-3-8B's attention shape (hidden 4096, 32 query / 8 KV heads
of 128), a small MLP and vocabulary, random weights, float32 by default (MLX's fast CPU matmuls; the
dispatcher then picks the "simt" kernel; ``--dtype float16`` takes "frag", but prefills slowly here).
Each cache is prefilled with the same prompt, then the methods take turns, one
step each a round, and only the model call is timed (eval after it, outside the timed
region). Per-layer host us is the step's median over the rounds divided by the layers.

    python benchmarks/host_time.py                          # table, 1k context
    python benchmarks/host_time.py --context 4096 --steps 40
    python benchmarks/host_time.py --profile kivi-4bit      # cProfile of the model calls
    python benchmarks/host_time.py --uncached               # kivi before/after the step plans
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import pstats
import statistics
import sys
import time
from pathlib import Path

from veloxquant_mlx import KVCacheConfig, make_prompt_cache  # first: it may load OpenBLAS
from veloxquant_mlx.registry import implemented_methods

import mlx.core as mx  # noqa: E402
from mlx_lm.models import llama  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from veloxquant_mlx.bench.runner import prefill  # noqa: E402
from veloxquant_mlx.cache.options import (  # noqa: E402
    H2OOptions, KIVIOptions, SnapKVOptions, StreamingLLMOptions, TOVAOptions)
from veloxquant_mlx.kernels import kivi_decode as kd  # noqa: E402
from veloxquant_mlx.quant import store as store_module  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from decode_steps import affine_ops_as_on_a_gpu, cuda_kernels_as_launch_nodes  # noqa: E402

BASELINE = "mlx-lm KVCache"
METHODS = {
    BASELINE: None,
    "full": KVCacheConfig(),
    "kivi-4bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=4),
    "kivi-2bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=2),
    "snapkv": KVCacheConfig(options=SnapKVOptions(snap_budget=512)),
    "streaming_llm": KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=4, stream_window_size=508)),
    # eviction over packed slots (evict/quantized_slots.py): on CUDA, rows decoded and one SDPA
    "snapkv + kivi-4bit": KVCacheConfig(options=SnapKVOptions(snap_budget=512), storage=KIVIOptions(kivi_group_size=32),
                                        kv_bits=4),
    "tova + kivi-4bit": KVCacheConfig(options=TOVAOptions(tova_budget=512), storage=KIVIOptions(kivi_group_size=32),
                                      kv_bits=4),
    "h2o + kivi-2bit": KVCacheConfig(options=H2OOptions(h2o_budget=512), storage=KIVIOptions(kivi_group_size=32),
                                     kv_bits=2),
}


def build_model(layers: int, dtype):
    args = llama.ModelArgs(model_type="llama", hidden_size=4096, num_hidden_layers=layers,
                           intermediate_size=256, num_attention_heads=32, num_key_value_heads=8,
                           head_dim=128, vocab_size=256, rms_norm_eps=1e-5, rope_theta=500000.0,
                           tie_word_embeddings=False)
    mx.random.seed(0)
    model = llama.Model(args)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


@contextlib.contextmanager
def stubbed_gpu_path():
    """The dispatcher believes it runs on CUDA; each kernel launch, dequantization and
    quantization is one graph node (the CPU builds the last two as graphs of shifts: palu's
    step spent 40 us a call building them here)."""
    with cuda_kernels_as_launch_nodes(), affine_ops_as_on_a_gpu():
        yield


def make_cache(model, config):
    return [KVCache() for _ in model.layers] if config is None else make_prompt_cache(model, config)


#: ``--uncached``: caches whose steps take the dispatcher's uncached path (``kd._launch``
#: per call, a fresh empty stand-in per layer), the code before the step plans: rows
#: "<method> uncached" next to the others in the same run
_UNCACHED: set = set()
_UNCACHED_NOW = [False]


class _UncachedPlan:
    def __init__(self, backend, algo, kw):
        self.backend, self.algo, self.kw = backend, algo, kw

    def launch(self, args):
        return kd._launch(self.backend, *args, **self.kw, algo=self.algo)

    def partials(self, args):
        return kd._partials(self.backend, *args, **self.kw, algo=self.algo)


def _switchable(new_plan, new_empty):
    def plan(backend, args, bits, group_size, scale):
        if not _UNCACHED_NOW[0]:
            return new_plan(backend, args, bits, group_size, scale)
        q, kc, _, _, _, kr, _, vc, _, _, _, vr, _ = args
        H = next(a.shape[1] for a in (kc, vc, kr, vr) if a is not None and a.size)
        algo = kd.kernel_algo(backend, q, H, bits, group_size)
        kw = dict(scale=scale, bits=bits, group_size=group_size)
        return None if algo is None else _UncachedPlan(backend, algo, kw)

    return plan, (lambda dt: mx.zeros((0,), dt) if _UNCACHED_NOW[0] else new_empty(dt))


def timed_step(model, cache, y, profiler=None):
    """One decode step: (next token, host seconds of the model call alone)."""
    _UNCACHED_NOW[0] = id(cache) in _UNCACHED
    if profiler is not None:
        profiler.enable()
    t0 = time.perf_counter()
    logits = model(y[:, None], cache=cache)
    t1 = time.perf_counter()
    if profiler is not None:
        profiler.disable()
    y = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(y)
    return y, t1 - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30, help="timed rounds (one step per method each)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--methods", nargs="+", default=list(METHODS),
                    help=f"from: {', '.join(METHODS)}, or any method key (at its defaults)")
    ap.add_argument("--no-stub", action="store_true", help="the device's own path (no stub: the CPU's path on the CPU, the kernels on a GPU)")
    ap.add_argument("--profile", metavar="METHOD", help="cProfile the model calls of METHOD instead")
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--uncached", action="store_true",
                    help="also rows of the kivi caches through the uncached dispatch (before/after)")
    ap.add_argument("--dtype", default="float32", choices=["float16", "float32"],
                    help="float32: MLX's fast CPU matmuls (the kernel is then simt); float16: frag, slow here")
    args = ap.parse_args()
    for key in set(args.methods + [args.profile]) & set(implemented_methods()):
        METHODS.setdefault(key, KVCacheConfig(method=key))
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        ap.error(f"unknown method(s) {unknown}; choose from {list(METHODS)} or a method key")

    model = build_model(args.layers, getattr(mx, args.dtype))
    tokens = mx.random.randint(0, model.args.vocab_size, (args.context,), key=mx.random.key(1))
    names = [args.profile] if args.profile else [BASELINE, *[m for m in args.methods if m != BASELINE]]
    if args.uncached:
        names = [x for n in names for x in ([n + " uncached", n] if n.startswith("kivi") else [n])]
        kd._step_plan, store_module.absent_buffer = _switchable(kd._step_plan, store_module.absent_buffer)
    states = {}
    for name in names:
        cache = make_cache(model, METHODS[name.removesuffix(" uncached")])
        if name.endswith(" uncached"):
            _UNCACHED.add(id(cache))
        states[name] = (cache, mx.argmax(prefill(model, cache, tokens, chunk=512))[None])

    stub = contextlib.nullcontext() if args.no_stub else stubbed_gpu_path()
    with stub:
        for name, (cache, y) in states.items():
            for _ in range(args.warmup):
                y, _ = timed_step(model, cache, y)
            states[name] = (cache, y)
        if args.profile:
            prof = cProfile.Profile()
            cache, y = states[args.profile]
            for _ in range(args.steps):
                y, _ = timed_step(model, cache, y, prof)
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(args.top)
            print(f"{args.profile}: cProfile of {args.steps} model calls ({args.layers} layers), by tottime")
            print(out.getvalue())
            return
        times = {name: [] for name in names}
        for _ in range(args.steps):
            for name, (cache, y) in states.items():
                y, t = timed_step(model, cache, y)
                times[name].append(t)
                states[name] = (cache, y)

    per_layer = {n: statistics.median(ts) / args.layers * 1e6 for n, ts in times.items()}
    print(f"context {args.context}, {args.layers} layers, {args.dtype}, {args.steps} steps, "
          f"{'no stub (the device path)' if args.no_stub else 'GPU path stubbed'}; model call only, median")
    print("| cache | host us a layer | vs KVCache |")
    print("|---|---:|---:|")
    for n in names:
        print(f"| {n} | {per_layer[n]:.1f} | {per_layer[n] / per_layer[BASELINE]:.2f}x |")


if __name__ == "__main__":
    main()
