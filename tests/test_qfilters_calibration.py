"""qfilters with a calibration file (issue 31): the paper's offline filters instead of a
calibration on the prompt's queries. A cache reading the file installs each layer's filter
before its first token (no query buffered, no filter fitted, no retention check); the
file's filter is the card's SVD of every text query past the sinks, computed as the
prompt calibration computes it, so a file calibrated on a prompt's own queries gives the
prompt calibration's filter bit for bit where that calibration also takes every query;
the rows of a cache's batch, and sequences packed by mlx-lm's BatchGenerator, are each
evicted as alone; a saved cache continues
as it would have; a file for another method, ``qfilters_n_sink``, model or key shape is
refused, naming the file, the field and both values; `veloxquant calibrate --method
qfilters` writes a file that generation uses."""

from dataclasses import replace

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

from feeding import feed, prompt_then_steps
from test_calibrate import write_file, reference, text_file  # noqa: F401 - module fixtures reused
from test_methods_exactness import run
from tiny_models import tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cache.calibration import (
    CalibrationError,
    calibration_header,
    read_calibration,
    write_calibration,
)
from veloxquant_mlx.cache.options import QFiltersOptions
from veloxquant_mlx.evict.base import EVICT_EVERY
from veloxquant_mlx.methods import qfilters as qf
from veloxquant_mlx.methods.qfilters import LowRetentionError, QFiltersCache
from veloxquant_mlx.reference import REFERENCE_MODEL

TOKENS = 400
BUDGET = 64
PROMPT = (REFERENCE_MODEL / "heldout_kjv_acts.txt").read_text()[:300]  # not the calibration text
HKV, HQ, D = 2, 8, 128  # the reference model's


def config(path=None, **options):
    options = {"qfilters_budget": BUDGET, "qfilters_on_low_retention": "ignore", **options}  # quiet prompt fits
    return KVCacheConfig(method="qfilters", options=QFiltersOptions(**options), calibration_file=path)


def calibrate(folder, name, *args):
    return write_file(folder, name, "--method", "qfilters", *args)[0]


@pytest.fixture(scope="module")
def made(tmp_path_factory, text_file):  # noqa: F811
    return calibrate(tmp_path_factory.mktemp("qfilters"), "qfilters-ref", "--text", str(text_file),
                     "--tokens", str(TOKENS))


def file_filter(path, layer):
    arrays, _ = read_calibration(path)
    return arrays[f"layer{layer}.filter"]


def synthetic(n, batch=1, seed=0):
    """Keys, values (batch, 2, n, 128) and queries (batch, 8, n, 128) sharing a direction."""
    keys = [mx.random.key(seed + i) for i in range(3)]
    k = mx.random.normal((batch, HKV, n, D), key=keys[0])
    v = mx.random.normal((batch, HKV, n, D), key=keys[1])
    q = mx.random.normal((batch, HQ, n, D), key=keys[2]) + 1.5
    return k, v, q


def synthetic_header():
    """What a file of ``synthetic``'s filters says it was made for."""
    return {**calibration_header(QFiltersCache, config(), None, "synthetic"), "num_key_value_heads": HKV, "head_dim": D}


def no_fit(*args, **kwargs):
    raise AssertionError("a Q-filter was fitted (or a retention check run) by a calibrated cache")


def test_the_files_filter_is_in_place_before_the_first_token_and_nothing_is_fitted(made, reference, monkeypatch):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(PROMPT))
    for name in ("query_filters", "top_right_vectors", "retention"):
        monkeypatch.setattr(qf, name, no_fit)
    cache = make_prompt_cache(model, config(made))
    model(tokens[None, :64], cache=cache)
    for i, c in enumerate(cache):  # the first chunk's tokens are projected on the file's filter
        assert mx.array_equal(c.filter, file_filter(made, i)) and c.calib is None
        assert c.packs_now()
        keys = c.store.view("keys").astype(mx.float32)
        assert mx.array_equal(c.store.view("proj"), (keys * c.filter[:, :, None]).sum(axis=-1))
    run(model, cache, tokens[64:], chunk=64, decode=EVICT_EVERY + 8)  # the prompt's end and a decode eviction
    for i, c in enumerate(cache):
        assert mx.array_equal(c.filter, file_filter(made, i)) and c.calib is None
        assert c.offset == tokens.size + EVICT_EVERY + 8
        assert c.stored_length == BUDGET + 8  # evicted at the prompt's end and after EVICT_EVERY steps
        kept = c.store.view("keys").astype(mx.float32)
        assert mx.allclose(c.store.view("proj"), (kept * c.filter[:, :, None]).sum(axis=-1), atol=1e-5)


def test_the_file_holds_the_cards_filter_of_every_query_past_the_sinks():
    """Per query head the oriented top right singular vector of its uncentred queries past
    the first qfilters_n_sink (numpy's SVD here), their unnormalised mean per KV head."""
    n, sink = 300, 6
    k, v, q = synthetic(n, seed=3)
    f = QFiltersCache.calibrate(k, v, config(qfilters_n_sink=sink), iters=1, seed=0, queries=q)["filter"]
    assert f.shape == (1, HKV, D) and f.dtype == mx.float32
    x = np.array(q[0, :, sink:], np.float64)
    per_head = []
    for h in range(HQ):
        u, _, vt = np.linalg.svd(x[h], full_matrices=False)
        per_head.append(vt[0] if (u[:, 0] > 0).mean() > 0.5 else -vt[0])
    expected = np.array(per_head).reshape(HKV, HQ // HKV, D).mean(axis=1)
    assert np.allclose(np.array(f[0]), expected, atol=2e-4)
    with pytest.raises(ValueError, match="6 calibration tokens leave no query past qfilters_n_sink=6"):
        QFiltersCache.calibrate(k[:, :, :6], v[:, :, :6], config(qfilters_n_sink=sink), iters=1, seed=0,
                                queries=q[:, :, :6])


@pytest.mark.parametrize("n,chunk,calib", [(120, 37, 128), (120, 200, 116), (300, 64, 512)])
def test_a_file_of_the_prompts_own_queries_is_the_prompt_calibration_bit_for_bit(n, chunk, calib, tmp_path):
    """Where the prompt calibration takes every query past the sinks (at most
    qfilters_calib_tokens of them), the file on those queries holds its filter exactly,
    and the calibrated cache keeps and attends exactly as the calibrated prompt does."""
    k, v, q = synthetic(n + 2 * EVICT_EVERY, seed=1)
    arrays = QFiltersCache.calibrate(k[:, :, :n], v[:, :, :n], config(), iters=1, seed=0, queries=q[:, :, :n])
    path = str(tmp_path / "prompt.safetensors")
    write_calibration(path, {0: arrays}, synthetic_header())
    fitted, read = QFiltersCache(config(qfilters_calib_tokens=calib)), QFiltersCache(config(path))
    a = prompt_then_steps(fitted, k, v, q, n, chunk, keep_outputs=True)
    b = prompt_then_steps(read, k, v, q, n, chunk, keep_outputs=True)
    assert mx.array_equal(fitted.filter, read.filter)
    assert all(mx.array_equal(x, y) for x, y in zip(a, b))
    assert mx.array_equal(fitted.kept_positions, read.kept_positions)
    assert mx.array_equal(fitted.store.view("proj"), read.store.view("proj"))


def test_a_longer_prompt_is_calibrated_on_a_subset_the_file_on_every_query(tmp_path):
    k, v, q = synthetic(300, seed=1)
    arrays = QFiltersCache.calibrate(k, v, config(), iters=1, seed=0, queries=q)
    fitted = QFiltersCache(config(qfilters_calib_tokens=32))
    prompt_then_steps(fitted, k, v, q, 300, 64)
    assert not mx.array_equal(fitted.filter, arrays["filter"])


def one_chunk_then_greedy(model, cache, tokens, steps):
    """The prompt as one chunk (as ``collect_queries`` runs a text of at most 512 tokens),
    then ``steps`` greedy tokens: the logits (1, 1 + steps, V)."""
    outs = [model(tokens[None], cache=cache)[:, -1:]]
    for _ in range(steps):
        outs.append(model(mx.argmax(outs[-1][:, -1], axis=-1)[:, None], cache=cache)[:, -1:])
    return mx.concatenate(outs, axis=1)


def test_a_cli_file_of_the_prompt_reproduces_the_prompts_calibration_in_the_model(reference, tmp_path):
    """The prompt calibration at the first step takes qfilters_calib_tokens = the prompt's
    queries past the sinks (an even subset of the n - 3 held: the first n - 4), which
    ``veloxquant calibrate`` on the prompt computes alike: the filters are equal bit for
    bit, and so are the kept tokens and every logit, past a decode eviction."""
    model, tokenizer = reference
    text = tmp_path / "prompt.txt"
    text.write_text(PROMPT[:140])
    tokens = mx.array(tokenizer.encode(PROMPT[:140]))
    n = tokens.size
    path = calibrate(tmp_path, "prompt", "--text", str(text), "--tokens", str(n))
    fitted, read = make_prompt_cache(model, config(qfilters_calib_tokens=n - 4)), make_prompt_cache(model, config(path))
    a = one_chunk_then_greedy(model, fitted, tokens, EVICT_EVERY + 5)  # the first step ends the prefill
    b = one_chunk_then_greedy(model, read, tokens, EVICT_EVERY + 5)
    for f, r in zip(fitted, read):
        assert mx.array_equal(f.filter, r.filter)
        assert mx.array_equal(f.kept_positions, r.kept_positions)
        assert f.stored_length == r.stored_length == BUDGET + 4
    assert mx.array_equal(a, b)


def test_rows_of_a_batch_are_evicted_as_each_alone(made):
    """The file's filter broadcast over the rows: each row's outputs, kept tokens and
    projections are its own, bit for bit."""
    n = 150
    k, v, q = synthetic(n + EVICT_EVERY + 4, batch=2, seed=5)
    batch = QFiltersCache(config(made), None, 1)
    outs = prompt_then_steps(batch, k, v, q, n, 48, keep_outputs=True)
    assert batch.filter.shape == (2, HKV, D)
    for row in range(2):
        alone = QFiltersCache(config(made), None, 1)
        kb, vb, qb = k[row : row + 1], v[row : row + 1], q[row : row + 1]
        single = prompt_then_steps(alone, kb, vb, qb, n, 48, keep_outputs=True)
        assert all(mx.array_equal(x[row : row + 1], y) for x, y in zip(outs, single))
        assert mx.array_equal(batch.kept_positions[row : row + 1], alone.kept_positions)
        assert mx.array_equal(batch.store.view("proj")[row : row + 1], alone.store.view("proj"))
        assert mx.array_equal(batch.filter[row : row + 1], alone.filter)


def test_a_packed_batch_with_a_file_decodes_as_each_sequence_alone(tmp_path, monkeypatch):
    """mlx-lm's BatchGenerator over sequences whose caches read one file (packed once past
    their prompts: the file's filters joined), evicting every 4 steps: as alone."""
    import batching

    kv = mx.zeros((1, 2, 200, 32))  # the RowwiseModel's 2 KV heads of 32 (4 query heads)
    arrays = {i: QFiltersCache.calibrate(kv, kv, config(), iters=1, seed=0, queries=mx.random.normal(
        (1, 4, 200, 32), key=mx.random.key(20 + i)) + 1.0) for i in range(2)}
    path = str(tmp_path / "rowwise.safetensors")
    settings = {"qfilters_budget": 48, "calibration_file": path}
    write_calibration(path, arrays, calibration_header(QFiltersCache, config(), batching._RowwiseArgs(), "rowwise"))
    monkeypatch.setattr(QFiltersCache, "schedule", replace(QFiltersCache.schedule, decode_every=4))
    model, make = batching.rowwise_setup("qfilters", settings)
    prompts = [list(range(s, s + n)) for s, n in ((7, 90), (3, 90), (11, 30), (5, 75))]
    max_tokens = (14, 9, 16, 11)
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, max_tokens)]
    modes = set()
    got = batching.run_batched(model, prompts, max_tokens, join_at=3,
                               check=lambda gen: modes.update(c.mode for c in batching.batch_caches(gen)))
    assert "packed" in modes
    batching.assert_batch_equals_alone(got, alone)
    read = read_calibration(path)[0]
    for _, _, cache in got:
        for i, c in enumerate(cache):
            assert mx.array_equal(c.filter, read[f"layer{i}.filter"])


@pytest.mark.parametrize("prompt", [200, 40])  # evicted before the save, or first after it
def test_a_saved_calibrated_cache_continues_token_for_token(prompt, made, reference, tmp_path):
    model, tokenizer = reference
    tokens = mx.array(tokenizer.encode(PROMPT))
    head, tail = tokens[:prompt], tokens[prompt : prompt + EVICT_EVERY + 8]  # a decode eviction after the load
    cache = make_prompt_cache(model, config(made))
    run(model, cache, head, chunk=64, decode=0)
    path = str(tmp_path / "saved.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for c, l in zip(cache, loaded):
        assert mx.array_equal(c.filter, l.filter) and l.calib is None
    for t in tail:
        a = model(t.reshape(1, 1), cache=cache)[:, -1]
        b = model(t.reshape(1, 1), cache=loaded)[:, -1]
        assert mx.array_equal(a, b)
    assert all(mx.array_equal(c.kept_positions, l.kept_positions) for c, l in zip(cache, loaded))


def test_a_cache_under_its_budget_trims_whatever_its_length(made):
    """No calibration queries are held with a file, so trimming stays exact past twice
    qfilters_calib_tokens (where a prompt calibration's buffer has started striding)."""
    k, v, q = synthetic(60, seed=6)
    cache = QFiltersCache(config(made, qfilters_calib_tokens=4), None, 0)
    fresh = QFiltersCache(config(made, qfilters_calib_tokens=4), None, 0)
    feed(cache, k, v, q, 0, 50)
    assert cache.is_trimmable() and cache.trim(20) == 20 and cache.offset == 30
    feed(fresh, k, v, q, 0, 30)
    assert mx.array_equal(feed(cache, k, v, q, 30, 60), feed(fresh, k, v, q, 30, 60))
    calibrating = QFiltersCache(config(qfilters_calib_tokens=4), None, 0)  # its buffer strides: inexact
    feed(calibrating, k, v, q, 0, 50)
    assert not calibrating.is_trimmable()


def test_the_retention_check_does_not_apply_with_a_file(made, monkeypatch):
    """It measures a filter on the queries it was fitted on, which a calibrated cache never
    holds: a threshold no filter meets raises on the prompt calibration only."""
    k, v, q = synthetic(200, seed=7)
    strict = {"qfilters_min_retention": 1.0, "qfilters_on_low_retention": "raise"}
    with pytest.raises(LowRetentionError):
        prompt_then_steps(QFiltersCache(config(**strict)), k, v, q, 150, 64)
    monkeypatch.setattr(qf, "retention", no_fit)
    cache = QFiltersCache(config(made, **strict))
    prompt_then_steps(cache, k, v, q, 150, 64)
    assert cache.stored_length == BUDGET + (200 - 150) % EVICT_EVERY  # evicted at the prompt's end and a step


def test_a_file_for_another_method_setting_model_or_shape_is_refused_naming_both_values(made, tmp_path):
    other = str(tmp_path / "other.safetensors")
    write_calibration(other, {0: {"filter": mx.zeros((1, HKV, D))}}, {**synthetic_header(), "method": "knorm"})
    wide = mx.zeros((1, HKV, 8, D))
    refusals = [
        (lambda: QFiltersCache(config(other), None, 0).update_and_fetch(wide, wide), other,
         "method is 'knorm' in the file .*, but 'qfilters' in the config"),
        (lambda: QFiltersCache(config(made, qfilters_n_sink=2), None, 0).update_and_fetch(wide, wide), made,
         "qfilters_n_sink is 4 in the file .*, but 2 in the config"),
        (lambda: make_prompt_cache(tiny_model("llama"), config(made, qfilters_budget=40)), made,
         r"num_hidden_layers is 4 in the file \(made for .*\), but 2 in the model"),
        (lambda: QFiltersCache(config(made), None, 0).update_and_fetch(wide[..., :64], wide[..., :64]), made,
         "head_dim is 128 in the file .*, but 64 in the keys of layer 0"),
        (lambda: QFiltersCache(config(made), None, 3).update_and_fetch(wide[:, :1], wide[:, :1]), made,
         "num_key_value_heads is 2 in the file .*, but 1 in the keys of layer 3"),
    ]
    for build, path, message in refusals:
        with pytest.raises(CalibrationError, match=message) as refused:
            build()
        assert f"calibration_file={path!r}" in str(refused.value)
    # the budget, window, sign, calibration count and retention settings leave the filter as is
    c = QFiltersCache(config(made, qfilters_budget=32, qfilters_recent=8, qfilters_sign=-1, qfilters_calib_tokens=16,
                             qfilters_min_retention=None), None, 2)
    c.update_and_fetch(wide, wide)
    assert mx.array_equal(c.filter, file_filter(made, 2))


def test_veloxquant_calibrate_writes_the_filters_that_generation_uses(made, reference):
    arrays, meta = read_calibration(made)
    assert meta["method"] == "qfilters" and meta["layers"] == [0, 1, 2, 3] and meta["tokens"] == TOKENS
    assert [meta[f] for f in QFiltersCache.calibration_fields] == [4]
    assert set(arrays) == {f"layer{i}.filter" for i in range(4)}
    for i in range(4):
        f = arrays[f"layer{i}.filter"]
        assert f.shape == (1, HKV, D) and f.dtype == mx.float32
        norms = mx.linalg.norm(f, axis=-1)  # a mean of unit vectors, close to one
        assert float(norms.max()) <= 1 + 1e-5 and float(norms.min()) > 0.5
    model, tokenizer = reference
    cache = make_prompt_cache(model, config(made))
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=40, prompt_cache=cache)
    assert text
    for i, c in enumerate(cache):
        assert mx.array_equal(c.filter, arrays[f"layer{i}.filter"]) and c.calib is None
        assert c.stored_length < c.offset
