"""A2ATS's retrieving decode read (issue 30: ``retrieval._step_graph``, one compiled pass: the
query rotated to b in the step's split of its halves or pairs, the scores by one lookup-table
product and one gather of the codes' views kept between codings, the top k of each query head
by one sort of keys that order scores as floats and ties by position, the kept rows gathered
by a negative flat index) against the selection and attention computed the straightforward
way in float64, over 40 decode steps that code 5 blocks, change k and grow the buffers.

The reference, per step and KV head: q~ = R_b q_pre, each query rotated back by the step's
angle ``float32(i - b) * w`` (in float64 from there), the score of every candidate (coded,
past the sinks) ``sum_j q~_j . C[code_j]`` from the store's codes and codebook (the stored
format, not what the read changed), each query head's top k scores with ties at the k-th
to the latest tokens, their union, the sinks and the uncoded tail, and attention over those
exact rows.

Tolerance: the read's choice is the reference's where the k-th and (k+1)-th scores are
equal (equal codes: the same terms summed the same way on both sides) or apart by more than
the float32 rounding of a score could move them, which the data are checked to satisfy
(``MARGIN`` = 2 times a bound of ``gamma(D + 16)`` times ``sum |q~||c|``: the rotation's cosine
and sine, the table's s products and the n-term sum); the attention over the chosen rows
is then a float32 evaluation of the reference's (``float64_attention``'s bound, per query
row and channel, with the gathered count for the softmax's and the mix's sums).

The read has no device branch (pure MLX on every device, no fused kernel): the CPU's and a
GPU's decode paths of ``kivi_decode`` are set anyway, as the other decode-read tests set
them, so that a read routed through them later is checked on both."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from float64_attention import gamma
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import A2ATSOptions
from veloxquant_mlx.cache.rope import Rotary
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.a2ats import retrieval
from veloxquant_mlx.methods.a2ats.cache import N_SINK, A2ATSCache

BASE, B_FAR, PROMPT, STEPS, WINDOW, FRACTION, MARGIN = 10000.0, 64, 150, 40, 8, 0.1, 2.0


def rope(x, offset, traditional):
    return mx.fast.rope(x, x.shape[-1], traditional=traditional, base=BASE, scale=1.0, offset=offset)


def a2ats(bits, sub_dim, traditional):
    cache = A2ATSCache(KVCacheConfig(method="a2ats", options=A2ATSOptions(
        a2ats_retrieval_fraction=FRACTION, a2ats_window=WINDOW, a2ats_codebook_bits=bits, a2ats_sub_dim=sub_dim,
        a2ats_b=B_FAR, a2ats_rope_base=BASE)), None, 0)
    cache.rotary = Rotary(BASE, traditional)  # the store is made at the first keys, with this rotary
    return cache


def rotated_back(q, angle_f32, traditional):
    """``q`` (..., D) float64 rotated by minus the angles (D/2,) (``cache/rope.derotate``)."""
    cos, sin = np.cos(angle_f32.astype(np.float64)), np.sin(angle_f32.astype(np.float64))
    d = q.shape[-1]
    x1, x2 = (q[..., 0::2], q[..., 1::2]) if traditional else (q[..., : d // 2], q[..., d // 2 :])
    y1, y2 = x1 * cos + x2 * sin, x2 * cos - x1 * sin
    if traditional:
        return np.stack([y1, y2], axis=-1).reshape(q.shape)
    return np.concatenate([y1, y2], axis=-1)


def reference_step(store, q, position, scale, traditional):
    """(attention (B, Hq, 1, D) float64, its bound, the smallest gap of a k-th score to the
    next that is not a tie, relative to its rounding bound) for a decode query at
    ``position``, from the store's rows, codes and codebook after the step."""
    b, hq, _, d = q.shape
    h = store.keys.buffer.shape[1]
    gqa, s = hq // h, store.sub_dim
    t, stop, first = store.length, store.codes.length, store.n_sink
    k = min(int(store.fraction * t), stop - first)
    assert 0 < k < t - store.window - first, (t, k)  # a retrieving step
    keys = np.array(store.keys.buffer[:, :, :t], dtype=np.float64)
    values = np.array(store.values.buffer[:, :, :t], dtype=np.float64)
    codes = np.array(store.codes.buffer[:, :, first:stop].astype(mx.int32))  # (B, H, n_cand, D/s)
    centroids = np.array(store.centroids.astype(mx.float32), dtype=np.float64)  # (B, K, s)
    w = np.array(store.rotary.inverse_frequencies(d))  # float32, as the step's
    angle = np.float32(position - store.query_offset) * w  # float32 products, as the step's
    qf = np.array(q.astype(mx.float32), dtype=np.float64).reshape(b, h, gqa, d)
    q_b = rotated_back(qf, angle, traditional).reshape(b, h, gqa, d // s, s)
    out = np.zeros((b, h, gqa, d))
    bound = np.zeros_like(out)
    worst_gap = math.inf
    most = min(store.keys.buffer.shape[2], first + min(gqa * int(store.fraction * store.keys.buffer.shape[2]),
                                                       store.codes.buffer.shape[2] - first)
               + store.window + max(1, store.window) - 1)
    for row in range(b):
        c = centroids[row][codes[row]]  # (H, n_cand, D/s, s): each candidate's centroids
        scores = np.einsum("hgjs,htjs->hgt", q_b[row], c)
        size = np.einsum("hgjs,htjs->hgt", np.abs(q_b[row]), np.abs(c))
        rounding = gamma(d + 16) * size  # the most float32 may move each score
        for head in range(h):
            union = set()
            for g in range(gqa):
                position_of = np.arange(scores.shape[-1])
                order = np.lexsort((position_of, scores[head, g]))[::-1]  # by score, ties: the latest first
                union.update((order[:k] + first).tolist())
                kth, nxt = order[k - 1], order[k]
                if scores[head, g, kth] != scores[head, g, nxt]:
                    gap = scores[head, g, kth] - scores[head, g, nxt]
                    worst_gap = min(worst_gap, gap / (rounding[head, g, kth] + rounding[head, g, nxt]))
            kept = sorted(set(range(first)) | union | set(range(stop, t)))
            assert len(kept) <= most
            kk, vv = keys[row, head, kept], values[row, head, kept]
            qs = qf[row, head] * scale
            logits = qs @ kk.T
            p = np.exp(logits - logits.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[row, head] = p @ vv
            delta = gamma(d + 3) * (np.abs(qs) @ np.abs(kk).T).max(axis=-1, keepdims=True)
            bound[row, head] = (np.expm1(2 * delta) + gamma(most + 3)) * (p @ np.abs(vv))
    return out.reshape(b, hq, 1, d), bound.reshape(b, hq, 1, d), worst_gap


def decode_against_reference(monkeypatch, pure_path, *, batch, d, sub_dim, bits, traditional, tied, seed):
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    h, gqa, total = 2, 2, PROMPT + STEPS
    if tied:  # three pre-RoPE keys a row: equal codes, scores tied to the bit at every k-th
        base = mx.random.normal((batch, 1, 3, d), key=mx.random.key(seed))
        which = mx.random.randint(0, 3, (batch, h, total), key=mx.random.key(seed + 1))
        pre = mx.take_along_axis(mx.broadcast_to(base, (batch, h, 3, d)), which[..., None], axis=2)
    else:
        pre = mx.random.normal((batch, h, total, d), key=mx.random.key(seed))
    keys = rope(pre, 0, traditional)
    values = mx.random.normal((batch, h, total, d), key=mx.random.key(seed + 2))
    cache, scale = a2ats(bits, sub_dim, traditional), d**-0.5
    for start, stop in ((0, 100), (100, PROMPT)):  # a chunked prompt
        q = rope(mx.random.normal((batch, h * gqa, stop - start, d), key=mx.random.key(seed + start)), start,
                 traditional)
        cache.update_and_fetch(keys[:, :, start:stop], values[:, :, start:stop])
        cache.attend(q, keys[:, :, start:stop], values[:, :, start:stop], scale=scale, mask="causal")
    coded, ks, rooms, worst = set(), set(), set(), 0.0
    for i in range(PROMPT, total):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        q = rope(mx.random.normal((batch, h * gqa, 1, d), key=mx.random.key(1000 + i)), i, traditional)
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=scale, mask=None)
        store = cache.store
        ref, bound, gap = reference_step(store, q, i, scale, traditional)
        assert gap > MARGIN, f"step {i}: a k-th score {gap:.1f} roundings from the next: a near tie, change the seed"
        err = np.abs(np.array(out, dtype=np.float64) - ref)
        assert (err <= bound).all(), (i, float((err - bound).max()), float(bound.max()))
        worst = max(worst, float((err / bound).max()))
        coded.add(store.codes.length)
        ks.add(int(store.fraction * store.length))
        rooms.add((store.keys.capacity, store.codes.capacity))
    assert len(coded) >= STEPS // WINDOW and len(ks) >= 4 and len(rooms) >= 2  # codings, k's changes, growths
    return worst


CASES = {
    # D/s sub-spaces, each rotary pair's halves D/2 apart: the query split in halves (2 parts)
    "halves": dict(batch=1, d=64, sub_dim=8, bits=4, traditional=False, tied=False, seed=11),
    # two rows, each with its own codebook; three keys a row, so the k-th scores tie
    "tied rows": dict(batch=2, d=64, sub_dim=8, bits=2, traditional=False, tied=True, seed=21),
    # adjacent rotary pairs: the query split in pairs, one part
    "traditional": dict(batch=1, d=64, sub_dim=8, bits=3, traditional=True, tied=False, seed=31),
    "traditional tied": dict(batch=1, d=64, sub_dim=8, bits=2, traditional=True, tied=True, seed=41),
    # D/2 not a multiple of s (3 sub-spaces of 16): the halves split, one part
    "odd sub-spaces": dict(batch=1, d=48, sub_dim=16, bits=3, traditional=False, tied=False, seed=51),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, a GPU's
def test_forty_decode_steps_attend_as_the_float64_selection_and_attention(case, pure_path, monkeypatch):
    decode_against_reference(monkeypatch, pure_path, **CASES[case])


def test_the_views_are_kept_between_codings_and_rebuilt_after_one(monkeypatch):
    """A step between codings reads the codes' and the codebook's views it read before
    (the same arrays); a coding rebuilds the codes' (the buffer is written in place first)
    and keeps the codebook's."""
    built = []
    real = retrieval.RetrievalStore._step_views

    def record(self, gqa, parts):
        views = real(self, gqa, parts)
        built.append((self.codes.length, *views))
        return views

    monkeypatch.setattr(retrieval.RetrievalStore, "_step_views", record)
    decode_against_reference(monkeypatch, "qmm", **CASES["halves"])
    for (n0, codes0, table0), (n1, codes1, table1) in zip(built, built[1:]):
        assert table1 is table0
        assert (codes1 is codes0) == (n1 == n0)
