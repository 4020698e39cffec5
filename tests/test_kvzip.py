"""KVzip: reconstruction-pass scores, the global ranking, its padded memory, the fall-back."""

from __future__ import annotations

import copy
import warnings

import mlx.core as mx
import mlx_lm.models.llama as llama
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, load_prompt_cache, make_prompt_cache as native_cache, save_prompt_cache

from tiny_models import char_tokenizer, prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.integrations.mlx_lm import prefill_with_reconstruction, run_reconstruction_pass
from veloxquant_mlx.methods.kvzip import cache as kvzip

D = 32  # the tiny models' head_dim


def kvzip_cache(model, **options):
    return make_prompt_cache(model, KVCacheConfig.from_dict({"method": "kvzip", "options": options}))


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(kvzip, "CHUNK", 64)  # several probe chunks on a short context


def test_probe_is_the_repeat_prompt_chunked_with_an_overlap(small_chunks):
    tok = char_tokenizer()
    ids = prompt(150).tolist()
    chunks = kvzip.probe_chunks(tok, ids)
    enc = lambda s: tok.encode(s, add_special_tokens=False)
    assert [(s, e) for s, e, _ in chunks] == [(0, 64), (64, 128), (128, 150)]
    assert chunks[0][2] == enc("\n\nRepeat the previous context exactly.") + enc("\n") + ids[:64]
    later = enc("\n\nRepeat the part of the previous context exactly, starting with ")
    assert chunks[2][2] == later + ids[120:128] + enc("\n") + ids[128:]


def _brute_force_reliance(model, tok, ids, n_sink, monkeypatch):
    """Every layer's queries and keys recorded from a plain mlx-lm cache, the card's score
    computed in numpy: max over query heads and repeat positions of the softmax over
    [sinks before the chunk, chunk, repeat block (causal)], per chunk token."""
    seen = []
    original = llama.scaled_dot_product_attention

    def record(queries, keys, values, cache=None, **kw):
        seen.append((np.array(queries), np.array(keys)))
        return original(queries, keys, values, cache=cache, **kw)

    monkeypatch.setattr(llama, "scaled_dot_product_attention", record)
    plain = [KVCache() for _ in model.layers]
    model(mx.array(ids)[None], cache=plain)
    t, n_layers = len(ids), len(model.layers)
    out = np.zeros((n_layers, 2, t))
    for start, end, probe in kvzip.probe_chunks(tok, ids):
        seen.clear()
        model(mx.array(probe)[None], cache=plain)
        for layer, (q, k) in enumerate(seen):
            q, k = q[0].astype(np.float64), k[0].astype(np.float64)  # (Hq, n, D), (Hkv, t + n, D)
            n, s = q.shape[1], min(n_sink, start)
            cols = list(range(s)) + list(range(start, end)) + list(range(t, t + n))
            for h in range(k.shape[0]):
                for g in range(q.shape[0] // k.shape[0]):
                    logits = q[h * (q.shape[0] // k.shape[0]) + g] @ k[h, cols].T * D**-0.5
                    causal = np.arange(n)[None, :] <= np.arange(n)[:, None]
                    logits[:, s + end - start :][~causal] = -np.inf
                    w = np.exp(logits - logits.max(-1, keepdims=True))
                    w /= w.sum(-1, keepdims=True)
                    out[layer, h, start:end] = np.maximum(out[layer, h, start:end], w[:, s : s + end - start].max(0))
        for c in plain:
            c.trim(len(probe))
    return out


def test_reconstruction_scores_equal_brute_force(small_chunks, monkeypatch):
    model, tok = tiny_model("llama"), char_tokenizer()
    ids = prompt(150).tolist()
    cache = kvzip_cache(model, kvzip_budget=40, kvzip_n_sink=4)
    for c in cache:
        c.begin_reconstruction()
    model(mx.array(ids)[None], cache=cache)
    run_reconstruction_pass(model, tok, ids, cache)
    assert all(c.offset == 150 and c.store.rows == 150 for c in cache)  # the repeat KV is gone
    ours = np.stack([np.array(c.reliance[0]) for c in cache])
    expected = _brute_force_reliance(model, tok, ids, 4, monkeypatch)
    assert ours.min() >= 0 and ours.max() <= 1
    np.testing.assert_allclose(ours, expected, rtol=1e-4, atol=1e-6)
    assert mx.all(cache[0].ranking_scores()[..., :4] == float("inf"))  # sinks rank first


def test_global_ranking_keeps_exactly_ratio_times_total_with_padding_in_nbytes():
    model, tok = tiny_model("llama", num_hidden_layers=3), char_tokenizer()
    ids, budget = prompt(200).tolist(), 48
    cache = kvzip_cache(model, kvzip_budget=budget)
    for c in cache:
        c.begin_reconstruction()
    model(mx.array(ids)[None], cache=cache)
    run_reconstruction_pass(model, tok, ids, cache)
    ranking = np.stack([np.array(c.ranking_scores()[0]) for c in cache])  # (L, H, T)
    kvzip.KVzipCache.select_globally(cache)

    total = 3 * 2 * budget  # ratio B / T of all layers x heads x tokens
    threshold = np.sort(ranking.reshape(-1))[::-1][total - 1]
    counts = []
    for layer, c in enumerate(cache):
        kept = np.array(c.kept_positions[0])
        for h in range(2):
            mine = sorted(p for p in kept[h].tolist() if p >= 0)
            assert mine == sorted(np.flatnonzero(ranking[layer, h] >= threshold).tolist())
            counts.append(len(mine))
        assert c.stored_length == max(counts[-2:])
        row_bytes = 2 * (2 * D * 4 + 4)  # both heads' K and V (float32) and positions
        assert c.nbytes == c.store.rows * row_bytes  # padding slots are stored and counted
        assert c.store.rows == max(counts[-2:])
    assert sum(counts) == total and len(set(counts)) > 1  # per-head budgets differ
    # the card's memory, min(T, B) per head on average, plus the padding the layout needs
    useful = sum(counts) * (2 * D * 4 + 4)
    assert sum(c.nbytes for c in cache) >= useful


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_ratio_one_equals_the_full_cache_exactly(arch):
    model, tok = tiny_model(arch), char_tokenizer()
    tokens = prompt(130)
    ctx, rest = tokens[:120], tokens[120:]
    ref = native_cache(model)
    model(ctx[None], cache=ref)
    cache = kvzip_cache(model, kvzip_budget=4096)
    prefill_with_reconstruction(model, tok, ctx.tolist(), cache)
    for ours, theirs in zip(cache, ref):
        if isinstance(theirs, KVCache) and type(theirs) is KVCache:
            assert ours.offset == theirs.offset == 120 and ours.stored_length == 120
            assert mx.array_equal(ours.store.view("keys"), theirs.keys[..., :120, :])
            assert mx.array_equal(ours.store.view("values"), theirs.values[..., :120, :])
            assert ours.nbytes == 120 * 2 * (2 * D * 4 + 4)  # no room left from the repeat blocks
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the pass ran: no fall-back later
        a = mx.concatenate([model(t.reshape(1, 1), cache=cache)[:, -1] for t in rest])
    b = mx.concatenate([model(t.reshape(1, 1), cache=ref)[:, -1] for t in rest])
    assert mx.array_equal(a, b)


def test_after_the_pass_later_tokens_are_appended_and_the_choice_is_query_agnostic():
    model, tok = tiny_model("llama"), char_tokenizer()
    ids = prompt(200).tolist()
    cache = kvzip_cache(model, kvzip_budget=32)
    prefill_with_reconstruction(model, tok, ids, cache)
    again = kvzip_cache(model, kvzip_budget=32)
    prefill_with_reconstruction(model, tok, ids, again)
    for a, b in zip(cache, again):  # deterministic: the same kept set, before any question
        assert mx.array_equal(a.kept_positions, b.kept_positions)
    stored = [c.stored_length for c in cache]
    for question in (prompt(20, seed=5), prompt(25, seed=6)):
        copy_ = copy.deepcopy(cache)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            model(question[:-1][None], cache=copy_)
            model(question[-1:][None], cache=copy_)
            model(mx.array([[7]]), cache=copy_)
        assert [c.stored_length for c in copy_] == [s + question.shape[0] + 1 for s in stored]
    assert [c.stored_length for c in cache] == stored  # copies answer, the original stays


def test_saved_after_the_pass_loads_and_continues_the_same(tmp_path):
    model, tok = tiny_model("llama"), char_tokenizer()
    cache = kvzip_cache(model, kvzip_budget=32)
    prefill_with_reconstruction(model, tok, prompt(200).tolist(), cache)
    path = str(tmp_path / "kvzip.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [l.nbytes for l in loaded] == [c.nbytes for c in cache] and loaded[0].padded
    steps = prompt(6, seed=9)
    a = mx.concatenate([model(t.reshape(1, 1), cache=cache)[:, -1] for t in steps])
    b = mx.concatenate([model(t.reshape(1, 1), cache=loaded)[:, -1] for t in steps])
    assert mx.array_equal(a, b)


def test_without_the_pass_the_fall_back_warns_and_keeps_the_budget_per_head():
    model = tiny_model("llama")
    tokens = prompt(120)
    short = kvzip_cache(model, kvzip_budget=200)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # under the budget: nothing to compress, no warning
        model(tokens[:-1][None], cache=short)
        model(tokens[-1:][None], cache=short)
    cache = kvzip_cache(model, kvzip_budget=40, kvzip_n_sink=4)
    model(tokens[:-1][None], cache=cache)
    with pytest.warns(RuntimeWarning, match="fall-back, not KVzip.*prefill_with_reconstruction"):
        model(tokens[-1:][None], cache=cache)
    for c in cache:
        kept = c.kept_positions
        assert kept.shape[-1] == 40 and not c.padded
        assert mx.all(kept[..., :4] == mx.arange(4))  # the sinks


def test_the_pass_refuses_a_used_cache_and_other_methods():
    model, tok = tiny_model("llama"), char_tokenizer()
    cache = kvzip_cache(model)
    model(prompt(10)[None], cache=cache)
    with pytest.raises(ValueError, match="needs a fresh cache; this one already holds 10 tokens"):
        prefill_with_reconstruction(model, tok, prompt(10).tolist(), cache)
    snap = make_prompt_cache(model, KVCacheConfig(method="snapkv"))
    with pytest.raises(ValueError, match=r"no layer .* reconstruction pass .*'snapkv'.*only kvzip"):
        prefill_with_reconstruction(model, tok, prompt(10).tolist(), snap)


def test_veloxquant_generate_runs_the_pass(capsys):
    from veloxquant_mlx.cli import main

    prompt_text = "And he said unto them, " * 6  # 139 tokens, over the budget of 32
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the fall-back would warn
        assert main(["generate", "--method", "kvzip", "--set", "kvzip_budget=32", "--prompt",
                     prompt_text, "--max-tokens", "3"]) == 0
    err = capsys.readouterr().err
    assert "[kv cache] kvzip: prefill" in err and "reconstruction pass" in err
    assert "tokens=142" in err.strip().splitlines()[-1]  # the prompt (BOS included) + 3


def test_per_layer_budgets_from_the_model_context_set_the_global_total():
    model, tok = tiny_model("llama"), char_tokenizer()
    cache = kvzip_cache(model, kvzip_budget=48)
    cache[0].context.layer_budgets.update({0: 16, 1: 64})
    prefill_with_reconstruction(model, tok, prompt(200).tolist(), cache)
    kept = sum(int((c.kept_positions >= 0).sum()) for c in cache)
    assert kept == 2 * 16 + 2 * 64  # H_kv x min(budget_l, T), summed over layers


def test_the_pass_per_sequence_then_a_batch_answers_like_each_sequence_alone():
    """kvzip batches per sequence (``batchable = "per_sequence"``): contexts compressed by
    their own reconstruction pass, then their questions batched through mlx-lm's
    BatchGenerator, give each sequence's greedy tokens, and its kept positions, as the
    same cache answering alone (log-probs to the float rounding of batched projections);
    no fall-back runs. The pass itself refuses a batch's cache, saying what to do."""
    import batching
    from mlx_lm.generate import BatchGenerator

    model, tok = tiny_model("llama"), char_tokenizer()
    contexts, questions, steps = [prompt(200, seed=1), prompt(150, seed=2)], [prompt(12, seed=3), prompt(7, seed=4)], 6
    settled = []
    for ctx in contexts:
        cache = kvzip_cache(model, kvzip_budget=32)
        prefill_with_reconstruction(model, tok, ctx.tolist(), cache)
        settled.append(cache)
    alone = [batching.run_alone(model, lambda c=c: copy.deepcopy(c), q.tolist(), steps)
             for c, q in zip(settled, questions)]
    tokens, logprobs, extracted = {}, {}, {}
    gen = BatchGenerator(model, max_tokens=steps)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the pass ran: no fall-back in the batch
            uids = gen.insert([q.tolist() for q in questions], [steps] * 2,
                              caches=[copy.deepcopy(c) for c in settled])
            while responses := gen.next_generated():
                for r in responses:
                    tokens.setdefault(r.uid, []).append(r.token)
                    logprobs.setdefault(r.uid, []).append(r.logprobs)
                    if r.finish_reason is not None:
                        extracted[r.uid] = r.prompt_cache
                batch = batching.batch_caches(gen)
                if batch:
                    with pytest.raises(ValueError, match="a batch's cache.*each sequence's own cache"):
                        prefill_with_reconstruction(model, tok, contexts[0].tolist(), batch)
    finally:
        gen.close()
    for uid, (a_tokens, a_logprobs, a_cache) in zip(uids, alone):
        assert tokens[uid] == a_tokens
        assert all(mx.allclose(x, y, atol=1e-4, rtol=1e-4) for x, y in zip(logprobs[uid], a_logprobs))
        for b, a in zip(extracted[uid], a_cache):
            assert (b.offset, b.stored_length, b.nbytes, b.padded) == (a.offset, a.stored_length, a.nbytes, a.padded)
            assert mx.array_equal(b.kept_positions, a.kept_positions)
