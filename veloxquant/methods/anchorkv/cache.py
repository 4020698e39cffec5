"""AnchorKV (adapted; the cited paper was not found): anchors kept exactly, every other
prompt token as a multiple of one anchor plus, within a byte budget, a coded residual.
No token is dropped.

Once, on the whole prompt (at the first decode step), per layer and (batch row, KV head),
keys and values ``(S, d)``, proxy queries ``q_j`` = the last ``w = max(1, min(window, S))``
keys (the cache sees no queries), ``α_j = softmax(q_j Kᵀ / sqrt(d))`` over the tokens
each may see:

1. **anchors**: ``k = max(1, round(S anchor_frac))``; the last ``min(window, k)`` tokens,
   then ``round(rho m)`` of the rest (``m`` = what is left of k) by score
   ``mean_j α_jt``, then the remainder uniformly at random (seeded by ``anchorkv_seed``);
2. **assignment**, for keys and for values separately: ``a(t) = argmax_a |cos(x_t, x_a)|``,
   ``γ_t = <x_t, x_a> / ||x_a||²`` (stored in float16; the residual is taken against the
   stored γ), ``r_t = x_t - γ_t x_a``;
3. **utility** (first-order attention-output error), ``y_j = α_j V``:
   ``u^K_t = mean_j α_jt² (q_j . r^K_t / sqrt(d))² ||v_t - y_j||²``,
   ``u^V_t = mean_j α_jt² ||r^V_t||²``;
4. **budget**: ``θ`` times the prompt's K+V bytes in the model's dtype, per head, less what
   every token costs (the anchors, each other token's key anchor index, two float16 γ
   and residual slot index, one int32 run end per anchor) leaves ``N`` residuals of
   ``ceil(d bits / 32)`` words + a float16 scale + a position index; keys get
   ``floor(N / 2)``, values the rest, each to its tokens of highest utility (ranked per
   head, as the port does);
5. **residuals**: random-sign Hadamard rotation (seeded by ``anchorkv_seed``), scaled by
   the RMS (which matches the unit-Gaussian levels; the port's absmax would not), the
   ``2**anchorkv_residual_bits`` Lloyd-Max levels of a unit Gaussian
   (``methods/anchorkv/lloyd_max.py``).

Decode tokens are appended exactly and never re-anchored. Attention reads the anchor
form directly (``methods/anchorkv/anchors.py``: gathers and one cumulative sum, no reconstruction).
Stored bytes per head: ``k 2 d s + M (i_k + 4 + i_slot) + 4 k + N_k (4W + 2) + N_v (4W +
2 + i_M)`` (s the dtype's size, i_n the index bytes for n items); the card's formula
lacks the residuals' positions and the run ends.
"""

from __future__ import annotations

import math

import mlx.core as mx

from ...evict import attention  # SCORE_ELEMENTS read at call time: tests vary it
from ...evict.attention import attention_weights
from ...evict.select import gather_tokens, top_k_sorted
from .anchors import AnchorPart, AnchorStore, index_dtype
from ...quant.cache import QuantizedCache
from .lloyd_max import RotatedGaussian

EPS = 1e-12


def _pick(scores: mx.array, taken: mx.array, n: int) -> mx.array:
    """``taken`` with the ``n`` best-scoring positions not yet taken added."""
    if n <= 0:
        return taken
    idx = top_k_sorted(mx.where(taken, -mx.inf, scores), n)
    return mx.put_along_axis(taken, idx, mx.array(True), axis=-1)


def _assign(x: mx.array, anchors: mx.array, rows: mx.array | None = None, keep=None):
    """(anchor index, float16 γ, residual) of each row of ``x`` (B, H, M, d), or of the rows
    ``rows`` (B, H, M) of ``x``, on ``anchors``; with ``keep``, ``keep(start, stop, block,
    residual)`` of each block instead of its residuals (its rows along its last axis).

    Rows go in blocks of at most ``SCORE_ELEMENTS`` row-anchor products, each evaluated
    before the next is built (once a prompt, at its end): all M x k at once held 35 GB at
    a 128k prompt (8B shape), and blocks only chained (``mx.depends``) were computed
    together. Each row's figures do not depend on the blocking (but for the rounding of a
    BLAS call over fewer rows: a float16 γ may round the other way)."""
    b, h = x.shape[:2]
    m = x.shape[2] if rows is None else rows.shape[-1]
    norms = mx.sqrt((anchors * anchors).sum(-1))[:, :, None]
    per_block = max(1, attention.SCORE_ELEMENTS // max(1, b * h * anchors.shape[2]))
    parts = []
    for start in range(0, m, per_block):
        if parts:
            mx.eval(parts[-1])
        stop = min(m, start + per_block)
        block = x[:, :, start:stop] if rows is None else gather_tokens(x, rows[..., start:stop])
        ref, gamma, residual = _assign_block(block, anchors, norms)
        parts.append((ref, gamma, residual if keep is None else keep(start, stop, block, residual)))
    if len(parts) == 1:
        return parts[0]
    axes = (-1, -1, 2 if keep is None else -1)  # what ``keep`` gives runs along its last axis
    return tuple(mx.concatenate(column, axis=axis) for column, axis in zip(zip(*parts), axes))


def _residual_rows(x: mx.array, rows: mx.array, anchors: mx.array, ref: mx.array, gamma: mx.array):
    """The residuals ``_assign_block`` gives the rows ``rows`` of ``x``, from their anchor
    and γ: the chosen few are coded, the others' residuals are never held."""
    return gather_tokens(x, rows) - gamma.astype(mx.float32)[..., None] * gather_tokens(anchors, ref)


def _assign_block(x: mx.array, anchors: mx.array, norms: mx.array):
    dots = x @ anchors.swapaxes(-1, -2)  # (B, H, rows, k)
    cos = mx.abs(dots) / (mx.sqrt((x * x).sum(-1, keepdims=True)) * norms + EPS)
    ref = mx.argmax(cos, axis=-1)
    chosen = gather_tokens(anchors, ref)
    gamma = (mx.take_along_axis(dots, ref[..., None], axis=-1)[..., 0]
             / mx.maximum((chosen * chosen).sum(-1), EPS)).astype(mx.float16)
    return ref, gamma, x - gamma.astype(mx.float32)[..., None] * chosen


class AnchorKVCache(QuantizedCache):
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)
    group_field = ""

    @property
    def group(self) -> int:  # no group-affine codec: head_dim is checked by the residual codec
        return 1

    def make_store(self):
        o = self.config.options
        codec = RotatedGaussian(o.anchorkv_residual_bits, o.anchorkv_seed)
        return AnchorStore(lambda keys, values: compress(keys, values, o, codec)[0], codec)

    def update_and_fetch(self, keys, values):
        problem = self.store.codec.problem(keys.shape[-1])
        if problem:
            raise ValueError(f"method 'anchorkv' (anchorkv_residual_bits={self.store.codec.bits}): {problem}")
        return super().update_and_fetch(keys, values)



def compress(keys: mx.array, values: mx.array, o, codec: RotatedGaussian) -> tuple[AnchorPart, mx.array]:
    """The prompt (B, H, S, d) as an ``AnchorPart``, and the prompt position of each
    stored row (B, H, S) (for tests: the cache keeps no positions)."""
    b, h, s, d = keys.shape
    kf, vf = keys.astype(mx.float32), values.astype(mx.float32)
    n_anchor = min(s, max(1, round(s * o.anchorkv_anchor_frac)))
    n_window, w = min(o.anchorkv_window, n_anchor), max(1, min(o.anchorkv_window, s))
    positions = mx.arange(s)
    alpha = attention_weights(kf[:, :, s - w:], kf, d ** -0.5, positions[s - w:],
                              mx.broadcast_to(positions, (b, h, s)))[:, :, 0]  # (B, H, w, S)

    # 1. anchors: the window, then by score, then uniformly at random
    taken = mx.broadcast_to(positions >= s - n_window, (b, h, s))
    rest = n_anchor - n_window
    by_score = round(o.anchorkv_rho * rest)
    taken = _pick(alpha.mean(axis=2), taken, by_score)
    # one draw for every row: each sequence of a batch draws what it draws alone
    uniform = mx.broadcast_to(mx.random.uniform(shape=(1, h, s), key=mx.random.key(o.anchorkv_seed)), (b, h, s))
    taken = _pick(uniform, taken, rest - by_score)  # picks add exactly n untaken tokens: no count to read
    order = mx.argsort(mx.where(taken, -1, positions), axis=-1)  # anchors first, by position
    anchors, others = order[..., :n_anchor], order[..., n_anchor:]
    m = s - n_anchor
    if m == 0:  # every token an anchor: exact
        none = mx.zeros((b, h, 0), mx.uint8)
        words = math.ceil(d * codec.bits / 32)
        return AnchorPart(keys, values, none, none.astype(mx.float16), none.astype(mx.float16),
                          mx.zeros((b, h, s), mx.int32), none, mx.zeros((b, h, 0, words), mx.uint32),
                          none.astype(mx.float16), mx.zeros((b, h, 0, words), mx.uint32),
                          none.astype(mx.float16), none), anchors

    # 2. assignment, with 3. the utility of each residual, a block of the others at a time
    ka, va = gather_tokens(kf, anchors), gather_tokens(vf, anchors)
    a = mx.take_along_axis(alpha, others[:, :, None], axis=-1)  # (B, H, w, M)
    y = alpha @ vf
    yy = (y * y).sum(-1)[..., None]

    def value_terms(start, stop, vn, v_res):  # (B, H, 1 + w, rows): |r^V|², then spread
        spread = (vn * vn).sum(-1)[:, :, None] - 2 * (y @ vn.swapaxes(-1, -2)) + yy
        return mx.concatenate([(v_res * v_res).sum(-1)[:, :, None], spread], axis=2)

    v_ref, v_gamma, terms = _assign(vf, va, others, value_terms)
    mx.eval(v_ref, v_gamma, terms)  # the values' pass done before the keys' is built
    spread = terms[:, :, 1:]

    def key_utility(start, stop, kn, k_res):
        qr = (kf[:, :, s - w:] @ k_res.swapaxes(-1, -2)) * d ** -0.5
        a_b = a[..., start:stop]
        return (a_b * a_b * qr * qr * spread[..., start:stop]).mean(axis=2)

    k_ref, k_gamma, u_k = _assign(kf, ka, others, key_utility)
    u_v = (a * a).mean(axis=2) * terms[:, :, 0]

    # 4. budget, in bytes per head
    words, item = math.ceil(d * codec.bits / 32), keys.dtype.size
    slot_type, ref_type, pos_type = index_dtype(m + 1), index_dtype(n_anchor), index_dtype(max(m, 1))
    base = n_anchor * 2 * d * item + m * (ref_type.size + 4 + slot_type.size) + 4 * n_anchor
    per_residual = 4 * words + 2 + pos_type.size
    n = max(0, math.floor((o.anchorkv_theta * s * 2 * d * item - base) / per_residual))
    n_k, n_v = min(n // 2, m), min(n - n // 2, m)
    key_rows = top_k_sorted(u_k, n_k) if n_k else mx.zeros((b, h, 0), mx.int32)
    value_rows = top_k_sorted(u_v, n_v) if n_v else mx.zeros((b, h, 0), mx.int32)

    # stored order: the others sorted by value anchor (runs for the mix's cumulative sum)
    perm = mx.argsort(v_ref * max(m, 1) + mx.arange(m), axis=-1)
    inverse = mx.argsort(perm, axis=-1)
    slot = mx.zeros((b, h, m), mx.int32)
    if n_k:
        slot = mx.put_along_axis(slot, key_rows, mx.arange(1, n_k + 1, dtype=mx.int32), axis=-1)
    counts = (v_ref[..., None] == mx.arange(n_anchor)).sum(axis=2)
    def coded(x, anchors_x, ref, gamma, chosen):  # the chosen residuals, made again
        pick = lambda a: mx.take_along_axis(a, chosen, axis=-1)  # noqa: E731
        return codec.encode(_residual_rows(x, pick(others), anchors_x, pick(ref), pick(gamma)))

    k_codes, k_scales = coded(kf, ka, k_ref, k_gamma, key_rows)
    v_codes, v_scales = coded(vf, va, v_ref, v_gamma, value_rows)
    take = lambda x: mx.take_along_axis(x, perm, axis=-1)  # noqa: E731
    return AnchorPart(
        anchor_k=gather_tokens(keys, anchors), anchor_v=gather_tokens(values, anchors),
        key_ref=take(k_ref).astype(ref_type), key_coef=take(k_gamma), value_coef=take(v_gamma),
        value_ends=mx.cumsum(counts, axis=-1).astype(mx.int32), key_slot=take(slot).astype(slot_type),
        key_codes=k_codes, key_scales=k_scales, value_codes=v_codes, value_scales=v_scales,
        value_pos=mx.take_along_axis(inverse, value_rows, axis=-1).astype(pos_type),
    ), mx.concatenate([anchors, mx.take_along_axis(others, perm, axis=-1)], axis=-1)
