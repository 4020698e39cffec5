"""Model-mode metrics on the embedded reference model, on cases with known answers."""

import math

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import KVCache

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.bench.harness import MethodRun, Workload, evaluate
from veloxquant_mlx.bench.tasks import load_default_filler, make_examples
from veloxquant_mlx.reference import REFERENCE_MODEL
from veloxquant_mlx.methods.full import FullCache


@pytest.fixture(scope="module")
def model_and_work():
    model, tokenizer = mlx_lm.load(str(REFERENCE_MODEL))
    model.set_dtype(mx.float32)
    examples = make_examples("niah_single", 2, 1024, depths=(0.3, 0.7))
    text = tokenizer.encode(load_default_filler())[:1024]
    work = Workload(retrieval=examples, prefix=text[:992], continuation=text[992:1024])
    return model, tokenizer, work


class ZeroValuesCache(FullCache):
    """Broken on purpose: attention reads all-zero values."""

    def update_and_fetch(self, keys, values):
        keys, values = super().update_and_fetch(keys, values)
        return keys, mx.zeros_like(values)


class NeedleDroppingCache(FullCache):
    """Broken on purpose: forgets everything but the last 64 prompt tokens before decoding."""

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1 and self.keys.length > 64 and not getattr(self, "dropped", False):
            self.dropped = True
            kept_k, kept_v = self.keys.view()[:, :, -64:], self.values.view()[:, :, -64:]
            self.keys.reset(mx.contiguous(kept_k))
            self.values.reset(mx.contiguous(kept_v))
        return super().update_and_fetch(keys, values)


def _run(model_and_work, label, make_cache=None, reference=None):
    model, tokenizer, work = model_and_work
    run = MethodRun(label, KVCacheConfig(), make_cache=make_cache)
    return evaluate(model, tokenizer, run, work, reference)


def test_full_against_itself_and_against_mlx_lm(model_and_work):
    full, logprobs = _run(model_and_work, "full")
    assert full["status"] == "ok"
    assert full["retrieval"]["accuracy"] == 1.0  # the reference model finds both needles
    again, _ = _run(model_and_work, "full", reference=logprobs)
    assert again["continuation"]["kl_mean"] == 0.0
    assert again["continuation"]["top1_agreement"] == 1.0
    assert again["retrieval"]["accuracy"] == full["retrieval"]["accuracy"]
    stock, _ = _run(model_and_work, "mlx-lm", lambda m: [KVCache() for _ in m.layers], logprobs)
    assert stock["continuation"]["kl_mean"] == 0.0 and stock["continuation"]["top1_agreement"] == 1.0
    assert math.isclose(stock["continuation"]["perplexity"], full["continuation"]["perplexity"])


def test_bytes_per_token_match_an_independent_count(model_and_work):
    model, _, work = model_and_work
    full, _ = _run(model_and_work, "full")
    n = len(work.prefix)
    args = model.args
    rows = -(-n // 256) * 256  # FullCache grows 256 rows at a time, like mlx-lm's KVCache
    per_layer = 2 * args.num_key_value_heads * rows * args.head_dim * 4  # K and V, float32
    assert full["memory_speed"]["kv_bytes_prefill"] == args.num_hidden_layers * per_layer
    assert full["memory_speed"]["bytes_per_token_prefill"] == args.num_hidden_layers * per_layer / n


def test_broken_caches_are_caught(model_and_work):
    _, reference = _run(model_and_work, "full")
    zeros, _ = _run(model_and_work, "zeros", lambda m: [ZeroValuesCache(KVCacheConfig(), None, i) for i in range(len(m.layers))], reference)
    assert zeros["status"] == "ok"
    assert zeros["retrieval"]["accuracy"] == 0.0
    assert zeros["continuation"]["kl_mean"] > 1.0 and zeros["continuation"]["top1_agreement"] < 0.5
    dropped, _ = _run(model_and_work, "dropped", lambda m: [NeedleDroppingCache(KVCacheConfig(), None, i) for i in range(len(m.layers))], reference)
    assert dropped["retrieval"]["accuracy"] == 0.0  # the needles were more than 64 tokens back
    assert dropped["continuation"]["kl_mean"] > 0.01


def test_a_failing_method_is_recorded_not_raised(model_and_work):
    def explode(model):
        raise RuntimeError("kaboom")

    result, logprobs = _run(model_and_work, "explodes", explode)
    assert result["status"] == "failed" and result["error"] == "RuntimeError: kaboom"
    assert logprobs is None
