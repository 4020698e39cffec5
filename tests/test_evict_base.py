"""What the eviction base gives every method: per-head budgets (padding, masked, counted)
and a query window kept at decode steps."""

import mlx.core as mx

from test_conformance import _reference_check, drive
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.options import L2NormOptions
from veloxquant_mlx.evict.base import Schedule
from veloxquant_mlx.methods.knorm import L2NormCache

BUDGETS = (12, 40)  # per KV head of the tiny llama (2 KV heads)


class PerHeadKnorm(L2NormCache):
    """knorm with a different budget per KV head (what a head-adaptive split produces)."""

    schedule = Schedule(prefill_end=True, chunks=True, decode_every=1)

    def head_budgets(self, inputs):
        return mx.array(BUDGETS)


def _caches(model):
    config = KVCacheConfig(options=L2NormOptions(knorm_budget=40, knorm_n_sink=2, knorm_recent=4))
    return [PerHeadKnorm(c.config, c.context, c.layer) for c in make_prompt_cache(model, config)]


def test_heads_keep_their_own_budgets_with_padding_counted_and_masked():
    model = tiny_model("llama")
    cache = _reference_check("knorm", model, _caches(model), prompt(160), chunk=50)
    for c in cache:
        kept = c.kept_positions
        counts = (kept >= 0).sum(axis=-1)[0].tolist()
        assert counts == list(BUDGETS) and c.stored_length == max(BUDGETS)
        for h, n in enumerate(BUDGETS):  # distinct, sinks and the recent window kept
            row = kept[0, h, :n].tolist()
            assert row == sorted(set(row)) and {0, 1} <= set(row) and set(range(c.offset - 4, c.offset)) <= set(row)
        rows = c.store.rows
        assert rows == max(BUDGETS) + 1  # padding is stored, so it is counted
        per_row = 2 * 32 * 4 * 2 + 2 * 4 + 2 * 4  # K, V (2 heads x 32 fp32), position, norm
        assert c.nbytes >= rows * per_row


def test_per_head_budgets_survive_save_and_load(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = tiny_model("llama")
    cache = _caches(model)
    tokens = prompt(140)
    drive(model, cache, tokens[:120], decode=4)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert all(type(c) is PerHeadKnorm and c.padded for c in loaded)
    a = mx.concatenate([model(t.reshape(1, 1), cache=cache)[:, -1] for t in tokens[120:130]])
    b = mx.concatenate([model(t.reshape(1, 1), cache=loaded)[:, -1] for t in tokens[120:130]])
    assert mx.allclose(a, b, atol=1e-5)


def test_a_query_window_kept_at_decode_holds_the_last_queries():
    from veloxquant_mlx.evict.base import Roles

    class DecodeWindow(L2NormCache):
        roles = Roles(budget="knorm_budget", window="knorm_recent")
        window_in_decode = True

    cache = DecodeWindow(KVCacheConfig(options=L2NormOptions(knorm_budget=64, knorm_recent=6)))
    k = mx.random.normal((1, 2, 90, 16), key=mx.random.key(0))
    q = mx.random.normal((1, 4, 90, 16), key=mx.random.key(1))
    for start, stop in [(0, 60), *[(t, t + 1) for t in range(60, 90)]]:
        keys, values = cache.update_and_fetch(k[:, :, start:stop], k[:, :, start:stop])
        cache.attend(q[:, :, start:stop], keys, values, scale=0.25, mask="causal" if stop - start > 1 else None)
    assert mx.array_equal(cache.window_queries, q[:, :, 84:90])
