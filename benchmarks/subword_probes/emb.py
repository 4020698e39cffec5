"""Cosine similarity between the (tied) embeddings of the tokens each task copies."""
import numpy as np, random
import veloxquant_mlx
import mlx.core as mx
from veloxquant_mlx.cli_common import load_model
from veloxquant_mlx.bench.ruler import _NAMES, _TOWNS, _THINGS
from veloxquant_mlx.bench.tasks import _ADJECTIVES, _NOUNS
model, tok, _ = load_model("reference-subword")
E = np.array(model.model.embed_tokens.weight.astype(mx.float32))
def ids(words, prefix=""):
    out = []
    for w in words:
        i = tok.encode(prefix + w, add_special_tokens=False)
        if len(i) == 1: out.append(i[0])
    return out
rng = random.Random(0)
groups = {
    "towns (qa answers)": ids(_TOWNS),
    "names (qa)": ids(_NAMES),
    "things (qa)": ids(_THINGS),
    "uppercase letters (vt names)": ids(list("ABCDEFGHIJKLMNOPQRSTUVWXYZ")),
    "3-digit groups (needle values)": ids([f"{rng.randrange(100,1000)}" for _ in range(40)]),
    "adjectives (needle keys)": ids(_ADJECTIVES),
    "random vocabulary ids": rng.sample(range(3, 7359), 60),
}
for g, ii in groups.items():
    X = E[ii]; n = np.linalg.norm(X, axis=1, keepdims=True); Xn = X / n
    C = Xn @ Xn.T; off = C[~np.eye(len(ii), dtype=bool)]
    print(f"{g:34s} n={len(ii):3d} norm {n.mean():6.2f}  pairwise cos mean {off.mean():.3f} min {off.min():.3f} max {off.max():.3f}")
