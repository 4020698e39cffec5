"""RocketKV's decode step with its query-side work, page update and page slots compiled
(``_query_side``, ``_opened_page``/``_joined_page``, ``_page_slots``; the pages' starts
kept, ``_page_starts``) against the same step
written out operation by operation (the code before they were compiled, below): the
same operations on the same arrays, so every step's output and the pages are equal bit
for bit, over 40 decode steps that open pages and fill them, whole last pages and
partial ones (P = 1, 2, 3, 4)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import veloxquant_mlx  # noqa: F401 - before mlx's back-end is used
from feeding import run_prompt, synthetic_kvq
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import RocketKVOptions
from veloxquant_mlx.methods.rocketkv.cache import RocketKVCache

HKV, D, PROMPT, STEPS = 2, 16, 300, 40


def _approximate_logits(queries, pages, r):
    b, hq, _, d = queries.shape
    hkv = pages.shape[1]
    q = queries.reshape(b, hkv, hq // hkv, d).astype(mx.float32)
    magnitude = mx.abs(q)
    dims = mx.argpartition(-magnitude.sum(axis=2), kth=r - 1, axis=-1)[..., :r]
    q_r = mx.take_along_axis(q, dims[:, :, None], axis=-1)
    index = dims if pages.shape[2] == d else dims + d * (q_r.sum(axis=2) > 0)
    proxy = mx.take_along_axis(pages, index[..., None], axis=2).astype(mx.float32)
    t = mx.sqrt(d * mx.abs(q_r).sum(-1, keepdims=True) / mx.maximum(magnitude.sum(-1, keepdims=True), 1e-30))
    return q_r @ proxy, mx.maximum(t, 1e-30), dims[..., None]


class Straightforward(RocketKVCache):
    """The step as it was written before (no compiled function)."""

    def _extend_pages(self, rows, key):
        p = self.plan[0]
        column = key.swapaxes(-1, -2)
        if p > 1 and rows % p == 0:
            self.pages.append(mx.concatenate([column, column], axis=2))
        elif p > 1:
            d, buffer, last = column.shape[2], self.pages.buffer, self.pages.length - 1
            page = buffer[..., last : last + 1]
            buffer[..., last : last + 1] = mx.concatenate(
                [mx.minimum(page[:, :, :d], column), mx.maximum(page[:, :, d:], column)], axis=2)
        self.paged_rows = rows + 1

    def chosen_pages(self, queries, keys):
        p, r, k2 = self.plan
        rows = keys.shape[2]
        n_pages, n = -(-rows // p), -(-k2 // p)
        if n >= n_pages:
            return None
        pages = keys.swapaxes(-1, -2) if p == 1 else self.pages.view()
        counts = mx.minimum(rows - p * mx.arange(n_pages), p)
        x, t, _ = _approximate_logits(queries, pages, r)
        logits = x / t
        lse = mx.logsumexp(logits + mx.log(counts.astype(mx.float32)), axis=-1, keepdims=True)
        scores = mx.exp(logits - lse).sum(axis=2)
        return mx.argpartition(-scores, kth=n - 1, axis=-1)[..., :n]

    def gather_pages(self, pages, keys, values, n_heads):
        p, rows = self.plan[0], keys.shape[2]
        slots = (pages[..., None] * p + mx.arange(p)).reshape(*pages.shape[:2], -1)
        mask = None
        if rows % p:
            mask = mx.repeat((slots < rows)[:, :, None], n_heads // keys.shape[1], axis=1)
            slots = mx.minimum(slots, rows - 1)
        index = slots[..., None]
        return mx.take_along_axis(keys, index, axis=2), mx.take_along_axis(values, index, axis=2), mask


@pytest.mark.parametrize("page_size", [None, 1, 3, 4])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_compiled_step_is_the_straightforward_step_bit_for_bit(page_size, dtype):
    k, v, q = (x.astype(dtype) for x in synthetic_kvq(PROMPT + STEPS, HKV, 3, D, q_scale=1.5,
                                                       norm_range=(0.2, 3.0), seed=4))
    options = RocketKVOptions(rocketkv_compression_ratio=16.0, rocketkv_page_size=page_size)
    caches = [cls(KVCacheConfig(options=options)) for cls in (RocketKVCache, Straightforward)]
    for c in caches:
        run_prompt(c, k, v, q, PROMPT)
    p = caches[0].plan[0]
    assert page_size is None or p == page_size
    partial = 0
    for t in range(PROMPT, PROMPT + STEPS):
        outs = []
        for c in caches:
            keys, values = c.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
            outs.append(c.attend(q[:, :, t : t + 1], keys, values, scale=D**-0.5, mask=None))
        partial += keys.shape[2] % p != 0
        assert outs[0].dtype == outs[1].dtype and mx.array_equal(outs[0], outs[1]), t
        if p > 1:
            assert mx.array_equal(caches[0].pages.view(), caches[1].pages.view()), t
    assert caches[0].pages.length > 1 or p == 1
    assert partial or p == 1
