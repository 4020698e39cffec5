"""Issue 31 (prefill): ``state`` of an entropy-coded cache (cachegen, kvtc) is its resident
form, read with no entropy coding; the coded form is made only when a file is written by
``veloxquant_mlx.save_prompt_cache``; both forms load, and so do files saved before the
resident form existed (no ``form`` in their meta: the coded form)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache as mlx_lm_load
from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

from conformance import config, edit_saved_layer
from tiny_models import prompt, tiny_model
from veloxquant_mlx import load_prompt_cache, make_prompt_cache, save_prompt_cache
from veloxquant_mlx.cache.base import CacheStateError, CompressedKVCache
from veloxquant_mlx.quant import entropy
from veloxquant_mlx.quant.coded_cache import EntropyCodedCache

# the methods at their defaults, and cachegen without its anchors and deltas
SETTINGS = {"cachegen": ("cachegen", {}), "cachegen-no-delta": ("cachegen", {"cachegen_use_delta": False}),
            "kvtc": ("kvtc", {})}
CHUNK, CHUNKS, STEPS = 100, 4, 40  # 40 decode steps: a cachegen group and a kvtc batch leave the window


def _prefilled(name):
    """A prompt prefilled in chunks as mlx-lm's generate does it: ``state`` evaluated after each."""
    method, settings = SETTINGS[name]
    model = tiny_model("llama", num_hidden_layers=2)
    cache = make_prompt_cache(model, config(method, settings))
    tokens = prompt(CHUNK * CHUNKS + STEPS)
    for i in range(CHUNKS):
        model(tokens[i * CHUNK : (i + 1) * CHUNK][None], cache=cache)
        mx.eval([c.state for c in cache])
    assert all(isinstance(c, EntropyCodedCache) and c.store.keys.count for c in cache)
    return model, cache, tokens


def _decoded(model, cache, tokens) -> list[mx.array]:
    """The logits of the next STEPS decode steps (the same tokens for every cache)."""
    n = CHUNK * CHUNKS
    out = [model(tokens[n + i : n + i + 1][None], cache=cache) for i in range(STEPS)]
    mx.eval(out)
    return out


def _same_decode(model, original, restored, tokens) -> None:
    """Decode steps over the restored cache equal the original's exactly (decode both)."""
    for a, b in zip(_decoded(model, restored, tokens), _decoded(model, original, tokens)):
        assert mx.array_equal(a, b)


def _layer_arrays(path, layer: int) -> dict[str, mx.array]:
    prefix = f"{layer}.arrays."
    return {k[len(prefix):]: v for k, v in mx.load(str(path)).items() if k.startswith(prefix)}


def _layer_form(path, layer: int):
    form = mx.load(str(path)).get(f"{layer}.meta.form")
    return None if form is None else "".join(chr(int(c)) for c in form.tolist())


@pytest.fixture
def no_coder(monkeypatch):
    """The rANS coder refuses to run."""
    def refuse(*args, **kwargs):
        raise AssertionError("entropy coding ran")

    monkeypatch.setattr(entropy, "pack", refuse)
    monkeypatch.setattr(entropy, "encode", refuse)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_reading_state_after_a_chunked_prompt_codes_nothing(name, no_coder):
    """Before: every read of ``state`` ran the coder over the codes not yet sealed (14.6 s of
    cachegen's 4k prefill on an H200 against 0.11 s uncompressed)."""
    model, cache, tokens = _prefilled(name)
    for c in cache:
        state = c.state
        assert state["meta"]["form"] == "resident"
        for prefix, run in (("k", c.store.keys), ("v", c.store.values)):
            assert mx.array_equal(state["arrays"][f"{prefix}_codes"], run.codes.view())  # resident codes
        assert not any("stream" in k or "segments" in k or "table" in k for k in state["arrays"])
    model(tokens[CHUNK * CHUNKS :][None][:, :1], cache=cache)  # a decode step reads no coded form either
    mx.eval([c.state for c in cache])


@pytest.mark.parametrize("name", list(SETTINGS))
def test_our_save_writes_the_coded_form_and_it_loads_to_the_same_decode(name, tmp_path):
    model, cache, tokens = _prefilled(name)
    path = tmp_path / "coded.safetensors"
    save_prompt_cache(str(path), cache, model)
    for i, c in enumerate(cache):
        arrays = _layer_arrays(path, i)
        assert _layer_form(path, i) == "coded"
        assert {"k_segments", "k_stream", "k_table", "v_segments", "v_stream"} <= arrays.keys()
        assert "k_codes" not in arrays and "v_codes" not in arrays
        assert c.stored_nbytes == sum(a.nbytes for a in arrays.values())
    assert cache[0].state["meta"]["form"] == "resident"  # only while the save reads it
    for loaded in (load_prompt_cache(str(path), model), mlx_lm_load(str(path))):
        for a, b in zip(cache, loaded):
            for x, y in ((a.store.keys, b.store.keys), (a.store.values, b.store.values)):
                assert mx.array_equal(x.codes.view(), y.codes.view())
    _same_decode(model, cache, loaded, tokens)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_the_resident_state_restores_to_the_same_decode(name, tmp_path):
    """``from_state(state)`` (mlx-lm's server copies, the probe's put-back) and mlx-lm's own
    save and load, which write the resident form."""
    model, cache, tokens = _prefilled(name)
    copied = [type(c).from_state(c.state) for c in cache]
    path = tmp_path / "resident.safetensors"
    mlx_lm_save(str(path), cache)
    for i, c in enumerate(cache):
        arrays = _layer_arrays(path, i)
        assert _layer_form(path, i) == "resident"
        assert "k_codes" in arrays and not any("stream" in k or "segments" in k for k in arrays)
    from_file = [mlx_lm_load(str(path)), load_prompt_cache(str(path), model)]
    for loaded in [copied, *from_file]:
        for a, b in zip(cache, loaded):
            assert b.state["meta"]["form"] == "resident"
            for x, y in ((a.store.keys, b.store.keys), (a.store.values, b.store.values)):
                assert mx.array_equal(x.codes.view(), y.codes.view())
            assert b.stored_nbytes == a.stored_nbytes  # the coded form made from it is the same
    _same_decode(model, cache, copied, tokens)


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_file_saved_before_the_resident_form_still_loads(name, tmp_path, monkeypatch):
    """The old ``state``: the coded arrays, no ``form`` in the meta."""
    model, cache, tokens = _prefilled(name)

    def old_state(self):
        return {"arrays": self.stored_arrays(), "meta": CompressedKVCache.state.fget(self)["meta"]}

    monkeypatch.setattr(EntropyCodedCache, "state", property(old_state, EntropyCodedCache.state.fset))
    path = tmp_path / "old.safetensors"
    mlx_lm_save(str(path), cache)
    monkeypatch.undo()
    assert _layer_form(path, 0) is None and "k_stream" in _layer_arrays(path, 0)
    for loaded in (mlx_lm_load(str(path)), load_prompt_cache(str(path), model)):
        for a, b in zip(cache, loaded):
            for x, y in ((a.store.keys, b.store.keys), (a.store.values, b.store.values)):
                assert mx.array_equal(x.codes.view(), y.codes.view())
    _same_decode(model, cache, loaded, tokens)


@pytest.mark.parametrize("name,edit,message", [
    ("cachegen", lambda a: a.update(k_scales=a["k_scales"][:, :, :-1]),
     r"k_codes cover 384 tokens, which k_scales \(11 rows\) does not"),
    ("cachegen", lambda a: a.update(v_codes=a["v_codes"][:, :1]),
     r"v_codes has shape \(1, 1, 384, \d+\), expected \(1, 2, tokens, ...\)"),
    ("cachegen-no-delta", lambda a: a.update(k_codes=a["k_codes"][:, :, :-32]),
     r"k_codes cover 352 tokens, which k_scales \(384 rows\) does not"),
    ("kvtc", lambda a: a.update(v_codes=a["v_codes"][:, :-1]),
     r"v_codes has shape \(1, 267, 16\), expected \(1, 268, 16\)"),
    ("kvtc", lambda a: a.pop("k_codes"), r"'k_codes' is missing"),
])
def test_an_edited_resident_file_is_refused_naming_the_field(name, edit, message, tmp_path):
    _, cache, _ = _prefilled(name)
    path = tmp_path / "resident.safetensors"
    mlx_lm_save(str(path), cache)
    arrays, metadata = mx.load(str(path), return_metadata=True)
    own = {k[len("1.arrays."):]: v for k, v in arrays.items() if k.startswith("1.arrays.")}
    edit(own)
    arrays = {k: v for k, v in arrays.items() if not k.startswith("1.arrays.")}
    arrays.update({f"1.arrays.{k}": v for k, v in own.items()})
    mx.save_safetensors(str(path), arrays, metadata)
    with pytest.raises(CacheStateError, match=rf"resident.safetensors: .*layer 1 .*{message}"):
        load_prompt_cache(str(path))


def test_an_unknown_form_is_refused_naming_it(tmp_path):
    _, cache, _ = _prefilled("cachegen")
    path = tmp_path / "resident.safetensors"
    mlx_lm_save(str(path), cache)
    edit_saved_layer(path, 0, lambda meta, arrays: meta.update(form="packed"))
    with pytest.raises(CacheStateError, match=r"layer 0 .*form is 'packed', expected one of \('resident', 'coded'\)"):
        load_prompt_cache(str(path))
