"""What a kernel's self-check allows where its arithmetic may round once more than MLX's."""

from __future__ import annotations

import mlx.core as mx


def within_a_rounding(got: mx.array, ref: mx.array) -> bool:
    """Equal up to one float32 rounding before the cast to ``got``'s dtype (CUDA may fuse a
    product and a sum into one multiply-add that MLX rounds twice): at most one unit in the
    last place of the output dtype, relative to the values. A host read: a self-check's."""
    ulp = {mx.float16: 2.0 ** -10, mx.bfloat16: 2.0 ** -7}.get(got.dtype, 2.0 ** -22)
    diff = mx.abs(got.astype(mx.float32) - ref.astype(mx.float32))
    return bool((diff <= ulp * mx.maximum(mx.abs(ref.astype(mx.float32)), 1e-30)).all().item())
