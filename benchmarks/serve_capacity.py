"""Serving capacity at a fixed KV budget (issue 32): how many long sequences each cache holds
at once, and the aggregate decode speed of that batch, against mlx-lm's fp16 ``KVCache``.

A random-weight llama (``benchmarks/decode.py``'s presets, no download). Requests with
``--prompt``-token prompts arrive together; per method:

1. one prompt is prefilled (mlx-lm's way: chunks, then the last token alone), twice: the
   second, warm, prefill's time is the time to first token of a request served alone;
2. two copies of it, merged into a batch and decoded ``--steps`` + 2 tokens, give the
   bytes a sequence holds in a batch (their ``nbytes`` over two: the batch layout's room
   and windows included); the most sequences held at once is the budget over that (at
   most ``--max-seqs``);
3. that many copies of the prefilled sequence are merged into one batch the way mlx-lm's
   ``BatchGenerator`` merges caches (``cache.merge``: mlx-lm's ``BatchKVCache`` for the
   fp16 row, ``cache/batch.py`` for ours), then ``--steps`` decode steps run the way
   ``generate_step`` runs them (overlapped, after two warm-up steps): aggregate decode
   tokens per second = sequences x steps / wall time. The batch's ``nbytes`` is reported
   against the budget (padding and spare room included).

Copies stand in for distinct prompts: a cache's size and a decode step's work depend on
the lengths, not on the tokens, and prefilling every request would take the sequences
held times one prefill (the table's "TTFT, last of N" column is that product: the time
to first token of the last request when N arrive together and are prefilled in turn).
Two things differ from distinct prompts: copies share their prompt's buffers until a batch
layout joins them (a per-sequence row reads one prompt's history N times), and copies are
always in one state, so a stacked layout (``cache/stacked.py``) puts them in one group,
which distinct prompts of one length reach only where the method's structure depends on
the lengths alone (the stacked methods in ``tests/test_stacked_batches.py``).

    python benchmarks/serve_capacity.py                                  # H200: 8B, 32k, 40 GB
    python benchmarks/serve_capacity.py --preset tiny --prompt 4096 --kv-gb 0.04 --steps 4 \
        --prefill-repeats 1                                              # a CPU check
    python benchmarks/serve_capacity.py --mix 4       # lengths 8k, 16k, 24k, 32k in one batch
"""

from __future__ import annotations

import argparse
import gc
import platform
import shlex
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from veloxquant_mlx import KVCacheConfig  # noqa: E402  first: it may load OpenBLAS

import mlx.core as mx  # noqa: E402

from decode import PRESETS, build_model, make_cache  # noqa: E402
from veloxquant_mlx.bench.runner import prefill  # noqa: E402
from veloxquant_mlx.cache import batch as batch_module  # noqa: E402
from veloxquant_mlx.cache.options import (  # noqa: E402
    KeyformerOptions,
    KIVIOptions,
    PyramidKVOptions,
    SnapKVOptions,
    StreamingLLMOptions,
    XQuantOptions,
)

BASELINE = "mlx-lm KVCache"
METHODS = {
    BASELINE: None,
    "full": KVCacheConfig(),
    "kivi 4-bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=4),
    "kivi 2-bit": KVCacheConfig(method="kivi", options=KIVIOptions(kivi_group_size=32), kv_bits=2),
    "snapkv 2048": KVCacheConfig(options=SnapKVOptions(snap_budget=2048)),
    "streaming_llm 4+2044": KVCacheConfig(options=StreamingLLMOptions(stream_n_sink=4, stream_window_size=2044)),
    # the same mean budget as the two rows above (its default, 512, is not comparable)
    "pyramidkv 2048": KVCacheConfig(options=PyramidKVOptions(pyramid_budget=2048)),
    "keyformer 2048": KVCacheConfig(options=KeyformerOptions(keyformer_budget=2048)),
}
# the best of each other family by the bench's quality (the lowest KL of
# results/bench-quick.md among its methods that keep fewer bytes than full at 1k tokens),
# at their defaults: eviction's is streaming_llm, above
BEST_OF_FAMILY = {"vector-quantization": "vecinfer", "quantization": "age_tiered", "hybrid": "gear",
                  "cross-layer": "xquant", "low-rank": "palu", "coding": "kvtc", "merging": "cam"}
METHODS.update({method: KVCacheConfig(method=method) for method in BEST_OF_FAMILY.values()})
# xquant's shared codes cover at most xquant_max_ctx tokens (8,192 by default): room for 32k
METHODS["xquant"] = KVCacheConfig(method="xquant", options=XQuantOptions(xquant_max_ctx=65536))
# the other stores that batch stacked (cache/stacked.py), at their defaults
METHODS.update({method: KVCacheConfig(method=method) for method in (
    "kitty", "turboquant", "skvq", "zipcache", "cachegen", "nsnquant", "svdq", "spectral", "amc", "rocketkv",
    "kvquant", "a2ats", "adakv")})
# KIVI's packed batch attends in one launch of the fused kernel on CUDA; its per-sequence
# row batches it per sequence instead (each sequence's own attention and launch), for the
# comparison in the same run; so do StreamingLLM's and Keyformer's, against their packed
# rows, and the stacked stores'.
PER_SEQUENCE = {"kivi 4-bit, per sequence": "kivi 4-bit",
                "streaming_llm 4+2044, per sequence": "streaming_llm 4+2044",
                "keyformer 2048, per sequence": "keyformer 2048",
                "gear, per sequence": "gear", "age_tiered, per sequence": "age_tiered",
                "turboquant, per sequence": "turboquant", "xquant, per sequence": "xquant",
                "kvquant, per sequence": "kvquant", "adakv, per sequence": "adakv",
                "palu, per sequence": "palu", "a2ats, per sequence": "a2ats",
                "spectral, per sequence": "spectral", "vecinfer, per sequence": "vecinfer"}
METHODS.update({row: METHODS[packed] for row, packed in PER_SEQUENCE.items()})


_packer_for = batch_module.packer_for


def batched(caches: list, n: int) -> list:
    """``n`` sequences as one batch, merged as BatchGenerator does: sequence i a copy of the
    prefilled ``caches[i % len(caches)]`` (each a model's list of layer caches). Ours are
    copied first as whole sequences (``copy_single``: each copy's layers share a context of
    their own), as distinct requests would be: merged ``n`` times, one sequence's layers
    would share one copied context, and a per-sequence batch would hold one cache n times."""
    picks = [caches[i % len(caches)] for i in range(n)]
    if not hasattr(caches[0][0], "config"):  # mlx-lm's own caches
        return [c.merge([p[i] for p in picks]) for i, c in enumerate(caches[0])]
    seqs = [[batch_module.copy_single(c, "merge") for c in p] for p in picks]
    return [c.merge([s[i] for s in seqs]) for i, c in enumerate(caches[0])]


def overlapped(model, cache, y, steps):
    """Wall seconds per step over ``steps`` steps, run as ``generate_step`` runs them."""
    mx.async_eval(y)
    t0 = time.perf_counter()
    for _ in range(steps):
        next_y = mx.argmax(model(y[:, None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(next_y)
        mx.eval(y)
        y = next_y
    mx.eval(y)
    return y, (time.perf_counter() - t0) / steps


def measure(model, name, config, tokens, budget, steps, max_seqs, repeats, mix=1):
    for _ in range(repeats - 1):  # first use: compilation, kernel self-checks
        prefill(model, make_cache(model, config), tokens)
    gc.collect()
    mx.clear_cache()
    # the prompts: the whole one (its warm prefill timed), and with --mix the shorter ones
    lengths = [tokens.size * (j + 1) // mix for j in range(mix)]
    caches, firsts = [], []
    for n in lengths:
        cache = make_cache(model, config)
        t0 = time.perf_counter()
        logits = prefill(model, cache, tokens[:n])
        ttft = time.perf_counter() - t0
        caches.append(cache)
        firsts.append(mx.argmax(logits))
    # the batch's sequences, one of each length, batched as the real batch will be (its
    # layout's room and windows included), decoded as long as it will be: their bytes at
    # the end, each (two copies without --mix)
    probe = batched(caches, max(2, mix))
    y = mx.stack([firsts[i % mix] for i in range(max(2, mix))])
    for _ in range(steps + 2):
        y = mx.argmax(model(y[:, None], cache=probe)[:, -1], axis=-1)
        mx.eval(y)
    per_seq = sum(c.nbytes for c in probe) / max(2, mix)
    del probe
    held = min(max_seqs, int(budget // per_seq))
    row = {"cache": name, "bytes_per_seq": per_seq, "held": held, "ttft_s": ttft}
    if held == 0:
        return {**row, "tok_s": 0.0, "batch_bytes": 0}
    batch = batched(caches, held)
    del caches, cache
    gc.collect()
    y = mx.stack([firsts[i % mix] for i in range(held)])
    mx.reset_peak_memory()
    y, _ = overlapped(model, batch, y, 2)  # packs the batch, first-use work
    y, seconds = overlapped(model, batch, y, steps)
    return {**row, "tok_s": held / seconds, "step_s": seconds, "batch_bytes": sum(c.nbytes for c in batch),
            "peak_bytes": mx.get_peak_memory()}


def table(rows, budget) -> list[str]:
    """Ratios against mlx-lm's fp16 batch cache ("vs fp16") and against ours, ``full`` (its
    batches packed: one fused attention a layer where mlx-lm's masked one reads slowly)."""
    base, full = (next((r for r in rows if r["cache"] == name and "error" not in r), None)
                  for name in (BASELINE, "full"))
    out = ["| cache | KV MB a sequence | sequences held | vs fp16 | batch KV MB (of budget) "
           "| decode tok/s (all) | vs fp16 | vs full | step ms | TTFT s (alone) | TTFT s, last of N | peak GB, decode |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['cache']} | failed: {r['error']} |||||||||||")
            continue
        vs = (lambda k, b=base: f"{r[k] / b[k]:.2f}x" if b and b[k] else "-")
        out.append(
            f"| {r['cache']} | {r['bytes_per_seq'] / 1e6:.1f} | {r['held']} | {vs('held')} "
            f"| {r['batch_bytes'] / 1e6:.1f} ({r['batch_bytes'] / budget:.0%}) | {r['tok_s']:.1f} | {vs('tok_s')} "
            f"| {vs('tok_s', full)} | {r.get('step_s', 0) * 1e3:.1f} | {r['ttft_s']:.2f} | {r['ttft_s'] * r['held']:.1f} "
            f"| {r.get('peak_bytes', 0) / 1e9:.1f} |")
    return out


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        if "error" not in r and r["held"]:
            ax.scatter(r["held"], r["tok_s"], s=40)
            ax.annotate(r["cache"], (r["held"], r["tok_s"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("sequences held at once (fixed KV budget)")
    ax.set_ylabel("aggregate decode tokens / s")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3-8b", choices=list(PRESETS))
    ap.add_argument("--prompt", type=int, default=32768, help="prompt tokens of every request")
    ap.add_argument("--kv-gb", type=float, default=40.0, help="KV budget, GB (10^9 bytes)")
    ap.add_argument("--steps", type=int, default=16, help="timed decode steps")
    ap.add_argument("--max-seqs", type=int, default=256, help="most sequences a batch may hold")
    ap.add_argument("--prefill-repeats", type=int, default=2, help="prefills a method (the last is timed)")
    ap.add_argument("--mix", type=int, default=1,
                    help="prompt lengths in the batch: N lengths spread evenly up to --prompt, the "
                         "sequences taking them in turn (1: every sequence at --prompt)")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--out", default=None, help="markdown table (default benchmarks/results/serve_capacity-<preset>.md)")
    args = ap.parse_args()
    out = Path(args.out or Path(__file__).parent / "results" / f"serve_capacity-{args.preset}.md")
    budget = int(args.kv_gb * 1e9)
    model = build_model(args.preset, getattr(mx, args.dtype))
    tokens = mx.random.randint(0, model.args.vocab_size, (args.prompt,), key=mx.random.key(args.prompt))
    rows = []
    for name in args.methods:
        batch_module.packer_for = _packer_for if name not in PER_SEQUENCE else (lambda cls: None)
        try:
            rows.append(measure(model, name, METHODS[name], tokens, budget, args.steps, args.max_seqs,
                                args.prefill_repeats, args.mix))
        except Exception as exc:  # a row that fails is shown failed, the others still run
            traceback.print_exc()
            rows.append({"cache": name, "error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"})
        gc.collect()
        mx.clear_cache()
        print(rows[-1], flush=True)
    command = "python benchmarks/serve_capacity.py " + shlex.join(sys.argv[1:])
    lines = [f"# Serving capacity: {args.preset}, {args.prompt}-token prompts, {args.kv_gb:g} GB of KV",
             "", f"`{command}`", "",
             f"{platform.node()} / {mx.default_device()} / MLX {mx.__version__} / {args.dtype}; "
             f"{args.steps} timed decode steps of the whole batch; TTFT alone: a warm prefill of one "
             "prompt; TTFT, last of N: N prefills in turn (computed); peak GB, decode: the most memory "
             "held (weights, caches, transients) over the batch's warm-up and timed steps"
             + (f"; prompts of {args.mix} lengths up to {args.prompt}, taken in turn, KV MB a sequence "
                "their mean" if args.mix > 1 else "") + ".", "", *table(rows, budget), ""]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(lines))
    plot(rows, out.with_suffix(".png"))
    print("\n".join(lines))
    print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
