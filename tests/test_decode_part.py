"""``DecodePart.affine``: which parts the fused kernels may read. A part is theirs only when
every packed layout it holds is group-affine at a width they take (2, 4 or 8 bits); one
other layout (a codebook, 3-bit codes) sends the whole part to the pure read, which is what
keeps a kernel from reading a layout it cannot decode."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from veloxquant_mlx.kernels.decode import DecodePart
from veloxquant_mlx.quant.packed import AffineLayout


def layout(bits: int) -> AffineLayout:
    empty = mx.zeros((0,))
    return AffineLayout(empty, empty, empty, 0, bits, 32, "token")


class Codebook:  # a packed layout of another kind (``PackedScores``)
    count = 0


@pytest.mark.parametrize("keys, values, served", [
    (layout(4), layout(2), True),
    (layout(8), None, True),
    (None, layout(2), True),
    (None, None, False),
    (layout(4), layout(3), False),
    (layout(3), layout(4), False),
    (layout(4), Codebook(), False),
    (Codebook(), layout(4), False),
    (None, layout(3), False),
])
def test_a_part_is_the_kernels_only_when_every_layout_is_affine_at_their_widths(keys, values, served):
    assert DecodePart(keys, None, values, None).affine is served
