"""GrowingArray: room in steps, up to a limit, and appends after a truncation."""

import mlx.core as mx

from veloxquant_mlx.cache.buffers import GrowingArray


def rows(n, start=0):
    return mx.broadcast_to(mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None], (1, 2, n, 3))


def test_room_stops_at_the_limit():
    g = GrowingArray(step=256, limit=513)
    g.append(rows(256))
    g.append(rows(257, 256))
    assert g.capacity == 513 and mx.array_equal(g.view(), rows(513))  # not 768
    g.append(rows(400, 513))  # past the limit: steps again
    assert g.length == 913 and mx.array_equal(g.view(), rows(913))


def test_an_append_after_a_truncation_fits_within_the_limit():
    g = GrowingArray(step=256, limit=513)
    g.append(rows(256))
    g.truncate(10)  # a trimmed cache: capacity 256, 10 rows kept
    g.append(rows(300, 10))
    assert g.length == 310 and g.capacity <= 513 and mx.array_equal(g.view(), rows(310))


def test_restore_room_gives_back_a_saved_buffers_spare_rows_and_ignores_rooms_growth_never_leaves():
    g = GrowingArray(axis=2, step=8)
    g.append(mx.ones((1, 2, 5, 3)))
    saved_room, rows = g.capacity, g.view()
    restored = GrowingArray(axis=2, step=8)
    restored.reset(rows)
    restored.restore_room(saved_room)
    assert restored.capacity == saved_room == 8 and restored.length == 5
    assert mx.array_equal(restored.buffer, g.buffer)  # the spare rows are zeros, as grown
    for room in (None, 5, 4, 5 + 9):  # none saved, no spare, fewer rows, more than a step spare
        other = GrowingArray(axis=2, step=8)
        other.reset(rows)
        other.restore_room(room)
        assert other.capacity == 5


def test_an_emptied_buffer_saved_as_no_rows_gets_its_room_back_and_nothing_else_does():
    g = GrowingArray(axis=2, step=8)
    g.append(mx.ones((1, 2, 5, 3), dtype=mx.float16))
    g.truncate(0)  # emptied in place: its room kept
    saved_room, rows = g.capacity, g.view()
    assert rows.shape == (1, 2, 0, 3)
    restored = GrowingArray(axis=2, step=8)
    restored.reset(rows)
    assert restored.buffer is None and restored.length == 0
    restored.restore_room(saved_room)
    assert restored.buffer.shape == (1, 2, 8, 3) and restored.buffer.dtype == mx.float16
    assert restored.length == 0 and restored.nbytes == g.nbytes
    for room in (None, 0, 9):  # none saved, no room, more than a step
        other = GrowingArray(axis=2, step=8)
        other.reset(rows)
        other.restore_room(room)
        assert other.buffer is None
    never_emptied = GrowingArray(axis=2, step=8)
    never_emptied.reset(None)
    never_emptied.restore_room(8)
    assert never_emptied.buffer is None
