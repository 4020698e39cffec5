"""Evaluate the shipped reference model with MLX on the CPU.

Measures, on held-out examples (tasks.EVAL_SEED, haystacks cut from the
held-out book) and held-out text:

* retrieval accuracy per task (veloxquant/bench/tasks.py) at each context
  length, with the full KV cache and with a "sinks + recent window" cache:
  mlx-lm's ``RotatingKVCache(max_size=260, keep=4)`` in every layer
  (4 attention-sink tokens + the 256 most recent tokens);
* perplexity per byte (= per token) of the held-out text, and the perplexity
  of a unigram byte model fitted on that same text (the best any unigram model
  can do on it).

Usage::

    python benchmarks/reference_model.py                       # the full table (about 40 min on 2 cores)
    python benchmarks/reference_model.py --examples 4096:2 --ppl-bytes 20000   # quick look

Decoding is greedy; an answer counts when the generated text starts with the
expected answer (tasks.score). Prompts are prefilled in chunks (2048 tokens
for the full cache, as mlx-lm's generate does; 256 for the rotating cache,
which only keeps 260 positions anyway). Computation is in float32 (the
weights are float16; MLX's CPU half-precision matmul is very slow).

MLX's Linux CPU wheel links the reference (netlib) BLAS, which is about 30x
slower than OpenBLAS here; importing veloxquant_mlx first makes MLX use an
installed OpenBLAS (``apt-get install libopenblas0-pthread``; see
veloxquant/_blas.py). Results are the same to float rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / "veloxquant" / "assets" / "reference_model"

import veloxquant_mlx._blas as blas  # noqa: E402  before mlx: may load OpenBLAS

import mlx.core as mx  # noqa: E402
from mlx_lm import load  # noqa: E402
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache  # noqa: E402

try:
    from veloxquant_mlx.bench import tasks  # noqa: E402
except ImportError:  # running from a checkout without the package installed
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "vq_tasks", REPO / "veloxquant" / "bench" / "tasks.py"
    )
    tasks = importlib.util.module_from_spec(_spec)
    sys.modules["vq_tasks"] = tasks
    _spec.loader.exec_module(tasks)

SINKS, WINDOW = 4, 256


def make_cache(model, kind: str):
    if kind == "full":
        return make_prompt_cache(model)
    return [RotatingKVCache(max_size=SINKS + WINDOW, keep=SINKS) for _ in model.layers]


def greedy(
    model, ids, cache, max_new: int, prefill_step: int, stop_prefix: str | None = None
) -> str:
    """Prefill ids[:-1] in chunks, then decode greedily from ids[-1]."""
    x = mx.array(ids)[None]
    n, pos = len(ids), 0
    while pos < n - 1:
        s = min(prefill_step, n - 1 - pos)
        mx.eval(model(x[:, pos : pos + s], cache=cache))
        pos += s
    tok, out = x[:, n - 1 :], []
    for _ in range(max_new):
        t = int(mx.argmax(model(tok, cache=cache)[0, -1]).item())
        if t >= 256:  # <eos> or another special token
            break
        out.append(t)
        text = bytes(out).decode("utf-8", "replace")
        if stop_prefix is not None and not stop_prefix.startswith(
            text.lstrip()[: len(stop_prefix)]
        ):
            break  # already wrong: stop early
        tok = mx.array([[t]])
    return bytes(out).decode("utf-8", "replace")


def evenly(n: int) -> list:
    if n == 1:
        return [0.5]
    return [round(0.05 + 0.9 * i / (n - 1), 3) for i in range(n)]


def perplexity(model, text: str, window: int) -> dict:
    data = text.encode("utf-8")
    nll, count = 0.0, 0
    for start in range(0, len(data), window - 1):
        piece = list(data[start : start + window - 1])
        ids = mx.array([256] + piece)[None]
        logits = model(ids[:, :-1]).astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tgt = ids[:, 1:]
        ll = mx.take_along_axis(logp, tgt[..., None], axis=-1)
        nll -= float(ll.sum().item())
        count += len(piece)
    counts = Counter(data)
    total = sum(counts.values())
    h = -sum(c / total * math.log(c / total) for c in counts.values())
    return {
        "bytes": count,
        "window_tokens": window,
        "model_nll_per_byte": nll / count,
        "model_ppl": math.exp(nll / count),
        "model_bits_per_byte": nll / count / math.log(2),
        "unigram_ppl": math.exp(h),
        "unigram_bits_per_byte": h / math.log(2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", default=str(DEFAULT_MODEL))
    ap.add_argument(
        "--examples", default="4096:10,8192:5", help="context:examples_per_task,..."
    )
    ap.add_argument("--tasks", default=",".join(tasks.TASKS))
    ap.add_argument("--caches", default="full,window")
    ap.add_argument("--seed", type=int, default=tasks.EVAL_SEED)
    ap.add_argument("--ppl-window", type=int, default=2048)
    ap.add_argument(
        "--ppl-bytes",
        type=int,
        default=0,
        help="limit the held-out text (0 = all of it)",
    )
    ap.add_argument("--json", default=str(REPO / "bench-out" / "reference_model.json"))
    args = ap.parse_args()

    mx.set_default_device(mx.cpu)
    t0 = time.time()
    model, tokenizer = load(args.model)
    model.set_dtype(mx.float32)
    print(f"model {args.model} (float32 compute, BLAS: {blas.loaded or 'bundled'})", flush=True)

    plan = [
        (int(c), int(n)) for c, n in (x.split(":") for x in args.examples.split(","))
    ]
    task_list = [t for t in args.tasks.split(",") if t]
    caches = [c for c in args.caches.split(",") if c]
    results: dict = {}
    for ctx, n in plan:
        for task in task_list:
            exs = tasks.make_examples(task, n, ctx, seed=args.seed, depths=evenly(n))
            for kind in caches:
                rows = []
                t1 = time.time()
                for ex in exs:
                    ids = tokenizer.encode(ex.prompt)
                    assert len(ids) == ex.n_tokens, (len(ids), ex.n_tokens)
                    out = greedy(
                        model,
                        ids,
                        make_cache(model, kind),
                        ex.max_new_tokens,
                        2048 if kind == "full" else 256,
                        stop_prefix=ex.answer,
                    )
                    rows.append(
                        {
                            "depth": ex.depth,
                            "actual_depth": ex.meta["actual_depth"],
                            "n_tokens": ex.n_tokens,
                            "distance_tokens": ex.meta["distance_tokens"],
                            "ok": tasks.score(ex, out),
                            "output": out,
                            "answer": ex.answer,
                        }
                    )
                acc = sum(r["ok"] for r in rows) / len(rows)
                results.setdefault(str(ctx), {}).setdefault(kind, {})[task] = {
                    "accuracy": acc,
                    "n": len(rows),
                    "seconds": round(time.time() - t1, 1),
                    "examples": rows,
                }
                print(
                    f"ctx {ctx:5d} {kind:6s} {task:18s} acc {acc:.2f} (n={len(rows)}, "
                    f"{time.time() - t1:.0f}s)",
                    flush=True,
                )

    held = tasks.load_default_filler()
    if args.ppl_bytes:
        held = held[: args.ppl_bytes]
    t1 = time.time()
    ppl = perplexity(model, held, args.ppl_window)
    ppl["seconds"] = round(time.time() - t1, 1)
    print(
        f"held-out perplexity per byte {ppl['model_ppl']:.3f} ({ppl['model_bits_per_byte']:.3f} bits/byte) "
        f"vs unigram {ppl['unigram_ppl']:.2f} ({ppl['unigram_bits_per_byte']:.3f} bits/byte) "
        f"over {ppl['bytes']:,} bytes",
        flush=True,
    )

    # table
    print()
    head = (
        "| task | "
        + " | ".join(f"{c} full | {c} sinks+window" for c, _ in plan)
        + " |"
    )
    print(head)
    print("|" + "---|" * (1 + 2 * len(plan)))
    for task in task_list:
        cells = []
        for ctx, _ in plan:
            for kind in ("full", "window"):
                r = results.get(str(ctx), {}).get(kind, {}).get(task)
                cells.append(f"{r['accuracy'] * 100:.0f}% ({r['n']})" if r else "-")
        print(f"| {task} | " + " | ".join(cells) + " |")
    print(
        f"\nheld-out perplexity: model {ppl['model_ppl']:.3f}, unigram baseline {ppl['unigram_ppl']:.2f} "
        f"(per byte; {ppl['bytes']:,} bytes of {tasks.HELDOUT_TEXT_PATH.name})"
    )

    out = {
        "model": args.model,
        "compute_dtype": "float32",
        "blas": blas,
        "seed": args.seed,
        "sink_tokens": SINKS,
        "window_tokens": WINDOW,
        "results": results,
        "perplexity": ppl,
        "seconds": round(time.time() - t0, 1),
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.json} in {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
