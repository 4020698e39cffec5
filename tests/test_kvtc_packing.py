"""kvtc keeps each token's codes packed at their widths: the bit budget, not a byte a code."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.quant.packed import FieldLayout


@pytest.mark.parametrize("widths", [(8, 6, 4, 4, 3, 3, 2, 1, 1), (16, 16, 3, 16, 1), (1,) * 33, (4,), (0, 3, 0, 8)])
def test_codes_packed_at_their_widths_unpack_exactly(widths):
    """Every code, straddling a word boundary or not, at its extremes and random values."""
    bits = np.array(widths)
    layout = FieldLayout.of(bits)
    assert layout.n_words == max(1, -(-int(bits.sum()) // 32))
    rng = np.random.default_rng(0)
    top = (1 << bits) - 1
    codes = np.concatenate([rng.integers(0, top + 1, size=(2, 50, bits.size)),
                            np.broadcast_to(top, (2, 1, bits.size)), np.zeros((2, 1, bits.size), np.int64)], axis=1)
    words = layout.pack(mx.array(codes.astype(np.uint32)))
    assert words.dtype == mx.uint32 and words.shape == (2, 52, layout.n_words)
    assert np.array_equal(np.asarray(layout.unpack(words)), codes)
