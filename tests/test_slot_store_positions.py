"""An eviction store's positions: a token appended after the last slot takes the position
the room past the last slot already holds, so a steady decode step writes no position, and
every slot still holds its token's position after growths, evictions, free-slot writes,
truncation and a restore."""

import mlx.core as mx
import pytest

from decode_steps import graph_nodes
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import SnapKVOptions
from veloxquant_mlx.evict.store import SlotStore

B, H, D = 2, 3, 4


def _rows(n, start):
    x = mx.broadcast_to(mx.arange(start, start + n, dtype=mx.float32)[None, None, :, None], (B, H, n, D))
    return {"keys": x, "values": -x}


class Tokens:
    """A SlotStore and the position each of its slots should hold."""

    def __init__(self):
        self.store, self.offset, self.expected = SlotStore(("keys", "values", "positions"), step=8), 0, []

    def write(self, n):
        free = self.store.free
        self.store.write(_rows(n, self.offset), first_position=self.offset)
        new = list(range(self.offset, self.offset + n))
        if free is not None:  # every sequence and head freed the same slot here
            self.expected[free[0, 0].item()] = new.pop(0)
        self.expected += new
        self.offset += n
        self.check()

    def check(self):
        positions = self.store.view("positions")
        assert positions.shape == (B, H, len(self.expected))
        assert (positions == mx.array(self.expected, mx.int32)).all().item(), (positions[0, 0].tolist(), self.expected)
        keys = self.store.view("keys")[..., 0]  # each token's key holds its own position
        assert (keys == positions.astype(mx.float32)).all().item()


def test_every_slot_holds_its_tokens_position_through_growths_evictions_and_restores():
    t = Tokens()
    t.write(5)  # a prompt chunk
    for _ in range(20):  # decode steps, through growths
        t.write(1)
    t.store.keep(mx.broadcast_to(mx.array([0, 3, 7, 20, 24], mx.int32), (B, H, 5)), spare=3)
    t.expected = [t.expected[i] for i in (0, 3, 7, 20, 24)]
    t.check()
    for _ in range(6):  # the spare rows (gathered from slot 0), then a growth
        t.write(1)
    t.store.evict_one(mx.full((B, H), 2, mx.int32))
    t.write(1)  # the free slot
    t.write(1)
    t.store.evict_one(mx.full((B, H), 1, mx.int32))
    t.write(3)  # the free slot, then two appended
    t.write(1)
    t.store.truncate(len(t.expected) - 2)
    t.offset -= 2
    t.expected = t.expected[:-2]
    t.check()
    t.write(2)
    t.write(1)
    arrays = {name: t.store.view(name) for name in t.store.names}
    t.store.restore(arrays, None)
    t.write(1)
    t.write(4)
    t.write(1)


def test_a_steady_append_writes_no_position():
    t = Tokens()
    t.write(5)  # 6 slots of room
    t.write(1)
    t.write(1)  # a growth: 10 slots, the 3 past the last one given the next positions
    positions = t.store.arrays["positions"]
    assert (positions.length, positions.capacity) == (7, 10)
    for _ in range(3):
        mx.eval(t.store.buffers())
        t.store.write(_rows(1, t.offset), first_position=t.offset)
        assert graph_nodes([t.store.arrays["positions"].buffer]) == 0  # nothing written
        assert graph_nodes([t.store.arrays["keys"].buffer]) > 0
        t.expected.append(t.offset)
        t.offset += 1
        t.check()


@pytest.mark.parametrize("chunk", [16, 64])
def test_an_eviction_cache_keeps_the_positions_of_the_tokens_it_kept_while_decoding(chunk):
    model = tiny_model("llama")
    config = KVCacheConfig(options=SnapKVOptions(snap_budget=48))
    cache = make_prompt_cache(model, config)
    tokens = prompt(120)
    for start in range(0, 100, chunk):
        model(tokens[None, start : min(start + chunk, 100)], cache=cache)
    model(tokens[None, 100:101], cache=cache)  # the prompt's end: scored and evicted
    kept = [c.kept_positions for c in cache]
    for i in range(101, 120):
        model(tokens[None, i : i + 1], cache=cache)
        mx.eval([c.store.buffers() for c in cache])
    for c, before in zip(cache, kept):
        decoded = mx.broadcast_to(mx.arange(101, 120, dtype=mx.int32), (*before.shape[:2], 19))
        assert mx.array_equal(c.kept_positions, mx.concatenate([before, decoded], axis=-1))
        positions = c.store.view("positions")
        assert mx.array_equal(mx.sort(positions, axis=-1), c.kept_positions)


def test_a_packed_batch_of_sequences_at_different_positions_writes_no_position_at_a_steady_step():
    from veloxquant_mlx.evict.batch import EvictionPacked

    model = tiny_model("llama")
    config = KVCacheConfig(options=SnapKVOptions(snap_budget=48))
    singles = []
    for n in (90, 70):  # the same kept rows (the budget), different positions
        cache = make_prompt_cache(model, config)
        model(prompt(n)[None, :-1], cache=cache)
        model(prompt(n)[None, -1:], cache=cache)
        singles.append(cache[0])
    packed = EvictionPacked.pack(singles)
    k = v = mx.zeros((2, 2, 1, 32))
    written = []
    for step in range(6):
        mx.eval(packed.store.buffers())
        packed.update_and_fetch(k, v)
        written.append(graph_nodes([packed.store.arrays["positions"].buffer]))
        positions = packed.store.view("positions")[:, :, -step - 1 :]
        expected = mx.array([[list(range(n, n + step + 1))] * 2 for n in (90, 70)], mx.int32)
        assert mx.array_equal(positions, expected)
    assert written[0] > 0 and written[2:] == [0] * 4  # the first step (or a growth) writes ahead
