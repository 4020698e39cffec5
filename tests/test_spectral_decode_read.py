"""SpectralQuant's decode read (``EigenScores`` for a decode step's few query rows): each
span of a run one compiled pass (``_key_span_fn``, ``_value_span_fn``), the spans' views of
the buffers and the σ-scaled codebooks kept between writes (``EigenTokens.read_views``),
the codes and the QJL signs unpacked in one read. None of it reorders arithmetic, so over
45 decode steps (a prompt, then decode rows held and coded 32 at a time: a flush, several
read blocks) the scores and the mix equal, bit for bit, the read written out below the
straightforward way (the buffers sliced at every step, the codebooks scaled inside the
coordinates, the codes and the signs read apart, one operation at a time). On the CPU's
path and on a GPU's (``token_mix`` cutting the token axis, as on CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from feeding import feed
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import SpectralQuantOptions
from veloxquant_mlx.cache.rope import Rotary
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.spectral import eigen_store as es
from veloxquant_mlx.methods.spectral.bitfields import read_codes
from veloxquant_mlx.methods.spectral.cache import SpectralQuantCache
from veloxquant_mlx.quant.prerope import rotary_angles

D, H, PROMPT, STEPS = 64, 2, 100, 45


def _reference_coordinates(t, words, norms, qjl):
    """``_coordinates`` (norms apart) as it read before: codebooks scaled here, codes and signs read apart."""
    codec, d = t.codec, t.dim
    e = codec.widths(d)[0]
    b, h = words.shape[:2]
    book_head, book_tail = codec.tables(t.tables, d, (b, h))
    table = mx.concatenate([book_head * t.sigma[..., None, 0], book_tail * t.sigma[..., None, 1]], axis=-1)
    codes = read_codes(words, codec.layout(d), 0, d, (0,) * e + (book_head.shape[-1],) * (d - e))
    z = mx.take_along_axis(table, codes.reshape(b, h, -1), axis=-1).reshape(codes.shape)
    norm = norms[..., :1].astype(mx.float32)
    if qjl:
        signs = 2 * read_codes(words, codec.layout(d), d, d + e).astype(mx.float32) - 1
        rho = norms[..., 1:2].astype(mx.float32)
        rho = mx.where(norm > 0, rho / mx.maximum(norm, 1e-30), 0.0)
        z[..., :e] = z[..., :e] + (es.QJL_SCALE / e) * rho * (signs @ t.sketch)
    return z, norm.swapaxes(-1, -2)


def _spans(t):
    b, h, capacity, _ = t.words.buffer.shape
    block = es.read_block(b * h * t.dim * 4)
    return [(first, min(first + block, capacity)) for first in range(0, capacity, block)]


def reference_scores(t, q):
    qjl, spans = t.codec.qjl, _spans(t)
    reach = spans[-1][1]
    if t.rotary is None:
        q = q @ t.basis
    else:
        cos, sin = rotary_angles(t.rotary, t.dim, t.start, reach)
    out = []
    for first, end in spans:
        z, norm = _reference_coordinates(t, t.words.buffer[:, :, first:end], t.norms.buffer[:, :, first:end], qjl)
        if t.rotary is None:
            s = q @ z.swapaxes(-1, -2)
        else:
            s = es._turned_scores(q, t.basis @ z.swapaxes(-1, -2), es._part(cos, first, end, reach),
                                  es._part(sin, first, end, reach), t.rotary.traditional)
        out.append(s * norm)
    return mx.concatenate(out, axis=-1)[..., : t.count]


def reference_mix(t, p):
    p = mx.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, t.words.capacity - t.count)])
    spans, out = _spans(t), None
    for first, end in spans:
        z, norm = _reference_coordinates(t, t.words.buffer[:, :, first:end], t.norms.buffer[:, :, first:end], False)
        part = kd.token_mix(es._part(p, first, end, spans[-1][1]) * norm, z)
        out = part if out is None else out + part
    return out @ t.basis.swapaxes(-1, -2)


def spectral(context, qjl):
    options = SpectralQuantOptions(spectral_apply_qjl=qjl)
    return SpectralQuantCache(KVCacheConfig(method="spectral", kv_bits=2, options=options), context, 1)


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu-path", "gpu-path"])
@pytest.mark.parametrize("qjl", [True, False], ids=["qjl", "no-qjl"])
@pytest.mark.parametrize("rotary", [None, Rotary(10000.0, False), Rotary(10000.0, True)],
                         ids=["post-rope", "pre-rope", "pre-rope-traditional"])
def test_decode_steps_read_as_the_straightforward_read_bit_for_bit(rotary, qjl, gpu, monkeypatch):
    monkeypatch.setattr(es, "READ_BLOCK_BYTES", H * D * 4 * 64)  # blocks of 64 tokens: several spans
    monkeypatch.setattr(es, "GROWTH_TOKENS", 64)
    if gpu:  # token_mix cuts the token axis as on CUDA (the compiled span passes are keyed by it)
        monkeypatch.setattr(kd, "SPLIT_TOKENS", 16)
        monkeypatch.setattr(kd, "_splits_tokens", lambda: True)
        monkeypatch.setattr(es, "_splits_tokens", lambda: True)
    context = None
    if rotary is not None:
        context = SimpleNamespace(model_args=SimpleNamespace(rope_theta=rotary.base, rope_traditional=rotary.traditional))
    cache = spectral(context, qjl)
    k = mx.random.normal((1, H, PROMPT + STEPS, D), key=mx.random.key(1)) * mx.linspace(3, 0.2, D)
    v = mx.random.normal((1, H, PROMPT + STEPS, D), key=mx.random.key(2))
    q = mx.random.normal((1, 2 * H, PROMPT + STEPS, D), key=mx.random.key(3))
    feed(cache, k, v, q, 0, PROMPT)
    flushes = 0
    for t in range(PROMPT, PROMPT + STEPS):
        held = cache.store.k_pend.length
        mx.eval(feed(cache, k, v, q, t, t + 1))
        flushes += cache.store.k_pend.length < held
        keys, values = cache.store.keys, cache.store.values
        assert (keys.rotary is None) == (rotary is None)
        rows = mx.random.normal((1, H, 2, D), key=mx.random.key(100 + t)) * 0.125
        got = keys.reader().scores(rows)
        assert len(_spans(keys)) >= 2 and mx.array_equal(got, reference_scores(keys, rows)).item(), t
        p = mx.softmax(got, axis=-1)
        assert mx.array_equal(values.reader().mix(p), reference_mix(values, p)).item(), t
    assert flushes >= 1
