"""``quant/packed.py``'s short-axis reads: by selects on CUDA, exactly as the gather reads."""

import mlx.core as mx
import numpy as np
import pytest

from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.quant import packed
from veloxquant_mlx.quant.packed import FieldLayout, field_arrays, index_bits


@pytest.mark.parametrize("dtype", [mx.float32, mx.uint32])
@pytest.mark.parametrize("entries", [1, 2, 12, 32])
def test_selects_take_what_the_axis_gather_takes(dtype, entries):
    x = (mx.random.uniform(shape=(2, 3, 7, entries), key=mx.random.key(entries)) * 1e6).astype(dtype)
    index = mx.random.randint(0, entries, (2, 3, 7, 40), key=mx.random.key(1)).astype(mx.uint32)
    assert mx.array_equal(packed.selected_along_last(x, index), mx.take_along_axis(x, index, axis=-1))
    # a constant index's tree conditions built ahead, in numpy
    built = tuple(mx.array(c) for c in index_bits(np.array(index), entries))
    assert mx.array_equal(packed.selected_along_last(x, index, built), mx.take_along_axis(x, index, axis=-1))
    # a table shared by the rows of an axis the index has more of (spectral's codebooks)
    table = x[:, :, :1]
    wide = mx.take_along_axis(mx.broadcast_to(table, x.shape), index, axis=-1)
    assert mx.array_equal(packed.selected_along_last(table, index), wide)


def test_selects_are_taken_on_cuda_only_and_up_to_the_bound(monkeypatch):
    assert not packed.selects_here(4)  # this CPU
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    assert packed.selects_here(packed.SELECT_MOST_ENTRIES)
    assert not packed.selects_here(packed.SELECT_MOST_ENTRIES + 1)
    monkeypatch.setattr(kd, "gpu_backend", lambda: "metal")
    assert not packed.selects_here(4)


def test_packed_fields_read_on_cuda_give_the_cpus_codes(monkeypatch):
    """Rows of codes of mixed widths, some crossing words (``FieldLayout``, spectral's rows),
    read by selects where the reader built its indices' conditions give the gathers' codes."""
    rng = np.random.default_rng(0)
    bits = rng.integers(1, 9, size=90)
    layout = FieldLayout.of(bits)
    codes = mx.array((rng.integers(0, 1 << 30, size=(2, 50, bits.size)) % (1 << bits)).astype(np.uint32))
    words = layout.pack(codes)
    assert layout.n_words <= packed.SELECT_MOST_ENTRIES
    arrays, _ = field_arrays(bits)
    built = tuple(tuple(mx.array(c.reshape(1, 1, -1)) for c in index_bits(a, layout.n_words)) for a in arrays[:2])
    gathered = packed.unpack_fields(words, *layout.arrays())
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    assert mx.array_equal(packed.unpack_fields(words, *layout.arrays(), bits=built), gathered)
    assert mx.array_equal(gathered, codes)
