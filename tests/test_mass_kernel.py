"""The prompt-mass kernels (``evict/mass_kernel.py``): their CUDA source run on the CPU by
emulation against the MLX block they replace (masked, per-head positions, none; float32 and
float16 logits; rows split over several shares), ``reference_mass`` against
``attention.attention_mass`` itself, and the dispatch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.evict import attention
from veloxquant_mlx.evict import mass_kernel as mk
from veloxquant_mlx.kernels import kivi_decode as kd


def emulate(case, workdir) -> np.ndarray:
    """Both launches of ``block_mass`` emulated, the second fed the first's output."""
    from test_kernel_kivi_decode import emulate_kernel_args

    rows, columns, _ = mk.launch_args(*case)
    lse = emulate_kernel_args(mk.ROWS_CUDA, mk._ROWS_IN, rows, ("lse",), workdir)["lse"]
    columns["inputs"][1] = mx.array(lse)
    partial = emulate_kernel_args(mk.COLUMNS_CUDA, mk._COLUMNS_IN, columns, ("partial",), workdir)["partial"]
    b, h, _, n = case[0].shape
    return partial.sum(axis=0).reshape(b, h, n), lse


@pytest.mark.parametrize("masked, per_head, dtype, m", [
    (True, False, mx.float32, 5),    # H2O's chunk: causal positions shared by the heads, padding slots
    (True, True, mx.float32, 5),     # positions per KV head (a store's slots)
    (False, False, mx.float32, 5),   # every key visible
    (True, False, mx.float16, 5),    # logits in the keys' dtype
    (True, False, mx.float32, 40),   # 80 rows a head: the columns split over shares
])
def test_the_cuda_source_gives_the_mlx_blocks_masses(tmp_path, masked, per_head, dtype, m):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):
        case = mk.check_case(dtype, masked, per_head, m=m)
        splits = mk.launch_args(*case)[2]
        assert (splits > 1) == (m == 40)
        got, lse = emulate(case, str(tmp_path))
        ref = mk.reference_mass(*case)
        assert got.shape == ref.shape
        assert mk.within_check_tolerance(mx.array(got), ref), np.abs(got - np.array(ref)).max()
        if masked:  # padding keys get nothing; every row sees its own key, so its lse is finite
            assert np.all(got[np.array(case[2]) < 0] == 0) and np.isfinite(lse).all()


def test_a_row_that_sees_no_key_adds_nothing(tmp_path):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):
        logits, q_pos, k_pos, w = mk.check_case(mx.float32)
        k_pos = mx.where(mx.arange(k_pos.shape[-1]) < 200, -1, k_pos)  # the first query heads' rows
        q_pos = mx.full(q_pos.shape, 150, mx.int32)  # see only keys before 150: all padding
        got, lse = emulate((logits, q_pos, k_pos, w), str(tmp_path))
        assert np.all(np.isinf(lse)) and np.all(got == 0)


def prompt_chunk(hkv: int, g: int, m: int, n: int, d: int, decay: float, seed: int):
    """Queries (1, hkv g, m, d) at the last m of n causal positions, keys (1, hkv, n, d),
    their positions and decaying query weights."""
    q = mx.random.normal((1, hkv * g, m, d), key=mx.random.key(seed))
    k = mx.random.normal((1, hkv, n, d), key=mx.random.key(seed + 1))
    q_pos = mx.arange(n - m, n, dtype=mx.int32)
    k_pos = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (1, hkv, n))
    return q, k, q_pos, k_pos, decay ** mx.arange(m, dtype=mx.float32)


def test_reference_mass_is_attention_masss_block():
    """``reference_mass`` is the block ``attention_mass`` sums, so the self-check and the
    emulation hold the kernels to what the scores were."""
    b, hkv, g, m, n, d = 1, 2, 3, 6, 40, 16
    q, k, q_pos, k_pos, w = prompt_chunk(hkv, g, m, n, d, 0.8, seed=1)
    ref = attention.attention_mass(q, k, 0.25, q_pos, k_pos, w)
    logits = ((q.reshape(b, hkv, g * m, d) * 0.25) @ k.swapaxes(-1, -2))
    assert mx.allclose(mk.reference_mass(logits, q_pos, k_pos, w / g), ref, rtol=1e-6, atol=1e-7)


def test_splits_fill_the_gpu_and_keep_eight_rows_a_share():
    assert mk.splits_for(256, 4096, 8) == 8  # 128 blocks of keys -> 8 shares of 32 rows
    assert mk.splits_for(20, 4096, 8) == 2   # at least 8 rows a share
    assert mk.splits_for(1024, 32768, 8) == 1  # 1,024 blocks of keys already


def test_a_test_that_takes_a_gpus_paths_on_the_cpu_gets_mlxs_ops(monkeypatch):
    if kd._gpu_kind() is not None:
        pytest.skip("a GPU back-end is here: its kernels run, there is no stand-in to test")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(mk, "_CHECKED", {})
    assert mk.kernel_backend(mx.float32) is None and mk._CHECKED == {}


def test_attention_mass_takes_the_kernels_where_they_run(monkeypatch):
    """On a GPU whose kernels passed their check, each block's mass comes from ``block_mass``
    with the block's logits, positions and weights (a stand-in here that computes the
    reference): the same masses as MLX's ops."""
    calls = []

    def stand_in(backend, logits, q_positions, k_positions, weights):
        calls.append((backend, logits.shape, weights.shape))
        return mk.reference_mass(logits, q_positions, k_positions, weights)

    q, k, q_pos, k_pos, w = prompt_chunk(hkv=2, g=2, m=9, n=50, d=16, decay=0.9, seed=3)
    ref = attention.attention_mass(q, k, 0.25, q_pos, k_pos, w)
    monkeypatch.setattr(mk, "kernel_backend", lambda dtype: "cuda")
    monkeypatch.setattr(mk, "block_mass", stand_in)
    # the kernels' blocks hold SCORE_ELEMENTS logits, as MLX's ops' do (larger ones raised a
    # CUDA prefill's peak past mlx-lm's KVCache's): 4 query heads x 50 keys = 200 a query,
    # so 400 of them make blocks of 2 queries, 4 rows a KV head
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 400)
    got = attention.attention_mass(q, k, 0.25, q_pos, k_pos, w)
    assert [c[1][2] for c in calls] == [4, 4, 4, 4, 2] and all(c[0] == "cuda" for c in calls)
    assert mx.allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_on_a_gpu_the_kernels_give_the_mlx_blocks_masses():
    if kd.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU here: the kernels run on a GPU only (their CUDA source is "
                    "emulated above)")
    for dtype in (mx.float32, mx.float16):
        assert mk.kernel_checked(kd.gpu_backend(), dtype), mk._CHECKED
        for masked, per_head, m in ((True, False, 40), (True, True, 5), (False, False, 64)):
            case = mk.check_case(dtype, masked, per_head, m=m, n=3000)
            assert mk.within_check_tolerance(mk.block_mass(kd.gpu_backend(), *case), mk.reference_mass(*case))
