"""Cross-layer state (cache/cross_layer.py): layers reach their group through the model
context, events fire when a layer's, a group's and every layer's prompt is done, shared
arrays are counted and saved once (by the owner), and saved cross-layer caches come back
linked, through mlx-lm's plain loader and through ours."""

import copy

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import save_prompt_cache

from conformance import arrays_held, config
from test_conformance import drive
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, load_prompt_cache, make_prompt_cache
from veloxquant_mlx.cache.cross_layer import CrossLayer, CrossLayerError, consecutive_groups
from veloxquant_mlx.cache.context import ModelContext
from veloxquant_mlx.methods.full import FullCache

SETTINGS = {  # compressing settings of each cross-layer method, on 4-layer tiny models
    "xkv": {},
    "xquant": {"residual_window": 32},
    "minicache": {"minicache_start_frac": 0.0, "minicache_retention_threshold": 0.0},
}


class _Events(CrossLayer, FullCache):
    """Records the cross-layer events it hears in its context (pairs of layers)."""

    def layer_groups(self, compressed, n_layers):
        return consecutive_groups(compressed, 2)

    def _init_storage(self):
        self._init_cross_layer()
        super()._init_storage()

    def update_and_fetch(self, keys, values):
        self._note_update(keys.shape[2])
        return super().update_and_fetch(keys, values)

    def _log(self, what, end):
        self.context.shared.setdefault("log", []).append((self.layer, what, end))

    def on_prefill_done(self, end):
        self._log("layer", end)

    def on_group_prefill_done(self, members, end):
        self._log(("group", tuple(m.layer for m in members)), end)

    def on_model_prefill_done(self, end):
        self._log("model", end)


def _event_caches(n_layers=4):
    cfg = KVCacheConfig(method="full")
    context = ModelContext(cfg, n_layers, tuple(range(n_layers)))
    context.layers = [_Events(cfg, context, i) for i in range(n_layers)]
    return context.layers


def test_groups_are_consecutive_runs_of_the_compressed_layers():
    assert consecutive_groups((0, 1, 2, 3, 4), 2) == ((0, 1), (2, 3), (4,))
    assert consecutive_groups((0, 2, 3, 5, 6), 2, start=3) == ((3, 5), (6,))
    caches = _event_caches(5)
    assert [c.layer_group for c in caches] == [(0, 1), (0, 1), (2, 3), (2, 3), (4,)]
    assert caches[1].owner is caches[0] and caches[0].is_owner and not caches[1].is_owner
    alone = _Events(KVCacheConfig(method="full"), None, 3)  # no context: a group of one
    assert alone.layer_group == (3,) and alone.owner is alone


def test_events_fire_at_each_layers_first_single_token_then_for_the_group_and_the_model():
    caches = _event_caches()
    model = tiny_model("llama", num_hidden_layers=4)
    tokens = prompt(60)
    model(tokens[None, :40], cache=caches)
    model(tokens[None, 40:50], cache=caches)  # a second chunk of the same prompt
    assert caches[0].context.shared.get("log") is None  # nothing before a single token
    model(tokens[None, 50:51], cache=caches)
    log = caches[0].context.shared.pop("log")
    assert log == [(0, "layer", 50), (1, "layer", 50), (1, ("group", (0, 1)), 50),
                   (2, "layer", 50), (3, "layer", 50), (3, ("group", (2, 3)), 50), (3, "model", 50)]
    model(tokens[None, 51:52], cache=caches)  # decode steps: no event
    assert caches[0].context.shared.get("log") is None
    model(tokens[None, 52:58], cache=caches)  # a second prompt (a follow-up turn)
    model(tokens[None, 58:59], cache=caches)
    log = caches[0].context.shared.pop("log")
    assert [e for e in log if e[1] == "model"] == [(3, "model", 58)]
    assert [c.prompts_done for c in caches] == [2] * 4


def test_a_shared_latent_is_counted_once_by_its_owner_and_read_by_the_others():
    model = tiny_model("llama", num_hidden_layers=4)
    cache = make_prompt_cache(model, config("xkv", {}))
    drive(model, cache, prompt(208))
    latent = cache[0].shared.items
    assert latent and latent.get("latent_codes") is not None
    assert cache[1].latent_keys().kept is latent  # the same arrays, no copy
    assert not cache[1].shared.items and not cache[3].shared.items
    assert cache[2].shared.items and cache[3].latent_keys().kept is cache[2].shared.items
    shared_bytes = sum(a.nbytes for a in latent.values() if a is not None)
    own_bytes = sum(a.nbytes for a in (cache[0].keys, cache[0].values, cache[0].b))
    assert cache[0].nbytes == own_bytes + shared_bytes
    held = set()  # every array reachable from the whole prompt cache, each once
    assert sum(c.nbytes for c in cache) == sum(arrays_held(c, held) for c in cache)


@pytest.mark.parametrize("method", sorted(SETTINGS))
def test_save_load_restores_every_layer_linked_and_stores_shared_arrays_once(method, tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    tokens = prompt(220)
    cache = make_prompt_cache(model, config(method, SETTINGS[method]))
    drive(model, cache, tokens[:212], decode=4)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    saved = mx.load(path)
    owners = sorted({int(k.split(".")[0]) for k in saved if ".arrays.shared_" in k})
    expected = {"xkv": [0, 2], "xquant": [], "minicache": [1, 3]}[method]
    assert owners == expected  # shared arrays under their owner's layer only
    plain, ours = mlx_lm_load(path), load_prompt_cache(path, model)
    for loaded in (plain, ours):
        assert all(c.context is loaded[0].context for c in loaded)
        assert loaded[0].context.layers == list(loaded)
        assert all(l.nbytes <= c.nbytes for l, c in zip(loaded, cache))  # exactly sized
        assert [c.stored_length for c in loaded] == [c.stored_length for c in cache]
    tail = tokens[212:]
    want = mx.concatenate([model(t.reshape(1, 1), cache=cache)[:, -1] for t in tail])
    for loaded in (plain, ours):
        got = mx.concatenate([model(t.reshape(1, 1), cache=loaded)[:, -1] for t in tail])
        assert mx.allclose(got, want, atol=1e-5, rtol=1e-5), float(mx.abs(got - want).max())


def test_a_file_loaded_twice_gives_two_independent_caches(tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    cache = make_prompt_cache(model, config("minicache", SETTINGS["minicache"]))
    drive(model, cache, prompt(100), decode=2)
    path = str(tmp_path / "c.safetensors")
    save_prompt_cache(path, cache)
    a, b = mlx_lm_load(path), mlx_lm_load(path)
    assert a[0].context is not b[0].context
    assert a[0].owner is a[1] and b[0].owner is b[1]
    model(prompt(1, seed=9)[None], cache=a)  # steps of one leave the other as saved
    assert (a[1].offset, b[1].offset, b[1].n_merged) == (101, 100, 100)


def test_a_layer_restored_without_its_owner_refuses_naming_it(tmp_path):
    model = tiny_model("llama", num_hidden_layers=4)
    cache = make_prompt_cache(model, config("xquant", SETTINGS["xquant"]))
    drive(model, cache, prompt(100), decode=2)
    state = cache[1].state  # layer 1 alone, under a prompt cache id nobody else has
    link = state["meta"]["cross_layer"].replace('"id": "', '"id": "other-')
    state = {"arrays": state["arrays"], "meta": {**state["meta"], "cross_layer": link}}
    with pytest.raises(CrossLayerError, match="layer 0, which is not linked"):
        type(cache[1]).from_state(state)


def test_a_deep_copy_links_to_its_own_owner():
    model = tiny_model("llama", num_hidden_layers=4)
    tokens = prompt(120)
    cache = make_prompt_cache(model, config("xkv", {}))
    drive(model, cache, tokens[:110], decode=2)
    clone = copy.deepcopy(cache)
    assert clone[1].owner is clone[0] and clone[0].context.layers == clone
    assert clone[1].latent_keys().kept is clone[0].shared.items
    assert clone[1].latent_keys().kept is not cache[0].shared.items
    a = mx.concatenate([model(t.reshape(1, 1), cache=cache)[:, -1] for t in tokens[112:118]])
    b = mx.concatenate([model(t.reshape(1, 1), cache=clone)[:, -1] for t in tokens[112:118]])
    assert mx.array_equal(a, b)


@pytest.mark.parametrize("method", list(SETTINGS))
def test_a_batch_keeps_each_sequences_layers_linked_to_each_other(method):
    """mlx-lm merges (and extracts) a batch layer by layer: every sequence's copied layers
    share one copied context whose ``layers`` are those very copies, so a layer reaches its
    own sequence's neighbours in the batch, never a stale copy of them (before, each layer
    was copied apart from the context's copies: layer 1 read a frozen copy of layer 0); no
    copy stays behind in the module's table once the last layer has taken its own."""
    from veloxquant_mlx.cache import batch as batch_module

    model = tiny_model("llama", num_hidden_layers=4)
    caches = [make_prompt_cache(model, config(method, SETTINGS[method])) for _ in range(2)]
    for seed, cache in enumerate(caches):
        drive(model, cache, prompt(60 + 20 * seed, seed=seed), decode=2)
    batch = [caches[0][i].merge([c[i] for c in caches]) for i in range(4)]
    assert not batch_module._CONTEXT_COPIES["merge"]
    for b, original in enumerate(caches):
        mine = [layer.seqs[b] for layer in batch]
        ctx = mine[0].context
        assert ctx is not original[0].context and ctx is not batch[0].seqs[1 - b].context
        assert all(c.context is ctx for c in mine) and ctx.layers == mine
        assert all(c.owner is mine[c.layer_group[c.owner_position]] for c in mine)
        assert all(x is not y for x, y in zip(mine, original))
    extracted = [layer.extract(1) for layer in batch]
    assert not batch_module._CONTEXT_COPIES["extract"]
    ctx = extracted[0].context
    assert ctx.layers == extracted and ctx is not batch[0].seqs[1].context
    assert all(x is not y for x, y in zip(extracted, (layer.seqs[1] for layer in batch)))


def test_a_batch_copy_of_a_context_leaves_the_models_own_caches_out():
    """A layer the method does not compress (the model's own cache, which mlx-lm batches
    itself) is not copied with a sequence's context: the copy holds None there."""
    from mlx_lm.models.cache import KVCache

    from veloxquant_mlx.cache import batch as batch_module
    from veloxquant_mlx.methods.xkv import XKVCache

    cfg = config("xkv", {})
    ctx = ModelContext(cfg, 3, (1, 2))
    ctx.layers = [KVCache(), XKVCache(cfg, ctx, 1), XKVCache(cfg, ctx, 2)]
    copies = [batch_module.copy_single(c, "merge") for c in ctx.layers[1:]]
    assert copies[0].context.layers == [None] + copies and copies[1].owner is copies[0]
