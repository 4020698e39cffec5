"""NSNQuant's steady decode read (issue 30: ``NSNStore._steady_read``: every coded token
rebuilt in the rotated frame, ``s1 (s2 y_hat + o H)``, from views of the code buffers kept
between flushes, the query rotated once with the softmax scale folded in, the output rotated
once, the tail read over its whole buffer with its empty rows masked by a constant bias)
against attention over the history dequantized the straightforward way, over 40 decode
steps that flush twice, on the CPU's path and a GPU's pure path.

Reference: the history decoded from the stored codes in float64 (numpy: indices and sign
bits read from the words, ``x_hat = s1 (s2 y_hat H + o)`` with H the orthonormal
Walsh-Hadamard matrix), the full-precision tail as stored, attention in float64.

Tolerance, from float32 rounding (u = 2^-24, ``gamma(n) = n u / (1 - n u)``), per query row
and output channel, against that exact reference (the codes and float16 metadata are exact
float32 values, so only the read's rounding remains):
- the rotated scaled query ``qh = scale q H`` is a Hadamard transform (at most D roundings a
  channel, counted generously), each channel off by ``gamma(D) A`` with
  ``A = scale ||q||_1 / sqrt(D)`` (which also bounds |qh_d|);
- a coded token's rotated row ``s1 (s2 y_hat_d + (o H)_d)``: the mean's rotation (D roundings,
  each of at most ``||o||_1 / sqrt(D)``) then three operations, off by ``gamma(D + 3) M_d``,
  ``M_d = s1 (s2 |y_hat_d| + |(o H)_d| + ||o||_1 / sqrt(D))``;
- its score, a D-term product, is then off by at most ``gamma(3 D + 4) A sum_d M_d``; a tail
  token's (``addmm``: product, scale, bias) by ``gamma(D + 2) scale sum_d |q_d k_d|``;
- scores off by at most delta move each softmax weight by a factor within ``exp(+-2 delta)``;
- the output: the weights' error carried exactly, ``(exp(2 delta) - 1) sum_t p_t |x_hat_td|``,
  plus the rounding of the coded rows' mix (T terms), its rotation (D roundings) and the
  tail's ``addmm``: ``gamma(T + 2 D + 10) W`` with ``W = sum_coded p_t sum_d M_d / sqrt(D) +
  sum_tail p_t |v_td|`` (the rotated rows' magnitudes carried through the orthonormal
  rotation, each row of which sums to at most sqrt(D) in absolute value over sqrt(D)).
"""

from __future__ import annotations

import copy
import math

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from float64_attention import gamma
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import NSNQuantOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.nsnquant import NSNQuantCache
from veloxquant_mlx.methods.nsnquant import nsn as nsn_module

PROMPT, STEPS, R, GQA = 200, 40, 16, 2


def nsnquant(**options):
    options = {"nsn_residual_length": R, **options}
    return NSNQuantCache(KVCacheConfig(method="nsnquant", options=NSNQuantOptions(**options)), None, 0)


def rows(shape, seed):
    """Rows with a few outlier and offset channels (what NSN's normalisations take out)."""
    d = shape[-1]
    x = mx.random.normal(shape, key=mx.random.key(seed))
    return x * mx.where(mx.arange(d) < 3, 8.0, 1.0) + mx.where((mx.arange(d) >= 3) & (mx.arange(d) < 5), 4.0, 0.0)


def hadamard64(d: int) -> np.ndarray:
    h = np.ones((1, 1))
    while h.shape[0] < d:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(d)


def _bytes(words: mx.array, width: int) -> np.ndarray:
    """uint32 words as little-endian fields of ``width`` bits (numpy, the stored order)."""
    w = np.ascontiguousarray(np.array(words, dtype=np.uint32))
    return w.view({8: np.uint8, 16: np.uint16}[width])


def decoded_history(head_dim: int, tokens) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A tensor's coded tokens from their codes in float64: x_hat (B, H, T, D); the read's
    magnitudes: per channel of the rotated rows, ``s1 (s2 |y_hat_d| + |(o H)_d| + ||o||_1 / sqrt(D))``
    (the last term: the rotated mean's rounding), and per token, those summed over the
    channels over sqrt(D) (what the output's rotation carries)."""
    codec, n, r = tokens.codec, tokens.count, tokens.chunk
    codebook = np.array(codec.codebook, dtype=np.float64)
    sub = head_dim // codebook.shape[1]
    idx = _bytes(tokens.idx.buffer[:, :, :n], codec.index_bits)[..., :sub].astype(np.int64)
    y = codebook[idx].reshape(*idx.shape[:3], head_dim)
    if codec.bits == 2:
        bits = np.unpackbits(_bytes(tokens.sign.buffer[:, :, :n], 8), axis=-1, bitorder="little")[..., :head_dim]
        y = np.where(bits == 1, -y, y)
    norms = np.array(tokens.norms.buffer[:, :, :n].astype(mx.float32), dtype=np.float64)
    s1, s2 = norms[..., :1], norms[..., 1:]
    means = np.array(tokens.mean.buffer[:, :, : n // r].astype(mx.float32), dtype=np.float64)
    o = np.repeat(means, r, axis=2)
    rot = hadamard64(head_dim)
    x_hat = s1 * (s2 * (y @ rot) + o)
    m_d = s1 * (s2 * np.abs(y) + np.abs(o @ rot) + np.abs(o).sum(-1, keepdims=True) / math.sqrt(head_dim))
    return x_hat, m_d, m_d.sum(-1) / math.sqrt(head_dim)


def reference_and_bound(cache, q, k_new, v_new, scale):
    """Attention of ``q`` over what the step attends (the store's history once it has taken
    the new token: a chunk it completes is coded first), in float64, and the most the
    float32 read may differ from it (the module's docstring)."""
    s = copy.deepcopy(cache.store)
    s.commit(k_new, v_new)
    b, hq, _, d = q.shape
    h = k_new.shape[1]
    k_hat, mk, _ = decoded_history(d, s.keys)
    v_hat, _, wv = decoded_history(d, s.values)
    empty = np.zeros((b, h, 0, d))
    tail_k = np.array(s.k_tail.view(), dtype=np.float64) if s.k_tail.length else empty
    tail_v = np.array(s.v_tail.view(), dtype=np.float64) if s.v_tail.length else empty
    keys, values = np.concatenate([k_hat, tail_k], axis=2), np.concatenate([v_hat, tail_v], axis=2)
    qg = np.array(q, dtype=np.float64).reshape(b, h, hq // h, d) * scale
    scores = qg @ keys.swapaxes(-1, -2)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    a = np.abs(qg).sum(-1, keepdims=True) / math.sqrt(d)  # (B, H, R, 1): bounds |q H|_d
    coded_delta = gamma(3 * d + 4) * a * mk.sum(-1)[:, :, None, :]
    tail_delta = gamma(d + 2) * (np.abs(qg) @ np.abs(tail_k).swapaxes(-1, -2))
    delta = np.concatenate([coded_delta, tail_delta], axis=-1).max(-1, keepdims=True)
    n, n_coded = keys.shape[2], k_hat.shape[2]
    moved = np.expm1(2 * delta) * (p @ np.abs(values))  # the weights' error, exactly carried
    rounded = gamma(n + 2 * d + 10) * (p[..., :n_coded] @ wv[..., None] + p[..., n_coded:] @ np.abs(tail_v))
    return (p @ values).reshape(b, hq, 1, d), (moved + rounded).reshape(b, hq, 1, d)


def call(cache, q, k, v, scale):
    cache.update_and_fetch(k, v)
    return cache.attend(q, k, v, scale=scale, mask="causal" if k.shape[2] > 1 else None)


def decode_against_reference(cache, monkeypatch, pure_path, d=64, batch=2, seed=3):
    """Prefill (chunked), then STEPS decode steps, each through the steady read (the joint
    path of ``decode_parts`` refused), against the float64 reference; returns the largest
    error as a fraction of its bound."""
    monkeypatch.setattr(kd, "CPU_DEFAULT_PATH", pure_path)
    if pure_path == "reference":  # a GPU's pure path
        monkeypatch.setattr(kd, "_pure_path", lambda: "reference")
    h, total = 2, PROMPT + STEPS
    keys, values = rows((batch, h, total, d), seed), rows((batch, h, total, d), seed + 2) * 0.5
    scale = d**-0.5
    for start, stop in ((0, 120), (120, PROMPT)):
        q = mx.random.normal((batch, h * GQA, stop - start, d), key=mx.random.key(seed + start))
        call(cache, q, keys[:, :, start:stop], values[:, :, start:stop], scale)

    def refuse(*args, **kwargs):
        raise AssertionError("a decode step went through decode_parts, not the steady read")

    monkeypatch.setattr(nsn_module.NSNStore, "attend_parts", refuse)
    worst, flushes = 0.0, 0
    for t in range(PROMPT, total):
        q = mx.random.normal((batch, h * GQA, 1, d), key=mx.random.key(100 + t))
        k, v = keys[:, :, t : t + 1], values[:, :, t : t + 1]
        ref, bound = reference_and_bound(cache, q, k, v, scale)
        flushes += cache.store.k_tail.length + 1 == R
        out = np.array(call(cache, q, k, v, scale), dtype=np.float64)
        err = np.abs(out - ref)
        assert (err <= bound).all(), (t, float((err - bound).max()), float(bound.max()))
        worst = max(worst, float((err / bound).max()))
    assert flushes == 3  # 208, 224 and 240: steps right after a flush read no tail
    return worst


@pytest.mark.parametrize("bits, sub_dim, d", [(2, 8, 64), (2, 16, 64), (2, 8, 128)])
@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's read, and a GPU's
def test_decode_read_matches_attention_over_the_dequantized_history(bits, sub_dim, d, pure_path, monkeypatch):
    cache = nsnquant(nsn_bits=bits, nsn_subvector_dim=sub_dim)
    worst = decode_against_reference(cache, monkeypatch, pure_path, d=d)
    assert worst > 0  # the read's own arithmetic, not the reference's


def test_the_read_keeps_its_views_between_flushes_and_a_copy_builds_its_own(monkeypatch):
    """The views are built once a flush (a step in between reuses them), answer only their
    store, and a deep copy reads as the original."""
    cache = nsnquant()
    decode_against_reference(cache, monkeypatch, "qmm", batch=1)
    built = []
    real = nsn_module._coded_views
    monkeypatch.setattr(nsn_module, "_coded_views", lambda *a: built.append(1) or real(*a))
    clone = copy.deepcopy(cache)
    assert clone.store._views.value is None
    k = rows((1, 2, 1, 64), 50)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(51))
    for _ in range(3):  # no flush: the original builds nothing, the copy once
        a, b = call(cache, q, k, k, 0.125), call(clone, q, k, k, 0.125)
        assert mx.array_equal(a, b).item()
    assert len(built) == 2  # keys and values, once, for the copy
    assert clone.store._views.owner() is clone.store and cache.store._views.owner() is cache.store


def test_a_flush_clears_the_views_before_writing_the_coded_buffers(monkeypatch):
    """The coded buffers are written in place at a flush: no view of them may be held then
    (MLX would copy every buffer a view holds)."""
    cache = nsnquant()
    decode_against_reference(cache, monkeypatch, "qmm", batch=1)
    seen = []
    real = nsn_module.NSNTokens.append
    monkeypatch.setattr(nsn_module.NSNTokens, "append",
                        lambda self, *a, **k: seen.append(cache.store._views.value) or real(self, *a, **k))
    k = rows((1, 2, R, 64), 60)
    for i in range(R):
        call(cache, mx.zeros((1, 4, 1, 64)), k[:, :, i : i + 1], k[:, :, i : i + 1], 0.125)
    assert seen == [None, None]  # keys, then values: one flush


def test_at_1_bit_the_keys_keep_their_lookup_table_read():
    """At 1 bit no per-token signs force a gather: ``decode_parts`` scores the keys through
    lookup tables, less device work than the steady read's rebuilt rows."""
    cache = nsnquant(nsn_bits=1, nsn_subvector_dim=8)
    assert not nsn_module._steady_reads(cache.store.keys.codec, (64, 64))
    assert nsn_module._steady_reads(nsnquant(nsn_bits=2, nsn_subvector_dim=8).store.keys.codec, (64, 64))
