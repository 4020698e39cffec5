"""Batched generation checks shared by tests/test_conformance.py (issue 24).

Two drivers run the same sequences alone and through mlx-lm's own ``BatchGenerator``
(merge, right-padded prompt chunks with prepare/finalize, the prefill split with its deep
copy, filter when a sequence finishes, extend when one joins, extract):

- ``RowwiseModel``: a stand-in for a model whose every operation is row-wise and
  elementwise (keys, values and queries from per-token tables and the position, logits
  from the attention output), so that a batch computes each sequence's inputs to the
  caches bit-for-bit as alone: whatever differs is the caches' doing. Batch outputs and
  extracted caches must be bit-identical to the sequences run alone.
- a real mlx-lm model (tests/tiny_models.py): its projections are matrix products whose
  rounding on MLX's CPU back-end depends on how many rows a call has (a right-padded
  batch chunk has more than the sequence alone), so the keys the caches get differ in
  the last bits; greedy tokens must be equal, logits and kept arrays equal within float
  rounding, kept positions equal.
"""

from __future__ import annotations

import json
import math

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

from conformance import arrays_held

PROMPTS = (30, 200, 130, 75)  # tokens: under and over the budget, chunked at PREFILL
MAX_TOKENS = (10, 6, 12, 8)  # they finish at different steps
JOIN_AT = 3  # the last two join after this many generation steps
PREFILL = 64


class RowwiseModel:
    """Two attention layers over per-token tables; logits are the attention outputs."""

    def __init__(self, heads=4, kv_heads=2, head_dim=32, vocab=128, layers=2, seed=0):
        key = mx.random.key(seed)
        k1, k2, k3 = mx.random.split(key, 3)
        self.kv_heads, self.heads, self.head_dim = kv_heads, heads, head_dim
        self.k_table = mx.random.normal((layers, vocab, kv_heads, head_dim), key=k1)
        self.v_table = mx.random.normal((layers, vocab, kv_heads, head_dim), key=k2)
        self.q_table = mx.random.normal((layers, vocab, heads, head_dim), key=k3)
        self.layers = [None] * layers
        self.vocab = vocab
        self.scale = 1 / math.sqrt(head_dim)

    def _rows(self, table, tokens, offset):
        n = tokens.shape[1]
        pos = mx.array(offset).reshape(-1, 1) + mx.arange(n)[None]  # (B, N)
        x = table[tokens]  # (B, N, H, D)
        x = x * (1 + 0.001 * mx.cos(pos.astype(mx.float32)))[..., None, None]
        return x.transpose(0, 2, 1, 3)

    def __call__(self, tokens, cache):
        tokens = tokens % self.vocab
        total = None
        for layer, c in enumerate(cache):
            offset = c.offset
            k = self._rows(self.k_table[layer], tokens, offset)
            v = self._rows(self.v_table[layer], tokens, offset)
            q = self._rows(self.q_table[layer], tokens, offset)
            n = tokens.shape[1]
            keys, values = c.update_and_fetch(k, v)
            mask = None if n == 1 else "causal"
            out = c.attend(q, keys, values, scale=self.scale, mask=mask)
            total = out if total is None else total + out
        b, h, n, d = total.shape
        return total.transpose(0, 2, 1, 3).reshape(b, n, h * d)[..., : self.vocab]


def run_alone(model, make_cache, tokens, max_tokens, prefill=PREFILL):
    """What BatchGenerator does for one sequence, with its own caches: the prompt but its
    last token in chunks of ``prefill``, the last token alone, then each greedy token fed
    back. Returns (tokens generated, their log-probabilities, the cache)."""
    cache = make_cache()
    body = list(tokens[:-1])
    while body:
        model(mx.array(body[:prefill])[None], cache=cache)
        body = body[prefill:]
    y, out, logprobs = tokens[-1], [], []
    for step in range(max_tokens + 1):
        logits = model(mx.array([[y]]), cache=cache)[:, -1]
        lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if step:
            out.append(y)
        if step == max_tokens:
            break
        y = int(mx.argmax(lp, axis=-1).item())
        logprobs.append(lp[0])
    return out, logprobs, cache


def run_batched(model, prompts, max_tokens, join_at=JOIN_AT, prefill=PREFILL, check=None):
    """The prompts through mlx-lm's BatchGenerator: the first two, then the others joining
    after ``join_at`` generation steps. Returns per prompt (tokens, logprobs, extracted
    cache). ``check(generator)`` runs after every step."""
    gen = BatchGenerator(model, max_tokens=max(max_tokens), prefill_step_size=prefill,
                         prefill_batch_size=2, completion_batch_size=3)
    uids = gen.insert([list(p) for p in prompts[:2]], list(max_tokens[:2]))
    tokens, logprobs, caches, steps = {}, {}, {}, 0
    try:
        while True:
            responses = gen.next_generated()
            if not responses:
                break
            steps += 1
            if steps == join_at:
                uids += gen.insert([list(p) for p in prompts[2:]], list(max_tokens[2:]))
            for r in responses:
                tokens.setdefault(r.uid, []).append(r.token)
                logprobs.setdefault(r.uid, []).append(r.logprobs)
                if r.finish_reason is not None:
                    caches[r.uid] = r.prompt_cache
            if check:
                check(gen)
    finally:
        gen.close()
    assert len(uids) == len(prompts) and set(caches) == set(uids)
    return [(tokens[u], logprobs[u], caches[u]) for u in uids]


def batch_caches(gen):
    """The batch caches a BatchGenerator holds now (prompt batch and generation batch)."""
    return [c for batch in (gen._prompt_batch, gen._generation_batch) for c in batch.prompt_cache]


def state_arrays(cache):
    """name -> array of what a cache keeps (its saved state's arrays)."""
    return {k: v for k, v in cache.state["arrays"].items() if v is not None}


def _meta(cache):
    """A cache's saved meta, less the cross-layer link's id (cache/cross_layer.py: a random
    id per prompt cache, which tells the layers of one saved file apart from another's)."""
    meta = dict(cache.state["meta"])
    if "cross_layer" in meta:
        own = json.loads(meta["cross_layer"])
        if own.get("link"):
            own["link"] = {k: v for k, v in own["link"].items() if k != "id"}
        meta["cross_layer"] = own
    return meta


def assert_same_cache(batched, alone, exact: bool, atol=1e-5, by_shape=()):
    """An extracted cache is the cache of the sequence run alone: same class, offset,
    stored rows, nbytes, kept positions, and kept arrays (bit-identical when ``exact``;
    those named in ``by_shape`` by shape and dtype only, their values checked by the caller)."""
    for b, a in zip(batched, alone):
        assert type(b) is type(a)
        assert (b.offset, b.stored_length, b.nbytes) == (a.offset, a.stored_length, a.nbytes), (
            (b.offset, b.stored_length, b.nbytes), (a.offset, a.stored_length, a.nbytes))
        assert _meta(b) == _meta(a), (_meta(b), _meta(a))
        mine, theirs = state_arrays(b), state_arrays(a)
        assert set(mine) == set(theirs)
        for name, x in mine.items():
            y = theirs[name]
            assert x.shape == y.shape and x.dtype == y.dtype, name
            if name in by_shape:
                continue
            if exact or not mx.issubdtype(x.dtype, mx.floating):
                assert mx.array_equal(x, y), (name, b.layer)
            else:
                assert mx.allclose(x, y, atol=atol, rtol=atol), (name, float(mx.abs(x - y).max()))


def assert_batch_equals_alone(got, alone, atol=1e-5, by_shape=()):
    """``run_batched``'s results against ``run_alone``'s, sequence by sequence: the same
    tokens, log-probs and extracted caches to ``atol`` (a packed run: float rounding;
    ``by_shape``: as ``assert_same_cache``'s)."""
    assert len(got) == len(alone)
    for (tokens, logprobs, cache), (a_tokens, a_logprobs, a_cache) in zip(got, alone):
        assert tokens == a_tokens
        for x, y in zip(logprobs, a_logprobs):
            assert mx.allclose(x, y, atol=atol, rtol=atol), float(mx.abs(x - y).max())
        assert_same_cache(cache, a_cache, exact=False, atol=atol, by_shape=by_shape)


def memory_check(gen):
    """Every batch cache's nbytes is what it holds: per sequence, its sequences' caches (an
    array several keep, a calibration's tables, once); packed, its arrays (each sequence's
    slots, the padding after them, spare rows)."""
    for c in batch_caches(gen):
        assert c.nbytes == arrays_held(c), (c, arrays_held(c))
        if c.mode == "per_sequence":  # the sum of its sequences', arrays they share once
            assert c.nbytes <= sum(s.nbytes for s in c.seqs)


class _RowwiseArgs:
    """What methods read from a model's args (rotary settings, head counts)."""

    model_type = "llama"
    rope_theta = 10000.0
    rope_traditional = False
    rope_scaling = None
    head_dim = 32
    num_attention_heads = 4
    num_key_value_heads = 2
    max_position_embeddings = 4096


def rowwise_setup(method, settings):
    """A RowwiseModel whose ``make_cache`` builds ``method``'s caches (one context each)."""
    from veloxquant_mlx.cache.context import ModelContext
    from veloxquant_mlx.registry import METHODS

    from conformance import config

    cfg = config(method, settings)
    cls = METHODS[method].load_implementation()
    model = RowwiseModel()
    n = len(model.layers)

    def make():
        context = ModelContext(cfg, n, tuple(range(n)), model_args=_RowwiseArgs())
        context.layers = [cls(cfg, context, i) for i in range(n)]  # how layers find each other
        return list(context.layers)

    model.make_cache = make
    return model, make


def rowwise_calibration(folder, method, settings, tokens=400, iters=0) -> str:
    """A ``veloxquant calibrate`` file of ``method`` at ``settings`` for the row-wise model,
    fitted on a token sequence of its own (``prompt(tokens, seed=99)``), each layer's keys and
    values (and queries, for a class that calibrates on them) as the model makes them: its path."""
    from tiny_models import prompt
    from veloxquant_mlx.cache.calibration import calibration_header, write_calibration
    from veloxquant_mlx.registry import METHODS

    from conformance import config

    cfg, args = config(method, settings), _RowwiseArgs()
    cls = METHODS[method].load_implementation()
    model, _ = rowwise_setup(method, settings)
    ids = (mx.array(prompt(tokens, seed=99).tolist()) % model.vocab)[None]
    layers = {}
    for layer in range(len(model.layers)):
        k, v, q = (model._rows(t[layer], ids, 0) for t in (model.k_table, model.v_table, model.q_table))
        queries = {"queries": q} if getattr(cls, "calibration_queries", False) else {}
        layers[layer] = cls.calibrate(k, v, cfg, iters=iters, seed=0, model_args=args, **queries)
    path = str(folder / f"{method}-rowwise.safetensors")
    write_calibration(path, layers, calibration_header(cls, cfg, args, "rowwise"))
    return path


def run_rows(cache, keys, values, queries, n_prompt, chunk=64):
    """A cache fed (B, H, T, D) keys and values directly: the first ``n_prompt`` tokens in
    chunks of ``chunk`` (causal), then one token a step; every attention output of the
    queries (B, Hq, T, D), at scale D ** -0.5, each evaluated at its step."""
    outs, i, t, scale = [], 0, keys.shape[2], keys.shape[-1] ** -0.5
    while i < t:
        n = min(chunk, n_prompt - i) if i < n_prompt else 1
        k, v = cache.update_and_fetch(keys[:, :, i : i + n], values[:, :, i : i + n])
        outs.append(cache.attend(queries[:, :, i : i + n], k, v, scale=scale, mask="causal" if n > 1 else None))
        mx.eval(outs[-1])
        i += n
    return outs


def saved_state(cache):
    """A copy of a cache's saved state whose arrays and meta can be edited (the arrays
    themselves shared)."""
    state = cache.state
    return {"arrays": dict(state["arrays"]), "meta": dict(state["meta"])}


def assert_each_row_alone(both, outs, make, keys, values, queries, n_prompt, chunk=64):
    """Each row of ``both`` (a cache ``run_rows`` fed every row, ``outs`` its outputs) is
    the cache ``make()`` fed that row alone: every output and kept array bit for bit, and
    ``nbytes`` the sum of the rows' caches'."""
    arrays, nbytes, batch = both.state["arrays"], 0, keys.shape[0]
    for r in range(batch):
        take = slice(r, r + 1)
        alone = make()
        out_alone = run_rows(alone, keys[take], values[take], queries[take], n_prompt, chunk)
        for step, (x, y) in enumerate(zip(outs, out_alone)):
            assert mx.array_equal(x[take], y), (r, step)
        for name, a in alone.state["arrays"].items():
            if a is not None:
                assert arrays[name].shape[0] == batch and mx.array_equal(arrays[name][take], a), (r, name)
        nbytes += alone.nbytes
    assert both.nbytes == nbytes
