"""Score the shipped subword model on the leaderboard's own generators and scorer
(leaderboard.make_examples + leaderboard.score_examples, full cache, float32, CPU)."""
import sys, json, time
import veloxquant_mlx
import mlx.core as mx
from veloxquant_mlx.cli_common import load_model, compute_dtype
from veloxquant_mlx.bench import leaderboard

ctxs = [int(c) for c in sys.argv[1].split(",")]
n = int(sys.argv[2])
tasks = sys.argv[3].split(",") if len(sys.argv) > 3 else ["niah_single","niah_multikey","niah_multivalue","vt","cwe","qa"]
seed = int(sys.argv[4]) if len(sys.argv) > 4 else 0
model, tok, _ = load_model("reference-subword")
model.set_dtype(compute_dtype("auto"))
cfg = leaderboard.config_for("full", {})
res = {}
for ctx in ctxs:
    t0 = time.time()
    exs = []
    for t in tasks:
        try:
            exs += leaderboard.make_examples(tok, [t], n, ctx, seed)
        except ValueError as e:
            print(f"ctx {ctx}: {e}")
    r = leaderboard.score_examples(model, tok, cfg, exs)
    for o, ex in zip(r["outputs"], exs):
        o["answers"] = list(ex.answers); o["n_tokens"] = ex.n_tokens; o["meta"] = ex.meta
    res[ctx] = r
    print(f"ctx {ctx} ({time.time()-t0:.0f}s):", " ".join(f"{t}={v:.0f}" for t, v in r["scores"].items()), flush=True)
    for o in r["outputs"]:
        print(f"  {o['task']:16s} {o['index']} score={o['score']:.2f} out={o['output'][:90]!r} ref={', '.join(o['answers'])[:90]!r}")
json.dump(res, open(f"bench_{'_'.join(map(str,ctxs))}_n{n}_s{seed}.json", "w"), indent=1)
