"""Synthetic mode: no model, attention error of every method on realistic K/V/Q.

The tensors carry the structure real models show and compression methods react to:

- RoPE: keys and queries are rotated at their positions (rotate-half convention);
- outlier key channels: a few low-frequency channels with a large constant offset;
- an attention sink: token 0's key is huge and points where queries lean, its value small;
- GQA: several query heads per KV head;
- retrieval: at decode time half the query heads copy the key of one far-back token.

Each method's cache is fed the way mlx-lm feeds it (2048-token chunks, the last prompt
token alone, then single tokens) and its attention output at every single-token step is
compared with exact attention over every token so far.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..cache.config import KVCacheConfig
from ..registry import METHODS
from .runner import PREFILL_CHUNK


@dataclass(frozen=True)
class SyntheticSpec:
    context: int = 4096
    decode: int = 16
    n_kv_heads: int = 2
    gqa: int = 4
    head_dim: int = 128
    outlier_channels: int = 4
    seed: int = 0


def make_tensors(spec: SyntheticSpec, dtype=mx.float16):
    """Post-RoPE queries (1, Hq, T, D), keys and values (1, Hkv, T, D), T = context + decode."""
    t, h, d = spec.context + spec.decode, spec.n_kv_heads, spec.head_dim
    hq = h * spec.gqa
    kq, kk, kv, ks, kn = mx.random.split(mx.random.key(spec.seed), 5)
    lean = mx.random.normal((d,), key=ks)
    lean = lean / mx.linalg.norm(lean)

    channel_scale = mx.exp(0.5 * mx.random.normal((d,), key=kk))
    keys = mx.random.normal((1, h, t, d), key=kk) * channel_scale
    # Low-frequency rotary channels (the last of each half) carry large constant offsets.
    half = d // 2
    outliers = [half - 1 - i for i in range(spec.outlier_channels // 2)]
    outliers += [d - 1 - i for i in range(spec.outlier_channels - len(outliers))]
    offset = mx.zeros((d,)).at[mx.array(outliers)].add(8.0)
    keys = keys + offset
    keys[:, :, 0] = 40.0 * lean  # the sink
    values = mx.random.normal((1, h, t, d), key=kv)
    values[:, :, 0] = 0.1 * values[:, :, 0]
    queries = 0.6 * mx.random.normal((1, hq, t, d), key=kq) + 1.5 * lean

    rope = lambda x: mx.fast.rope(x, d, traditional=False, base=10000.0, scale=1.0, offset=0)
    keys, queries = rope(keys), rope(queries)
    # Retrieval heads at decode time: query = the key of one token far back (post-RoPE).
    far = mx.random.randint(1, max(2, spec.context // 4), (spec.decode,), key=kn)
    retrieval = mx.repeat(keys[:, :, far], spec.gqa, axis=1) * 0.25  # (1, Hq, decode, D)
    heads = mx.arange(hq)[None, :, None, None] % 2 == 0
    decode_q = mx.where(heads, retrieval, queries[:, :, spec.context :])
    queries = mx.concatenate([queries[:, :, : spec.context], decode_q], axis=2)
    return queries.astype(dtype), keys.astype(dtype), values.astype(dtype)


def attention_error(config: KVCacheConfig, spec: SyntheticSpec, tensors=None) -> dict:
    """Relative error of the method's attention at each single-token step, and its bytes."""
    queries, keys, values = tensors if tensors is not None else make_tensors(spec)
    cache = METHODS[config.method].load_implementation()(config, None, 0)
    scale = spec.head_dim ** -0.5
    errors = []
    start, total = 0, spec.context + spec.decode
    while start < total:
        n = min(PREFILL_CHUNK, spec.context - 1 - start) if start < spec.context - 1 else 1
        end = start + n
        k, v = cache.update_and_fetch(keys[:, :, start:end], values[:, :, start:end])
        q = queries[:, :, start:end]
        out = cache.attend(q, k, v, scale=scale, mask="causal" if n > 1 else None)
        if n == 1:
            ref = mx.fast.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], scale=scale
            )
            diff = (out.astype(mx.float32) - ref.astype(mx.float32)).flatten()
            errors.append(float(mx.linalg.norm(diff) / mx.linalg.norm(ref.astype(mx.float32).flatten())))
        start = end
    return {
        "relative_error_mean": sum(errors) / len(errors),
        "relative_error_max": max(errors),
        "kv_bytes": cache.nbytes,
        "bytes_per_token": cache.nbytes / cache.offset,
        "tokens": cache.offset,
    }
