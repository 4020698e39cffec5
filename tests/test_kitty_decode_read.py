"""Kitty's decode read (issue 30): the promoted-channel scores computed over the planes'
whole buffers (the up plane's scales taken by one gather, the result cut to the count after
the product) give, over 40 decode steps with key flushes among them, what attention over
the dequantized history gives, to float32 reassociation."""

import mlx.core as mx
import numpy as np
import pytest

from chained_layers import layer_rows, peak_growth
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import KittyOptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.kitty.cache import KittyCache
from veloxquant_mlx.methods.kitty.promoted import PromotedScores

EPS = float(mx.finfo(mx.float32).eps)


def kitty(lo, hi, f, block):
    options = KittyOptions(kitty_hi_fraction=f, kitty_hi_bit=hi, kitty_lo_bit=lo, kitty_group_size=32)
    return KittyCache(KVCacheConfig(method="kitty", options=options, residual_window=block), None, 0)


def keys_values(b, h, t, d, seed):
    k = mx.random.normal((b, h, t, d), key=mx.random.key(seed)) * (1 + 6 * (mx.arange(d) % 9 == 0))
    v = mx.random.normal((b, h, t, d), key=mx.random.key(seed + 1))
    return k, v


def reassociation_bound(q, k_hat, v_hat, scale):
    """What float32 reassociation may move one output by, from the operands: each score is a
    sum of D products (moved by at most D eps times the sum of their magnitudes), which moves
    every softmax weight by a relative 2 max|delta s| at most; the mix is a sum of T products
    (moved by T eps max|v| at most). Twice that, for the rounding of the steps around them."""
    b, hq, _, d = q.shape
    h = k_hat.shape[1]
    qg = (q.reshape(b, h, hq // h, d) * scale).astype(mx.float32)
    magnitude = mx.abs(qg) @ mx.abs(k_hat).swapaxes(-1, -2)  # (B, H, R, T)
    ds = d * EPS * float(magnitude.max())
    vmax, t = float(mx.abs(v_hat).max()), k_hat.shape[2]
    return 2 * vmax * (2 * ds + t * EPS)


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, the GPU's
@pytest.mark.parametrize("lo, hi, f, block", [(2, 4, 0.25, 32), (3, 7, 0.25, 64), (1, 8, 0.5, 32)])
def test_forty_decode_steps_match_attention_over_the_dequantized_history(lo, hi, f, block, pure_path,
                                                                         monkeypatch):
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    b, h, gqa, d, t0, steps = 2, 2, 2, 64, 150, 40
    keys, values = keys_values(b, h, t0 + steps, d, seed=31 + lo + hi)
    cache, scale = kitty(lo, hi, f, block), d**-0.5
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    q0 = mx.random.normal((b, h * gqa, t0, d), key=mx.random.key(3))
    cache.attend(q0, keys[:, :, :t0], values[:, :, :t0], scale=scale, mask="causal")
    flushed, spare = set(), 0
    for i in range(t0, t0 + steps):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        q = mx.random.normal((b, h * gqa, 1, d), key=mx.random.key(100 + i))
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=scale, mask=None)
        store = cache.store
        keys_layout = store.keys.layout(mx.zeros((0,)))
        assert isinstance(keys_layout, PromotedScores)
        flushed.add(store.keys.count)
        spare = max(spare, keys_layout.capacity - keys_layout.count)
        k_hat, v_hat = cache.dequantized(mx.float32)
        assert k_hat.shape[2] == i + 1
        ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=scale)
        err, bound = float(mx.abs(out - ref).max()), reassociation_bound(q, k_hat, v_hat, scale)
        assert err <= bound, (i, err, bound)
    # the steps crossed key flushes and read buffers with room past the count
    assert len(flushed) > 1 and spare > 0
    # the reference's up plane shares the scales' gather: that gather, against the lo plane's
    # scales read one by one
    keys = cache.store.keys
    nb, g = keys.count // block, 32
    index, lo_scales = np.array(keys.index.view()), np.array(keys.scales.view())
    got = np.array(keys.layout(mx.zeros((0,)))._up_scales(keys.index.view(), keys.scales.buffer))
    want = np.zeros(got.shape, np.float32)
    for bi, hi_, j, kk, s in np.ndindex(*got.shape):
        want[bi, hi_, j, kk, s] = lo_scales[bi, hi_, index[bi, hi_, j, kk], j * (block // g) + s] * (1 << lo)
    assert got.shape[2] == nb and np.array_equal(got, want)


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, the GPU's
@pytest.mark.parametrize("lo, hi, f, block", [(2, 4, 0.25, 32), (1, 8, 0.5, 32)])
def test_the_kept_step_read_gives_the_parts_read_bit_for_bit(lo, hi, f, block, pure_path, monkeypatch):
    """``KittyStore.attend_parts`` (the keys' compiled pass and inputs kept between writes,
    the value products summed in one pass) against the sink store's own read (its decode
    parts through ``kernels/decode.py``, the keys' read built anew), over 40 steps with key
    flushes among them: equal bit for bit."""
    from veloxquant_mlx.methods.kitty.cache import KittyStore
    from veloxquant_mlx.quant.sink_store import SinkQuantizedStore

    if mx.default_device() != mx.cpu and (pure_path == "qmm" or kd.gpu_backend() == "cuda"):
        # MLX's CUDA back-end has no quantized_matmul for these shapes, and a CUDA step takes the
        # CUDA read (tested on its own), not the kept step read (results/h200_s67)
        pytest.skip("the CPU's path, or the kept read a CUDA step does not take")
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    b, h, gqa, d, t0, steps = 2, 2, 2, 64, 150, 40
    keys, values = keys_values(b, h, t0 + steps, d, seed=17 + lo)
    cache, scale = kitty(lo, hi, f, block), d**-0.5
    assert isinstance(cache.store, KittyStore)
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    cache.attend(mx.random.normal((b, h * gqa, t0, d), key=mx.random.key(3)), keys[:, :, :t0],
                 values[:, :, :t0], scale=scale, mask="causal")
    counts = set()
    for i in range(t0, t0 + steps):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        q = mx.random.normal((b, h * gqa, 1, d), key=mx.random.key(100 + i))
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=scale, mask=None)
        store = cache.store
        assert store.keys.step_read() is not None  # the kept read served this step
        ref = SinkQuantizedStore.attend_parts(store, q, scale=scale, use_kernel=True, n_kv_heads=h)
        assert mx.array_equal(out, ref).item(), i
        counts.add(store.keys.count)
    assert len(counts) > 1  # the steps crossed a key flush


@pytest.mark.parametrize("lo, hi, f, block", [(2, 4, 0.25, 32), (1, 8, 0.5, 32)])
def test_on_cuda_the_decoded_rows_and_one_fused_attention_give_the_float32_read(lo, hi, f, block,
                                                                                 monkeypatch):
    """On CUDA a step reads every stored row decoded in the queries' dtype through one fused
    attention (benchmarks/results/h200_s63): over 40 steps with key flushes among them, what
    the float32 read of the CPU gives, to float32 reassociation."""
    b, h, gqa, d, t0, steps = 1, 2, 2, 64, 100, 40
    keys, values = keys_values(b, h, t0 + steps, d, seed=7 + lo + hi)
    cache, scale = kitty(lo, hi, f, block), d**-0.5
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    cache.attend(mx.random.normal((b, h * gqa, t0, d), key=mx.random.key(3)), keys[:, :, :t0],
                 values[:, :, :t0], scale=scale, mask="causal")
    from sdpa_calls import recorded

    fused = recorded(monkeypatch)
    for i in range(t0, t0 + steps):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        q = mx.random.normal((b, h * gqa, 1, d), key=mx.random.key(200 + i))
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=scale, mask=None)  # the CPU's read
        monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
        before = len(fused)
        on_cuda = cache.store.attend_parts(q, scale=scale, use_kernel=True, n_kv_heads=h)
        assert len(fused) == before + 1  # the fused attention read it
        monkeypatch.setattr(kd, "gpu_backend", lambda: None)
        k_hat, v_hat = cache.dequantized(mx.float32)
        err, bound = float(mx.abs(on_cuda - out).max()), reassociation_bound(q, k_hat, v_hat, scale)
        assert err <= bound, (i, err, bound)


def test_cuda_read_decodes_a_layers_history_only_once_its_queries_exist(monkeypatch):
    """The stored codes are ready before a step runs: unless each layer's decode waits for
    its queries, MLX decodes later layers' histories ahead of their attention and holds them
    together: before the gate, each layer from the 4th to the 8th added 4.1 MiB to the
    step's peak at these sizes (half its decoded keys and values). Gated, the next layer's
    decode may overlap this layer's attention (1 to 6 layers: 33.4 to 36.2 MiB), but the
    peak stops growing: from 4 to 8 layers by less than half of one layer's decoded rows
    (0.2 MiB alone, 2.8 MiB once in a CI worker after other tests; ungated, two layers'
    rows)."""
    make = lambda: KittyCache(KVCacheConfig(method="kitty"), None, 0)  # noqa: E731  (defaults)
    assert peak_growth(make, 4, 8, monkeypatch) < layer_rows() / 2


def test_float16_history_is_the_float32_one_rounded_once():
    """The keys decoded in float16 (the CUDA read's dtype, a float16 model's scales) are
    float32's decode rounded once on every channel, the promoted ones included: their two
    planes are joined into one hi-bit code before the one affine step (summed as two
    dequantized float16 planes, they were rounded twice)."""
    cache = kitty(2, 4, 0.25, 32)
    k, v = (x.astype(mx.float16) for x in keys_values(1, 2, 256, 64, seed=9))
    cache.update_and_fetch(k, v)
    cache.attend(k, k, v, scale=0.125, mask="causal")
    keys = cache.store.keys
    assert keys.up.buffer is not None
    k16, k32 = keys.decode(mx.float16), keys.decode(mx.float32)
    assert mx.array_equal(k16, k32.astype(mx.float16))
