"""A prompt chunk is stored with its layer (issue 31: peak memory over prefill).

A cache whose storing of a chunk (quantizing it, keeping the observation window's queries,
scoring it) is not part of what the layer's attention returns leaves that work lazy until
the state is evaluated after the whole model, and until then every layer's inputs to it
(the chunk's queries, a decoded history) stay alive at once. Before this was fixed, a
prompt chunk of the small preset at 4k peaked above mlx-lm's KVCache's in snapkv (+13%),
qfilters (+12%) and zipcache (+21%), and every quantized store held its chunk's keys and
values for the whole model (``benchmarks/notes/prefill.md``, session 60).

The invariant checked: once the logits of a prompt chunk are evaluated, no array a cache
keeps has work left to do.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from conformance import config, profile
from decode_steps import cache_arrays, graph_nodes
from tiny_models import prompt, tiny_model
from veloxquant_mlx import make_prompt_cache
from veloxquant_mlx.registry import implemented_methods

LEFT_LAZY = {
    # no attention of its own (mlx-lm's reads what update_and_fetch returns), so nothing to
    # hang its storing on: the window it keeps is a slice of what that attention reads
    "streaming_llm": "its kept window is built after mlx-lm's attention, which it does not own",
}


@pytest.mark.parametrize("method", [
    pytest.param(m, marks=pytest.mark.xfail(strict=True, reason=LEFT_LAZY[m])) if m in LEFT_LAZY else m
    for m in implemented_methods()])
def test_a_prompt_chunks_storing_is_done_when_its_logits_are(method):
    model = tiny_model("llama")
    tokens = prompt(256)[None]
    cache = make_prompt_cache(model, config(method, profile(method).compressing))
    for start, stop in ((0, 128), (128, 255)):
        mx.eval(model(tokens[:, start:stop], cache=cache))
        pending = graph_nodes(cache_arrays(cache))
        assert pending == 0, (f"{method}: {pending} operations on the cache's arrays left undone after "
                              f"the logits of prompt tokens {start}..{stop} were evaluated")


def test_a_kvzip_probe_chunks_reliance_is_done_when_its_output_is(monkeypatch):
    """KVzip's reconstruction pass scores each probe chunk into ``reliance``; left lazy until
    the pass evaluated every layer's, each layer's probe queries and keys stayed alive at
    once (the quick bench's peak: 2.33x the full cache's, 1.44x scored with the layer)."""
    from tiny_models import char_tokenizer
    from veloxquant_mlx import KVCacheConfig
    from veloxquant_mlx.methods.kvzip import cache as kvzip

    monkeypatch.setattr(kvzip, "CHUNK", 64)
    model, tok = tiny_model("llama"), char_tokenizer()
    ids = prompt(150).tolist()
    cache = make_prompt_cache(model, KVCacheConfig.from_dict({"method": "kvzip", "options": {"kvzip_budget": 40}}))
    for c in cache:
        c.begin_reconstruction()
    mx.eval(model(mx.array(ids)[None], cache=cache))
    start, end, probe = next(iter(kvzip.probe_chunks(tok, ids)))
    for c in cache:
        c.begin_probe(start, end)
    mx.eval(model.model(mx.array(probe)[None], cache=cache))
    pending = graph_nodes([c.reliance for c in cache])
    assert pending == 0, f"{pending} operations of the probe's reliance left after its output"
