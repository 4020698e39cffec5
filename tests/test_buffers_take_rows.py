"""cache/buffers.take_rows: a (B, H, T, ...) buffer's rows by a (B, H, K) index through one
take of the flattened rows, the values take_along_axis gives (the eviction stores' compaction,
gather_tokens and a2ats's step read rows this way: benchmarks/results/h200_s57)."""

import veloxquant_mlx  # noqa: F401

import mlx.core as mx
import pytest

from veloxquant_mlx.cache.buffers import take_rows
from veloxquant_mlx.evict.select import gather_tokens, top_k_sorted


def _along(x, idx):
    idx = mx.broadcast_to(idx, (*mx.broadcast_shapes(idx.shape[:2], x.shape[:2]), idx.shape[-1]))
    return mx.take_along_axis(x, idx.reshape(*idx.shape, *(1,) * (x.ndim - 3)), axis=2)


@pytest.mark.parametrize("shape", [(3, 2, 17, 5), (3, 2, 17), (2, 4, 9, 3, 2)])
@pytest.mark.parametrize("index_batch", ["full", "one head", "one sequence"])
def test_take_rows_gives_take_along_axis_values_for_every_index_shape(shape, index_batch):
    x = mx.random.normal(shape, key=mx.random.key(0))
    b, h, t = shape[:3]
    ib, ih = {"full": (b, h), "one head": (b, 1), "one sequence": (1, h)}[index_batch]
    idx = mx.random.randint(0, t, (ib, ih, 6), key=mx.random.key(1)).astype(mx.int32)
    got = take_rows(x, idx)
    assert got.shape == (b, h, 6, *shape[3:])
    assert mx.array_equal(got, _along(x, idx))


def test_an_argpartition_index_takes_the_same_rows_alone_and_in_a_batch():
    scores = mx.random.normal((2, 3, 40), key=mx.random.key(2))
    slots = top_k_sorted(scores, 7)
    assert slots.dtype == mx.uint32  # what argpartition hands the eviction stores
    keys = mx.random.normal((2, 3, 40, 8), key=mx.random.key(3))
    for x in (keys, scores):
        batch = take_rows(x, slots)
        assert mx.array_equal(batch, _along(x, slots))
        alone = [take_rows(x[b:b + 1], slots[b:b + 1]) for b in range(2)]
        assert mx.array_equal(mx.concatenate(alone), batch)
    assert mx.array_equal(gather_tokens(keys, slots), _along(keys, slots))


def _primitives(out, tmp_path) -> str:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), out)
    return path.read_text()


def test_a_batch_takes_its_rows_by_one_index_a_row_and_one_sequence_along_the_axis(tmp_path):
    # what the H200 measured (benchmarks/results/h200_s57): in a batch the axis gather was
    # 3.1-7.6x slower, and wrong at 2^31 elements; alone, it saves the flat index's nodes
    keys = mx.zeros((4, 2, 16, 8))
    slots = mx.zeros((4, 2, 5), dtype=mx.int32)
    batch = _primitives(take_rows(keys, slots), tmp_path)
    assert "GatherAxis" not in batch and '"Gather"' in batch
    alone = _primitives(take_rows(keys[:1], slots[:1]), tmp_path)
    assert "GatherAxis" in alone
