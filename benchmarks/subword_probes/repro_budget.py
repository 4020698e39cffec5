"""Minimal reproduction: train.py sizes tasks.py examples in bytes with the prose
chars-per-token of the subword tokenizer (Tok.chars_per_token, ~2.4), but VAR statements
and hex keys are ~1 token per character, so at L=256 the example overflows the sequence
and make_sequence cuts the answer off (ids[p:p+n] = b[:n] with n = L+1-p)."""
import pathlib
REPO = pathlib.Path(__file__).resolve().parents[2]
import random
import veloxquant_mlx
from tokenizers import Tokenizer
from veloxquant_mlx.bench import tasks
t = Tokenizer.from_file(str(REPO / "veloxquant/assets/reference_subword/tokenizer.json"))
enc = lambda s: t.encode(s, add_special_tokens=False).ids
corpus = tasks.load_default_filler()
sample = corpus[:50_000]; cpt = len(sample) / len(enc(sample))   # as train.Tok does
L = 256
budget = int((L + 1) * cpt * 0.95)                                 # as make_sequence does
print(f"chars per token {cpt:.2f}; byte budget for a {L}-token sequence: {budget}")
for task, opts, nq in (("variable_tracking", {"hops": 4, "chains": 2}, 1), ("kv_lookup", {}, 1), ("niah_multikey", {"n_keys": 4}, 1)):
    over = 0
    for i in range(20):
        parts = tasks.build_parts(task, random.Random(i), budget, corpus, n_queries=nq, opts=opts)
        n = 1 + sum(len(enc(x)) for x, _ in parts) + 1              # <bos> ... <eos>
        over += n > L + 1
        if i == 0:
            print(f"{task}: {n} tokens for a {L + 1}-token slot; answer {parts[-1][0]!r}")
    print(f"  {over}/20 examples longer than the sequence (answer cut off)")
