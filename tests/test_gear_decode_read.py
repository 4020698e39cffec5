"""GEAR's decode read (issue 30): one part (the compressed chunks, then the buffer, under
one softmax); on a GPU's pure path the outliers written into the dequantized backbone and
the low-rank term read along the query rows, from views kept between flushes. Over 40
decode steps with chunk flushes among them it gives what attention over the reconstructed
history gives, to float32 reassociation, on the CPU's path and the GPU's."""

import mlx.core as mx
import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import GEAROptions
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods.gear import GEARCache

EPS = float(mx.finfo(mx.float32).eps)


def gear(window, **options):
    return GEARCache(KVCacheConfig(method="gear", options=GEAROptions(**options), residual_window=window), None, 0)


def keys_values(b, h, t, d, seed):
    k = mx.random.normal((b, h, t, d), key=mx.random.key(seed)) * (1 + 6 * (mx.arange(d) % 9 == 0))
    v = mx.random.normal((b, h, t, d), key=mx.random.key(seed + 1))
    return k, v


def reassociation_bound(q, k_hat, v_hat, scale, terms: int):
    """What float32 reassociation may move one output by: each score a sum of D products
    (plus the terms' few sums, ``terms`` times that at most), moved by at most D eps times
    the sum of their magnitudes, which moves every softmax weight by a relative 2 max|ds|;
    the mix a sum of T products (T eps max|v|). Twice that, for the steps around them."""
    b, hq, _, d = q.shape
    h = k_hat.shape[1]
    qg = (q.reshape(b, h, hq // h, d) * scale).astype(mx.float32)
    magnitude = mx.abs(qg) @ mx.abs(k_hat).swapaxes(-1, -2)
    ds = terms * d * EPS * float(magnitude.max())
    vmax, t = float(mx.abs(v_hat).max()), k_hat.shape[2]
    return 2 * vmax * (2 * ds + terms * t * EPS)


SETTINGS = [
    (dict(gear_rank=None), 32),  # the energy rule, 1% outliers
    (dict(gear_rank=4, gear_sparse_fraction=0.1), 32),
    (dict(gear_rank=3, gear_sparse_fraction=0.0), 32),  # low rank alone
    (dict(gear_rank=0, gear_sparse_fraction=0.05), 32),  # outliers alone
    (dict(gear_rank=2, gear_bits=4, gear_quantize_values=False), 32),
]


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, the GPU's
@pytest.mark.parametrize("options, window", SETTINGS)
def test_forty_decode_steps_match_attention_over_the_reconstructed_history(options, window, pure_path,
                                                                           monkeypatch):
    forty_steps_against_the_reconstruction(options, window, pure_path, monkeypatch)


@pytest.mark.parametrize("options, window", SETTINGS)
def test_on_cuda_the_rebuilt_rows_and_one_fused_attention_give_the_float32_read(options, window, monkeypatch):
    """On CUDA a step reads the runs' rows rebuilt (the backbone dequantized, the outliers
    written in, the low-rank term added per group) and the buffer through one
    ``scaled_dot_product_attention``: the same bound, one fused attention a step."""
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    from sdpa_calls import one_row, recorded

    calls = recorded(monkeypatch)
    steps = forty_steps_against_the_reconstruction(options, window, "reference", monkeypatch)
    assert len(one_row(calls)) == 2 * steps  # the read's and the test's reference's


def forty_steps_against_the_reconstruction(options, window, pure_path, monkeypatch) -> int:
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    b, h, gqa, d, t0, steps = 2, 2, 2, 64, 150, 40
    keys, values = keys_values(b, h, t0 + steps, d, seed=7 + len(options))
    cache, scale = gear(window, gear_group_size=32, **options), d**-0.5
    cache.update_and_fetch(keys[:, :, :t0], values[:, :, :t0])
    q0 = mx.random.normal((b, h * gqa, t0, d), key=mx.random.key(3))
    cache.attend(q0, keys[:, :, :t0], values[:, :, :t0], scale=scale, mask="causal")
    flushed = set()
    for i in range(t0, t0 + steps):
        k, v = keys[:, :, i : i + 1], values[:, :, i : i + 1]
        q = mx.random.normal((b, h * gqa, 1, d), key=mx.random.key(100 + i))
        cache.update_and_fetch(k, v)
        out = cache.attend(q, k, v, scale=scale, mask=None)
        flushed.add(cache.store.keys.count)
        k_hat, v_hat = cache.dequantized(mx.float32)
        assert k_hat.shape[2] == i + 1
        ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=scale)
        err, bound = float(mx.abs(out - ref).max()), reassociation_bound(q, k_hat, v_hat, scale, terms=3)
        assert err <= bound, (i, err, bound)
    assert len(flushed) > 1  # the steps crossed chunk flushes
    return steps


def test_the_pure_reads_views_are_kept_between_flushes(monkeypatch):
    """A step after the first after a flush builds no view: the same objects are read."""
    monkeypatch.setattr(kd, "_pure_path", lambda: "reference")
    keys, values = keys_values(1, 2, 200, 64, seed=5)
    cache, scale = gear(32, gear_group_size=32, gear_rank=2, gear_sparse_fraction=0.05), 64**-0.5
    cache.update_and_fetch(keys[:, :, :150], values[:, :, :150])
    cache.attend(mx.zeros((1, 4, 150, 64)), keys[:, :, :150], values[:, :, :150], scale=scale, mask="causal")
    seen = []
    for i in range(150, 154):
        cache.update_and_fetch(keys[:, :, i : i + 1], values[:, :, i : i + 1])
        mx.eval(cache.attend(mx.ones((1, 4, 1, 64)), keys[:, :, i : i + 1], values[:, :, i : i + 1],
                             scale=scale, mask=None))
        seen.append(cache.store.read_views(2))
    assert all(x is seen[0] for x in seen)


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, the GPU's
@pytest.mark.parametrize("options", [dict(gear_rank=None), dict(gear_rank=2, gear_sparse_fraction=0.05),
                                     dict(gear_rank=2, gear_bits=4, gear_quantize_values=False)])
def test_the_kept_step_plan_gives_the_joint_parts_read_bit_for_bit(options, pure_path, monkeypatch):
    """``GEARStore._step`` (the compiled passes and their inputs, or the pure path's views,
    kept between flushes) against ``decode_attention`` over a ``JointRead`` part built anew
    at each step, over 40 steps with chunk flushes among them: equal bit for bit."""
    if pure_path == "qmm" and mx.default_device() != mx.cpu:
        # a GPU reads the reference path; forced onto MLX's CUDA quantized_matmul, the two
        # reads differed in the last bit from step 150 on (benchmarks/results/h200_s66)
        pytest.skip("quantized_matmul is the CPU's path only")
    if kd.gpu_backend() == "cuda":  # the steps take the CUDA read (results/h200_s67), tested on its own
        pytest.skip("on CUDA a step reads _decoded_attention, not the kept plan")
    from veloxquant_mlx.kernels.decode import decode_attention
    from veloxquant_mlx.methods.gear.joint import JointRead
    from veloxquant_mlx.quant.store import absent_buffer

    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    b, h, gqa, d, t0, steps = 2, 2, 2, 64, 150, 40
    keys, values = keys_values(b, h, t0 + steps, d, seed=11)
    cache, scale = gear(32, gear_group_size=32, **options), d**-0.5
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
        ref = decode_attention(q, [JointRead(store, absent_buffer(q.dtype)).part()], scale=scale,
                               use_kernel=True, n_kv_heads=h)
        assert mx.array_equal(out, ref).item(), i
        counts.add(store.keys.count)
    assert len(counts) > 1  # the steps crossed a flush


def test_cuda_read_rebuilds_a_layers_rows_only_once_its_queries_exist(monkeypatch):
    """The kept codes and factors are ready before a step runs: unless each layer's rebuild
    waits for its queries, MLX rebuilds later layers' rows while this layer's are still
    held. Gated, at most the next layer's rebuild overlaps this layer's attention: from 1 to
    4 chained layers the step's peak grows by about one layer's rows at most (5.8 MiB of 8
    in a process of its own); ungated by more than three layers' (29)."""
    from chained_layers import layer_rows, peak_growth

    monkeypatch.setattr(kd, "_pure_path", lambda: "reference")
    make = lambda: GEARCache(KVCacheConfig(method="gear"), None, 0)  # noqa: E731  (defaults)
    assert peak_growth(make, 1, 4, monkeypatch) < 1.5 * layer_rows()
