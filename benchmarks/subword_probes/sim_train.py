"""Simulate train.py's data stream (make_sequence, --mixture ruler, subword tokenizer)
without torch: a stub torch module lets train.py import. The training corpus
(training/data/train.txt, from Debian's bible-kjv-text) is not on this machine, so the
held-out book (Acts) repeated 32x stands in (format and token counts only).
Reports, per phase length: share of sequences per task, share of the batch's answer
tokens (kind == 2) per task, and whether each example's answer survived truncation."""
import pathlib
REPO = pathlib.Path(__file__).resolve().parents[2]
import sys, types, random, collections
from unittest import mock
import numpy as np
for m in ("torch", "torch.nn", "torch.nn.functional", "torch.utils", "torch.utils.data"):
    sys.modules[m] = mock.MagicMock()
sys.path.insert(0, str(REPO / "training"))
import train as T

tok = T.Tok(str(REPO / "veloxquant/assets/reference_subword/tokenizer.json"))
corpus = T.tasks.load_default_filler() * 32
L = int(sys.argv[1]); nseq = int(sys.argv[2])
mixture = "ruler"

# wrap the generators to record which task each example came from and its answer size
log = []
orig_rp, orig_bp = T.ruler_parts, T.tasks.build_parts
def rp(task, rng, size, corpus, tok):
    parts = orig_rp(task, rng, size, corpus, tok)
    log.append(("ruler:" + task, size, parts)); return parts
def bp(task, rng, budget, corpus, **kw):
    parts = orig_bp(task, rng, budget, corpus, **kw)
    log.append((task, budget, parts)); return parts
T.ruler_parts = rp; T.tasks.build_parts = bp

seq_tasks = collections.Counter(); ans_tok = collections.Counter(); ex_count = collections.Counter()
lost = collections.Counter(); parts_total = collections.Counter(); wholly = collections.Counter(); part_tokens = collections.defaultdict(list)
rng = random.Random("sim/0")
for s in range(nseq):
    log.clear()
    ids, kind = T.make_sequence(rng, L, corpus, tok, mixture)
    n_ans = int((kind == 2).sum())
    if not log:
        key = "copy" if n_ans else "text"
        seq_tasks[key] += 1; ans_tok[key] += n_ans; continue
    # answer tokens of each example, as encoded; what is left of them in the sequence
    total_expected = 0
    for task, size, parts in log:
        ex_count[task] += 1
        a = sum(len(tok.encode(t)) for t, is_a in parts if is_a)
        p = sum(len(tok.encode(t)) for t, is_a in parts if not is_a)
        part_tokens[task].append((p, a, size))
        ans_tok[task] += a; total_expected += a
    seq_tasks["+".join(sorted({t for t, _, _ in log}))] += 0  # not used
    if n_ans < total_expected:
        lost["tokens"] += total_expected - n_ans
    # answer runs (kind == 2) in order; an example whose answer is cut short or missing
    runs, cur = [], 0
    for k in list(kind) + [0]:
        if k == 2: cur += 1
        elif cur: runs.append(cur); cur = 0
    exp = []
    for task, size, parts in log:
        for t, is_a in parts:
            if is_a: exp.append((task, len(tok.encode(t))))
    # greedy match: runs are the answers in order; missing ones at the end
    for i, (task, a) in enumerate(exp):
        got = runs[i] if i < len(runs) else 0
        parts_total[task] += 1
        if got < a: lost[task] += 1
        if got == 0: wholly[task] += 1
tot_ex = sum(ex_count.values()); tot_ans = sum(ans_tok.values())
print(f"L={L}, {nseq} sequences; copy {seq_tasks['copy']}, text {seq_tasks['text']}, task examples {tot_ex}")
print(f"answer tokens lost to truncation: {lost['tokens']}")
print("answer parts (questions) truncated / of which wholly lost / total:", {k: (lost[k], wholly[k], parts_total[k]) for k in parts_total})
print(f"{'task':26s} {'examples':>8s} {'%ex':>6s} {'ans tok/ex':>10s} {'%ans tok':>8s} {'prompt tok (mean)':>17s} {'slot size (mean)':>16s} {'prompt+ans>slot':>15s}")
for task in sorted(ans_tok, key=lambda t: -ans_tok[t]):
    n = ex_count.get(task, 0)
    pt = part_tokens.get(task, [])
    over = sum(1 for p, a, s in pt if (p + a + 2) > (s if task.startswith('ruler:') else s / tok.chars_per_token / 0.95 + 1)) if pt else 0
    print(f"{task:26s} {n:8d} {100*n/max(tot_ex,1):6.1f} {ans_tok[task]/max(n,1):10.1f} {100*ans_tok[task]/tot_ans:8.2f} "
          f"{np.mean([p for p,_,_ in pt]) if pt else 0:17.0f} {np.mean([s for _,_,s in pt]) if pt else 0:16.0f} {over:15d}")
