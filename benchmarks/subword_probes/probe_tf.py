"""Teacher-forced look at the answers: the bench's prompt (leaderboard.make_examples) +
the answer as train.py trains it (in_text_order for cwe/niah_multivalue, ' ' for vt,
', ' for cwe/multivalue), one forward pass; per answer token: argmax == target, p(target).
Also the top-5 next tokens at the first answer position."""
import sys, json
import veloxquant_mlx
import mlx.core as mx
import numpy as np
from veloxquant_mlx.cli_common import load_model, compute_dtype
from veloxquant_mlx.bench import leaderboard

def in_text_order(task, prompt, answers):  # copied from training/train.py
    mark = " {}" if task == "niah_multivalue" else ". {} "
    return sorted(answers, key=lambda a: prompt.find(mark.format(a)) % (1 << 62))

ctxs = [int(c) for c in sys.argv[1].split(",")]
n = int(sys.argv[2]); tasks = sys.argv[3].split(",")
model, tok, _ = load_model("reference-subword")
model.set_dtype(compute_dtype("auto"))
T = tok._tokenizer if hasattr(tok, "_tokenizer") else tok
out = {}
for ctx in ctxs:
    for task in tasks:
        exs = leaderboard.make_examples(tok, [task], n, ctx, 0)
        for ex in exs:
            ans = list(ex.answers)
            if task in ("niah_multivalue", "cwe"):
                ans = in_text_order(task, ex.prompt, ans)
            said = {"niah_multivalue": ", ", "cwe": ", ", "vt": " "}.get(task, "").join(ans)
            p_ids = tok.encode(ex.prompt)
            a_ids = tok.encode(said, add_special_tokens=False)
            ids = mx.array([p_ids + a_ids])
            logits = model(ids)[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            lp = np.array(lp)
            L = len(p_ids)
            pos = np.arange(L - 1, L - 1 + len(a_ids))
            tgt = np.array(a_ids)
            pred = lp[pos].argmax(-1)
            ptgt = np.exp(lp[pos, tgt])
            top = np.argsort(-lp[L - 1])[:5]
            rec = {"task": task, "ctx": ctx, "index": ex.index, "answer_tokens": len(a_ids),
                   "tok_acc": float((pred == tgt).mean()), "exact": bool((pred == tgt).all()),
                   "first_tok_p": float(ptgt[0]), "mean_p": float(ptgt.mean()),
                   "top5_first": [(tok.decode([int(t)]), round(float(np.exp(lp[L-1, t])), 3)) for t in top],
                   "per_token": [(tok.decode([int(t)]), int(pr == t), round(float(p), 3)) for t, pr, p in zip(tgt, pred, ptgt)]}
            out.setdefault(f"{task}@{ctx}", []).append(rec)
        recs = out[f"{task}@{ctx}"]
        print(f"{task}@{ctx}: tok_acc {np.mean([r['tok_acc'] for r in recs]):.2f} exact {np.mean([r['exact'] for r in recs]):.2f} "
              f"first_tok_p {np.mean([r['first_tok_p'] for r in recs]):.2f} mean_p {np.mean([r['mean_p'] for r in recs]):.2f}", flush=True)
        for r in recs[:2]:
            print("   top5 at answer start:", r["top5_first"])
            print("   per token:", r["per_token"][:40])
json.dump(out, open(f"tf_{sys.argv[1].replace(',','_')}_{sys.argv[3].replace(',','_')}.json", "w"), indent=1)
