"""Issue 37: kvzip's reconstruction pass reports progress once a chunk (the CLI prints it),
and a KeyboardInterrupt from the callback stops the pass at once, the cache restored."""

from __future__ import annotations

import pytest

from tiny_models import char_tokenizer, prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache
from veloxquant_mlx.cli import main
from veloxquant_mlx.integrations.mlx_lm import prefill_with_reconstruction
from veloxquant_mlx.methods.kvzip import cache as kvzip


@pytest.fixture
def probes(monkeypatch):
    """Several probe chunks on a short context; counts the probe chunks that ran."""
    monkeypatch.setattr(kvzip, "CHUNK", 64)
    ran = []
    original = kvzip.KVzipCache.begin_probe

    def counting(self, start, end):
        if self.layer == 0:
            ran.append((start, end))
        return original(self, start, end)

    monkeypatch.setattr(kvzip.KVzipCache, "begin_probe", counting)
    return ran


def _cache(model):
    return make_prompt_cache(model, KVCacheConfig.from_dict({"method": "kvzip", "options": {"kvzip_budget": 32}}))


def test_the_callback_is_called_before_the_pass_and_once_per_chunk(probes):
    model, tok = tiny_model("llama"), char_tokenizer()
    calls = []
    prefill_with_reconstruction(model, tok, prompt(200).tolist(), _cache(model),
                                progress=lambda done, total: calls.append((done, total, len(probes))))
    # 200 tokens in chunks of 64: 4 chunks; each call after chunk k sees k probes run
    assert calls == [(0, 4, 0), (1, 4, 1), (2, 4, 2), (3, 4, 3), (4, 4, 4)]


def test_a_keyboard_interrupt_from_the_callback_stops_the_pass_at_once(probes, monkeypatch):
    model, tok = tiny_model("llama"), char_tokenizer()
    selected = []
    monkeypatch.setattr(kvzip.KVzipCache, "select_globally", classmethod(lambda cls, layers: selected.append(1)))
    cache = _cache(model)

    def stop(done, total):
        if done == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        prefill_with_reconstruction(model, tok, prompt(200).tolist(), cache, progress=stop)
    assert probes == [(0, 64)] and not selected  # no second chunk, no selection
    assert [(c.offset, c.stored_length) for c in cache] == [(200, 200)] * len(cache)  # the context again


def test_generate_prints_a_line_per_chunk(probes, capsys):
    text = "And he said unto them, go ye into all the world " * 3  # 150 bytes: 3 chunks
    assert main(["generate", "--method", "kvzip", "--prompt", text, "--max-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "[kv cache] kvzip: reconstruction pass in 3 chunk(s)" in err
    for k in (1, 2, 3):
        assert f"[kv cache] kvzip: reconstruction chunk {k}/3 done" in err, err
