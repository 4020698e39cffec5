"""Can the shipped model copy (teacher forced) a) 5-letter uppercase names, b) lowercase
random words (its copy warm-up), c) 7-digit numbers, written twice as in train.py's
copy_sequence ("x\n" then "x")?  And qa-format facts with 1, 2 and 7 facts (no haystack):
p(correct town) at the answer. ``python probe_copy.py [MODEL]``: the subword model by
default, ``reference`` for the byte-level one."""
import random
import sys
import veloxquant_mlx
import mlx.core as mx
import numpy as np
from veloxquant_mlx.cli_common import load_model, compute_dtype
model, tok, _ = load_model(sys.argv[1] if len(sys.argv) > 1 else "reference-subword")
model.set_dtype(compute_dtype("auto"))

def tf(prompt, answer):
    p = tok.encode(prompt); a = tok.encode(answer, add_special_tokens=False)
    lg = model(mx.array([p + a]))[0].astype(mx.float32)
    lp = np.array(lg - mx.logsumexp(lg, axis=-1, keepdims=True))
    pos = np.arange(len(p) - 1, len(p) - 1 + len(a)); t = np.array(a)
    return float((lp[pos].argmax(-1) == t).mean()), np.exp(lp[pos, t])

rng = random.Random(0)
U = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
def words(kind, n):
    if kind == "upper5": return " ".join("".join(rng.choice(U) for _ in range(5)) for _ in range(n))
    if kind == "VAR": return " ".join("VAR " + "".join(rng.choice(U) for _ in range(5)) + " = " + str(rng.randrange(10000, 100000)) + "." for _ in range(n))
    if kind == "lower": return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(2, 7))) for _ in range(n))
    if kind == "digits7": return " ".join(str(rng.randrange(10**6, 10**7)) for _ in range(n))
for kind in ("lower", "digits7", "upper5", "VAR"):
    accs, later = [], []
    for i in range(5):
        x = words(kind, 20)
        acc, p = tf(x + "\n", x)
        accs.append(acc)
    print(f"copy {kind:8s}: teacher-forced token accuracy of the second copy {np.mean(accs):.2f}")

from veloxquant_mlx.bench.ruler import _NAMES, _TOWNS, _THINGS
for nf in (1, 2, 7):
    ok, ps = 0, []
    for i in range(20):
        people = rng.sample(_NAMES, 3); things = rng.sample(_THINGS, 4); towns = rng.sample(_TOWNS, 7)
        pairs = [(p, t) for p in people[:2] for t in things[:3]] + [(people[2], things[3])]
        rng.shuffle(pairs); pairs = pairs[:nf]
        facts = [f"{p} keeps the {t} in {towns[j]}." for j, (p, t) in enumerate(pairs)]
        j = rng.randrange(nf); person, thing = pairs[j]
        prompt = ("Answer the question based on the given documents.\n\nDocument 1:\n" + " ".join(facts)
                  + f"\n\nQuestion: In which town does {person} keep the {thing}?\nAnswer: {person} keeps the {thing} in ")
        acc, p = tf(prompt, towns[j]); ok += acc; ps.append(p[0])
    print(f"qa, {nf} fact(s), no haystack: top-1 {ok/20:.2f}, mean p(correct) {np.mean(ps):.3f}")

print("--- copy format, capitalised names / towns / fact sentences")
for kind in ("towns", "names", "facts"):
    accs = []
    for i in range(5):
        if kind == "towns": x = " ".join(rng.choice(_TOWNS) for _ in range(20))
        elif kind == "names": x = " ".join(rng.choice(_NAMES) for _ in range(20))
        else: x = " ".join(f"{rng.choice(_NAMES)} keeps the {rng.choice(_THINGS)} in {rng.choice(_TOWNS)}." for _ in range(6))
        acc, p = tf(x + "\n", x); accs.append(acc)
    print(f"copy {kind:8s}: teacher-forced token accuracy of the second copy {np.mean(accs):.2f}")
