"""cwe on a subword model, free and teacher-forced with the model's own choices: which
words it writes (with their counts in the list), and at each of the first four words the
mass on the common word it favours, whether it was already written, and the mass on the
common words not yet written (notes/subword_baseline.md section 10).

    python benchmarks/subword_probes/cwe_favourite.py MODEL_FOLDER [--context 1024] [--examples 5]
"""

import argparse
import re
from collections import Counter

import veloxquant_mlx  # noqa: F401  (before mlx: the system BLAS)
import mlx.core as mx
import mlx_lm

from veloxquant_mlx.bench import ruler

ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
ap.add_argument("model")
ap.add_argument("--context", type=int, default=1024)
ap.add_argument("--examples", type=int, default=5)
args = ap.parse_args()
model, tok = mlx_lm.load(args.model)
model.set_dtype(mx.float32)


def count(s):
    return len(tok.encode(s))


def first(w):
    return tok.encode(w, add_special_tokens=False)[0]


def next_token(prefix):
    return mx.softmax(model(mx.array(tok.encode(prefix))[None])[0, -1].astype(mx.float32))


for i in range(args.examples):
    ex = ruler.make_ruler_example("cwe", args.context, seed=0, index=i, count_tokens=count)
    listed = Counter(re.findall(r"\d+\. (\w+)", ex.prompt))
    out = mlx_lm.generate(model, tok, prompt=ex.prompt, max_tokens=ex.max_new_tokens, verbose=False)
    said = [(w, listed.get(w, 0)) for w in re.findall(r"[a-z]+", out)[:12]]
    print(f"example {i}: found {sum(a in out for a in ex.answers)}/10; said {said}")
    written, steps = [], []
    for _ in range(4):
        p = next_token(ex.prompt + "".join(w + ", " for w in written))
        mass = {w: float(p[first(w)]) for w in ex.answers}
        favourite = max(mass, key=mass.get)
        allowed = sum(v for w, v in mass.items() if w not in written)
        steps.append(f"{favourite} ({'again' if favourite in written else 'new'}, {mass[favourite]:.2f}; "
                     f"not yet written {allowed:.2f})")
        written.append(favourite)
    print("  own choices: " + " -> ".join(steps))
