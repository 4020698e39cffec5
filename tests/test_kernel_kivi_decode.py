"""Fused KIVI decode attention (veloxquant/kernels/kivi_decode.py).

CPU (CI) checks the two pure-mlx paths; the CUDA and Metal kernels run only where their
back-end exists and are skipped, with the reason printed, elsewhere (their check poisons
the outputs with NaN through benchmarks/kernels_extra.py). The dispatched CUDA sources
are also executed on the CPU through a C++ emulation (each CUDA thread a std::thread),
which checks their indexing and synchronisation without a GPU, with the runtime's own
launch arguments. What only the benchmarks run (the mma kernel, sweep variants) is tested
in tests/test_benchmarks_kernels_extra.py, with the helpers of this module.

Tolerances, from the arithmetic:
* Every path computes in float32 on the same dequantized values (scale * code + bias is
  exact up to one float32 rounding), so two paths differ by float32 summation order:
  about sqrt(n) * 2**-24 relative for n-term sums, under 1e-5 for the sizes here.
* The output is rounded to the query dtype once. Two float32 results a hair apart can
  round to neighbouring values: at most one ulp = 2 u per element (u = unit roundoff,
  2**-11 float16, 2**-8 bfloat16, 2**-24 float32), so the relative norm error between
  two paths is at most 2 u + 1e-5, and 1 u + 1e-5 against an unrounded float64 result.
"""

from __future__ import annotations

import atexit
import importlib.util
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

import mlx.core as mx

from veloxquant_mlx.kernels import kivi_decode as kd

UNIT_ROUNDOFF = {mx.float16: 2.0**-11, mx.bfloat16: 2.0**-8, mx.float32: 2.0**-24}
SUM_EPS = 1e-5
ROOT = Path(__file__).resolve().parent.parent


def bench_kernels():
    """benchmarks/kernels_extra.py (its own copy of the kernels package, "vq_kernels", as on
    the device machines): the mma kernel and the check and sweep knobs."""
    name = "vq_bench_kernels_extra"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, ROOT / "benchmarks" / "kernels_extra.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _rel(a, b) -> float:
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _f32(x) -> np.ndarray:
    return np.array(x.astype(mx.float32))


def make_case(B=1, H=2, R=4, D=128, bits=4, G=32, n_kq=256, n_kres=17, n_vres=40,
              dtype=mx.float16, spare_groups=2, seed=0):
    """A KIVI-layout cache with spare capacity everywhere (NaN scales and residual rows,
    random codes), so that any read past the valid part shows up as NaN or garbage.
    Returns (args tuple for the attention functions, unquantized K, unquantized V)."""
    mx.random.seed(seed)
    T = n_kq + n_kres
    n_vq = T - n_vres
    P = 32 // bits
    nan = float("nan")
    # keys with per-channel magnitudes (the outlier channels KIVI is built for)
    K = (mx.random.normal((B, H, T, D)) * (0.5 + 3 * mx.random.uniform(shape=(1, H, 1, D))))
    V = mx.random.normal((B, H, T, D))
    K, V = K.astype(dtype), V.astype(dtype)
    q = mx.random.normal((B, H * R, 1, D)).astype(dtype)

    if n_kq:
        kc, ks, kb = mx.quantize(K[:, :, :n_kq].transpose(0, 1, 3, 2), group_size=G, bits=bits)
    else:
        kc = mx.zeros((B, H, D, 0), mx.uint32)
        ks = kb = mx.zeros((B, H, D, 0), dtype)
    extra = spare_groups * G
    kc = mx.concatenate(
        [kc, mx.random.randint(0, 2**31 - 1, (B, H, D, extra // P)).astype(mx.uint32)], -1)
    ks = mx.concatenate([ks, mx.full((B, H, D, spare_groups), nan, dtype)], -1)
    kb = mx.concatenate([kb, mx.full((B, H, D, spare_groups), nan, dtype)], -1)

    if n_vq:
        vc, vs, vb = mx.quantize(V[:, :, :n_vq], group_size=G, bits=bits)
    else:
        vc = mx.zeros((B, H, 0, D // P), mx.uint32)
        vs = vb = mx.zeros((B, H, 0, D // G), dtype)
    vc = mx.concatenate(
        [vc, mx.random.randint(0, 2**31 - 1, (B, H, 3, D // P)).astype(mx.uint32)], 2)
    vs = mx.concatenate([vs, mx.full((B, H, 3, D // G), nan, dtype)], 2)
    vb = mx.concatenate([vb, mx.full((B, H, 3, D // G), nan, dtype)], 2)
    kr = mx.concatenate([K[:, :, n_kq:], mx.full((B, H, 5, D), nan, dtype)], 2)
    vr = mx.concatenate([V[:, :, n_vq:], mx.full((B, H, 7, D), nan, dtype)], 2)
    mx.eval(q, kc, ks, kb, kr, vc, vs, vb, vr, K, V)
    return (q, kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres), K, V


def _kw(D, bits, G):
    return dict(scale=D**-0.5, bits=bits, group_size=G)


def _numpy_reference(args, scale, bits, G):
    """Independent float64 dequantize + attention from the raw packed arrays."""
    q, kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres = args
    B, Hq, _, D = q.shape
    P = 32 // bits
    mask = (1 << bits) - 1

    def unpack(w):  # (..., W) uint32 -> (..., W * P) codes, code j of a word at bits j*b
        w = np.asarray(w).astype(np.uint64)
        sh = (np.arange(P, dtype=np.uint64) * bits)
        return ((w[..., None] >> sh) & mask).reshape(*w.shape[:-1], -1).astype(np.float64)

    Ks = []
    if n_kq:
        c = unpack(np.array(kc)[..., : n_kq // P])  # (B,H,D,n_kq)
        s = np.repeat(_f32(ks)[..., : n_kq // G].astype(np.float64), G, -1)
        b = np.repeat(_f32(kb)[..., : n_kq // G].astype(np.float64), G, -1)
        Ks.append(np.swapaxes(s * c + b, -1, -2))
    if n_kres:
        Ks.append(_f32(kr)[:, :, :n_kres].astype(np.float64))
    Vs = []
    if n_vq:
        c = unpack(np.array(vc)[:, :, :n_vq])
        s = np.repeat(_f32(vs)[:, :, :n_vq].astype(np.float64), G, -1)
        b = np.repeat(_f32(vb)[:, :, :n_vq].astype(np.float64), G, -1)
        Vs.append(s * c + b)
    if n_vres:
        Vs.append(_f32(vr)[:, :, :n_vres].astype(np.float64))
    Kf = np.concatenate(Ks, 2)
    Vf = np.concatenate(Vs, 2)
    H = Kf.shape[1]
    R = Hq // H
    out = np.zeros((B, Hq, 1, D))
    qf = _f32(q).astype(np.float64)
    for hq in range(Hq):
        h = hq // R
        s = np.einsum("bd,btd->bt", qf[:, hq, 0], Kf[:, h]) * scale
        s = s - s.max(-1, keepdims=True)
        p = np.exp(s)
        p /= p.sum(-1, keepdims=True)
        out[:, hq, 0] = np.einsum("bt,btd->bd", p, Vf[:, h])
    return out


# ----------------------------------------------------------------------------------
# layout and the reference
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits,G", list(itertools.product((2, 4, 8), (32, 64, 128))))
def test_unpacking_matches_mx_dequantize(bits, G):
    w = mx.random.normal((2, 3, 128, 256))
    codes, s, b = mx.quantize(w, group_size=G, bits=bits)
    mine = kd._dequant_values_f32(codes, s, b, 128, bits, G)
    theirs = mx.dequantize(codes, s, b, group_size=G, bits=bits)
    np.testing.assert_allclose(np.array(mine), np.array(theirs), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "R,bits,G,n_kq,n_kres,n_vres,dtype",
    [
        (1, 4, 32, 256, 17, 40, mx.float32),
        (4, 2, 64, 192, 0, 1, mx.float16),
        (8, 8, 128, 384, 127, 128, mx.bfloat16),
        (4, 4, 32, 0, 45, 45, mx.float32),
    ],
)
def test_reference_matches_float64(R, bits, G, n_kq, n_kres, n_vres, dtype):
    args, _, _ = make_case(R=R, bits=bits, G=G, n_kq=n_kq, n_kres=n_kres, n_vres=n_vres,
                           dtype=dtype)
    kw = _kw(128, bits, G)
    out = kd.kivi_decode_attention_reference(*args, **kw)
    assert out.shape == args[0].shape and out.dtype == dtype
    ref = _numpy_reference(args, kw["scale"], bits, G)
    assert _rel(_f32(out), ref) <= UNIT_ROUNDOFF[dtype] + SUM_EPS


def test_reference_tracks_unquantized_attention():
    """At 8 bits the cache is nearly lossless: the output must match plain attention on
    the original K/V, which pins the logical token order (quantized, then residual, with
    different key and value split points) and the GQA head mapping."""
    B, H, R, D = 2, 2, 4, 128
    args, K, V = make_case(B=B, H=H, R=R, bits=8, G=32, n_kq=320, n_kres=50, n_vres=128,
                           dtype=mx.float32)
    q = args[0]
    out = kd.kivi_decode_attention_reference(*args, **_kw(D, 8, 32))
    Kr = mx.repeat(K, R, axis=1)
    Vr = mx.repeat(V, R, axis=1)
    exact = mx.fast.scaled_dot_product_attention(q, Kr, Vr, scale=D**-0.5)
    assert _rel(_f32(out), _f32(exact)) < 0.02
    # the check is sensitive to order: values shifted by one token are far off
    shifted = mx.fast.scaled_dot_product_attention(q, Kr, mx.roll(Vr, 1, axis=2),
                                                   scale=D**-0.5)
    assert _rel(_f32(shifted), _f32(exact)) > 0.1


# ----------------------------------------------------------------------------------
# the quantized_matmul path against the reference
# ----------------------------------------------------------------------------------

_RESIDUALS = [(0, 0), (17, 40), (31, 128), (100, 1), (0, 77), (63, 0)]
_DTYPES = [mx.float16, mx.float32, mx.bfloat16]
_GRID = list(itertools.product((2, 4, 8), (32, 64, 128), (1, 4, 8)))


@pytest.mark.parametrize("bits,G,R", _GRID)
def test_qmm_path_matches_reference(bits, G, R):
    i = _GRID.index((bits, G, R))
    n_kres, n_vres = _RESIDUALS[i % len(_RESIDUALS)]
    dtype = _DTYPES[i % len(_DTYPES)]
    n_kq = G * (1 + (i % 5))  # 1..5 groups
    args, _, _ = make_case(B=1 + i % 2, H=2, R=R, bits=bits, G=G, n_kq=n_kq,
                           n_kres=n_kres, n_vres=min(n_vres, n_kq + n_kres), dtype=dtype,
                           seed=i)
    kw = _kw(128, bits, G)
    ref = kd.kivi_decode_attention_reference(*args, **kw)
    out = kd.kivi_decode_attention_qmm(*args, **kw)
    assert out.shape == ref.shape and out.dtype == dtype
    assert np.isfinite(_f32(out)).all()
    assert _rel(_f32(out), _f32(ref)) <= 2 * UNIT_ROUNDOFF[dtype] + SUM_EPS


@pytest.mark.parametrize(
    "n_kq,n_kres,n_vres",
    [(0, 70, 70), (256, 0, 0), (256, 0, 256), (0, 1, 1), (128, 129, 5)],
    ids=["all-residual", "no-residual", "values-all-residual", "one-token", "long-residual"],
)
def test_edge_splits(n_kq, n_kres, n_vres):
    args, _, _ = make_case(R=4, bits=4, G=64, n_kq=n_kq, n_kres=n_kres, n_vres=n_vres,
                           dtype=mx.float32)
    kw = _kw(128, 4, 64)
    ref = kd.kivi_decode_attention_reference(*args, **kw)
    np64 = _numpy_reference(args, kw["scale"], 4, 64)
    assert _rel(_f32(ref), np64) <= UNIT_ROUNDOFF[mx.float32] + SUM_EPS
    out = kd.kivi_decode_attention_qmm(*args, **kw)
    assert _rel(_f32(out), _f32(ref)) <= 2 * UNIT_ROUNDOFF[mx.float32] + SUM_EPS


def test_dispatcher_on_cpu_uses_the_default_pure_path():
    args, _, _ = make_case(R=4, bits=4, G=32, n_kq=256, n_kres=9, n_vres=30)
    kw = _kw(128, 4, 32)
    assert kd.CPU_DEFAULT_PATH in ("qmm", "reference")
    with mx.stream(mx.cpu):
        out = kd.kivi_decode_attention(*args, **kw)
        off = kd.kivi_decode_attention(*args, **kw, use_kernel=False)
    path = (kd.kivi_decode_attention_qmm if kd.CPU_DEFAULT_PATH == "qmm"
            else kd.kivi_decode_attention_reference)
    np.testing.assert_array_equal(_f32(out), _f32(path(*args, **kw)))
    np.testing.assert_array_equal(_f32(out), _f32(off))


def test_empty_placeholder_buffers_are_accepted():
    """The cache passes 1-D empty arrays for parts it has not created yet."""
    args, _, _ = make_case(R=2, bits=4, G=32, n_kq=0, n_kres=20, n_vres=20)
    empty = mx.zeros((0,), mx.float16)
    a = list(args)
    a[1] = a[2] = a[3] = empty
    a[7] = a[8] = a[9] = empty
    kw = _kw(128, 4, 32)
    ref = kd.kivi_decode_attention_reference(*args, **kw)
    for fn in (kd.kivi_decode_attention_reference, kd.kivi_decode_attention_qmm,
               kd.kivi_decode_attention):
        np.testing.assert_allclose(_f32(fn(*a, **kw)), _f32(ref), rtol=2e-3, atol=2e-3)


def test_invalid_layouts_are_rejected():
    args, _, _ = make_case(R=4, bits=4, G=32, n_kq=64, n_kres=3, n_vres=10)
    kw = _kw(128, 4, 32)
    a = list(args)
    a[12] += 1  # n_vres: counts no longer agree
    with pytest.raises(ValueError, match="must equal"):
        kd.kivi_decode_attention_reference(*a, **kw)
    a = list(args)
    a[4] = 48  # n_kq not a multiple of the group
    a[6] = args[6] + 16
    with pytest.raises(ValueError, match="multiple of group_size"):
        kd.kivi_decode_attention_qmm(*a, **kw)
    with pytest.raises(ValueError, match="bits"):
        kd.kivi_decode_attention_reference(*args, scale=1.0, bits=3, group_size=32)


def test_frag_kernel_support_and_dispatch():
    """frag handles float16 caches with head_dim 64 or 128 (its buffers fit in 48 KB of
    static shared memory for every bit width, group and GQA ratio); the dispatcher picks
    it at every width (checked on the H200 at 2 bits too: benchmarks/results/frag_2bit.md),
    simt for other dtypes."""
    for bits, G, R in _GRID:
        assert kd.kernel_supports(128, R, bits, G, mx.float16, algo="frag")
        assert kd._frag_shared_bytes(128, R, bits, G) <= 48 * 1024
        assert kd.default_algo(128, R, bits, G, mx.float16) == "frag"
        assert kd.default_algo(128, R, bits, G, mx.bfloat16) == "simt"
    assert not kd.kernel_supports(128, 4, 4, 64, mx.bfloat16, algo="frag")
    assert not kd.kernel_supports(256, 4, 4, 64, mx.float16, algo="frag")
    assert not kd.kernel_supports(64, 4, 2, 64, mx.float16, algo="frag")  # 2-bit tile: 128 ch


@pytest.mark.parametrize("n_kq,n_vq,T,BH,bits", [
    (32704, 32640, 32768, 64, 4),   # KIVI at 32k, batch 8: 128-token tail
    (32704, 32640, 32768, 8, 4),
    (4096, 4000, 4130, 2, 8),       # values' quantized part ends mid-tile
    (0, 0, 70, 4, 2),               # residual only: every token in the tail
    (256, 512, 600, 1, 2),          # keys' quantized part is the shorter
])
def test_frag_plan_covers_every_token_once(n_kq, n_vq, T, BH, bits):
    """Tiles cover [0, t_fast) where keys and values are both quantized, tail chunks the
    rest, every chunk owned by a block; the blocks get the whole split target (tail blocks
    once took it: one tile block per kv head at batch 8) and never more (a block over it
    waits for a second wave: +35% at batch 8 on the H200); the tail chunks get blocks of
    their own only where those fit in the target too."""
    tt = 8 * (32 // bits)
    target = kd.frag_target_blocks(BH)
    t_fast, ns_tail, ns, tps, tail0 = kd._frag_plan(n_kq, n_vq, T, BH, bits, target)
    assert t_fast % tt == 0 and t_fast <= min(n_kq, n_vq) < t_fast + tt
    n_tiles = t_fast // tt
    assert (ns_tail - 1) * kd.FRAG_TAIL < T - t_fast <= ns_tail * kd.FRAG_TAIL
    assert ns - tail0 >= min(ns_tail, 1)  # blocks that take chunks, if there are any
    if n_tiles:
        tile_blocks = -(-n_tiles // tps)
        assert tile_blocks * tps >= n_tiles and (tile_blocks - 1) * tps < n_tiles
        assert tail0 in (0, tile_blocks) and ns == tile_blocks + (ns_tail if tail0 else 0)
        assert ns * BH <= max(target, BH)
        assert tps <= -(-n_tiles // min(n_tiles, max(1, target // BH)))
        assert tail0 or (tile_blocks + ns_tail) * BH > target
    else:
        assert ns == max(ns_tail, 1) and tail0 == 0


def test_short_contexts_at_a_measured_width_take_the_short_split_target(monkeypatch):
    """Up to FRAG_SHORT_TOKENS at 4 bits below FRAG_MANY_HEADS kv heads, the short target
    (notes/decode_kernels.md: 99 blocks, 38.1 -> 27.7 us at 4k on the H200); past it, at
    an unmeasured width or with many heads, the wave targets. Its plans still cover every
    token once."""
    assert kd.frag_target_blocks(8, 4096, 4) == kd.FRAG_TARGET_BLOCKS_SHORT[4]
    assert kd.frag_target_blocks(8, 4097, 4) == kd.FRAG_TARGET_BLOCKS
    assert kd.frag_target_blocks(8, 4096, 2) == kd.FRAG_TARGET_BLOCKS
    assert kd.frag_target_blocks(64, 1024, 4) == kd.FRAG_TARGET_BLOCKS_MANY_HEADS
    monkeypatch.setattr(kd, "frag_target_blocks", lambda BH: kd.FRAG_TARGET_BLOCKS_SHORT[4])
    for n_kq, n_vq, t, bh in ((4032, 3968, 4096, 8), (960, 896, 1024, 8), (4032, 3968, 4096, 24)):
        test_frag_plan_covers_every_token_once(n_kq, n_vq, t, bh, 4)


@pytest.mark.parametrize("BH", [1, 8, 31, 32, 64, 512])
def test_frag_split_target_fits_one_wave_of_its_launch_bounds(BH):
    """The plan's one wave must fit the blocks the launch bounds keep resident on the
    H200's 132 SMs (528 blocks with bounds 4 from 32 kv heads, 792 with 6 below): a target
    above it would put blocks in a second wave; the tail chunks' own blocks count too."""
    assert kd.frag_target_blocks(BH) <= 132 * kd.frag_launch_bounds(BH)
    for T in (4096, 32768, 131072):
        ns = kd._frag_launch_args(mx.float16, 128, 4, 4, 64, 4, T - 64, 64, T - 128, 128, BH,
                                  0.1, kd.frag_target_blocks(BH))[0]
        assert ns * BH <= max(132 * kd.frag_launch_bounds(BH), BH)


def test_frag_keeps_offsets_only_where_a_block_sums_few_tiles():
    """KEEP's error grows with the tiles a warp sums (1.6e-4 at 128 a warp on the H200 with
    KEEP 1): past FRAG_KEEP_MAX_TILES a block, the launch takes exact codes (KEEP 0)."""
    def keep_and_tiles(T, BH):
        ns, params, template, _, _ = kd._frag_launch_args(
            mx.float16, 128, 4, 4, 64, 4, T - 64, 64, T - 128, 128, BH, 0.1,
            kd.frag_target_blocks(BH))
        return dict(template)["KEEP"], int(params[5].item())

    keep, tps = keep_and_tiles(131072, 64)   # batch 8 at 128k: 256 tiles a block
    assert tps <= kd.FRAG_KEEP_MAX_TILES and keep == kd.FRAG_KEEP_OFFSET
    keep, tps = keep_and_tiles(262144, 64)   # 256k: 512 tiles a block
    assert tps > kd.FRAG_KEEP_MAX_TILES and keep == 0


def test_frag_tail_goes_first_only_in_the_tile_blocks():
    """TAIL_FIRST where tail chunks share a block with tiles (batch 8: no blocks of their
    own fit in the wave), not where they have blocks of their own or there is no tile."""
    def plan(n_kq, n_kres, n_vq, n_vres, BH):
        _, _, template, tail0, ns_tail = kd._frag_launch_args(
            mx.float16, 128, 4, 4, 64, 4, n_kq, n_kres, n_vq, n_vres, BH, 0.1,
            kd.frag_target_blocks(BH))
        return dict(template)["TAIL_FIRST"], tail0, ns_tail

    T = 32768
    assert plan(T - 64, 64, T - 128, 128, 64) == (True, 0, 8)   # batch 8: 128 tail tokens
    first, tail0, ns_tail = plan(T - 64, 64, T - 128, 128, 8)    # batch 1
    assert not first and tail0 > 0 and ns_tail == 8
    assert plan(0, 100, 0, 100, 64) == (False, 0, 7)            # no tile: all tail


def test_kernel_support_matrix():
    for bits, G, R in _GRID:
        assert kd.kernel_supports(128, R, bits, G, mx.float16)
    assert not kd.kernel_supports(128, 16, 4, 64)   # GQA ratio above 8: pure path
    assert not kd.kernel_supports(96, 4, 4, 32)     # value tiling does not divide 128 threads
    assert not kd.kernel_supports(64, 4, 4, 128)    # group larger than head_dim
    with pytest.raises(ValueError, match="unknown kernel"):  # the benchmarks' mma included
        kd.kernel_supports(128, 4, 4, 64, mx.float16, algo="mma")


# ----------------------------------------------------------------------------------
# GPU kernels: run only where the back-end exists
# ----------------------------------------------------------------------------------


def _cuda_available() -> bool:
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False


def _metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except AttributeError:
        return False


_GPU_CASES = [
    # R, bits, G, n_kq, n_kres, n_vres, dtype, chunk, target_blocks
    (4, 4, 64, 4096, 37, 128, mx.float16, 256, 1024),
    (1, 2, 32, 1024, 0, 1, mx.float16, 128, 1024),
    (8, 8, 128, 2048, 127, 5, mx.bfloat16, 256, 1024),
    (4, 4, 32, 8192, 100, 128, mx.float32, 256, 4),    # many chunks per block
    (4, 2, 64, 0, 70, 70, mx.float16, 256, 1024),      # residual only
]


def _run_gpu_cases(backend, algos):
    """Kernel (every output poisoned with NaN first, through benchmarks/kernels_extra.py)
    against the float32 reference, which runs on the CPU: MLX's CUDA float32 matmuls use
    TF32 by default (MLX_ENABLE_TF32)."""
    kx = bench_kernels()
    old = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        for R, bits, G, n_kq, n_kres, n_vres, dtype, chunk, target in _GPU_CASES:
            args, _, _ = make_case(B=2, H=2, R=R, bits=bits, G=G, n_kq=n_kq, n_kres=n_kres,
                                   n_vres=n_vres, dtype=dtype)
            kw = _kw(128, bits, G)
            with mx.stream(mx.cpu):
                ref = _f32(kd.kivi_decode_attention_reference(args[0].astype(mx.float32),
                                                              *args[1:], **kw))
            for algo in algos:
                c = None if algo in ("folded", "frag") else chunk  # set by the bits
                if not kx.supports(128, R, bits, G, dtype, c, algo=algo):
                    continue
                # simt: float32 throughout; mma: float16 operands (~2^-11 each); frag with
                # codes keeping their float16 offset: float32 sums ~1024x the codes'
                tol = 1e-3 if algo == "mma" or (algo == "frag" and kd.FRAG_KEEP_OFFSET > 1) \
                    else 1e-4
                out = kx.attention(*args, **kw, backend=backend, chunk=c,
                                   target_blocks=target, out_dtype=mx.float32, poison=True,
                                   algo=algo)
                o = _f32(out)
                assert np.isfinite(o).all(), f"{algo}: outputs left unwritten (NaN poison)"
                assert _rel(o, ref) < tol, (algo, R, bits, G, dtype)
                nat = kx.attention(*args, **kw, backend=backend, chunk=c,
                                   target_blocks=target, algo=algo)
                assert nat.dtype == dtype
                assert _rel(_f32(nat), ref) <= UNIT_ROUNDOFF[dtype] + tol
                run = (kd.kivi_decode_attention_cuda(*args, **kw, algo=algo)
                       if backend == "cuda" else kd.kivi_decode_attention_metal(*args, **kw))
                assert _rel(_f32(run), ref) <= UNIT_ROUNDOFF[dtype] + tol
            disp = kd.kivi_decode_attention(*args, **kw)
            assert _rel(_f32(disp), ref) <= UNIT_ROUNDOFF[dtype] + 1e-3
    finally:
        mx.set_default_device(old)


def test_cuda_kernel_matches_reference():
    if not _cuda_available():
        pytest.skip("SKIPPED LOUDLY: MLX's CUDA back-end is not available here "
                    "(mx.cuda.is_available() is False); the fused CUDA kernel is NOT "
                    "exercised. Run benchmarks/fused_attention.py on an NVIDIA GPU.")
    _run_gpu_cases("cuda", ("simt", "folded", "frag"))


def test_metal_kernel_matches_reference():
    if not _metal_available():
        pytest.skip("SKIPPED LOUDLY: no Metal device (mx.metal.is_available() is False); "
                    "the Metal kernel, which has never run on hardware, is NOT exercised.")
    _run_gpu_cases("metal", ("simt",))


# ----------------------------------------------------------------------------------
# the CUDA source, executed on the CPU (indexing and barriers, no GPU needed)
# ----------------------------------------------------------------------------------

_EMU_PRELUDE = r"""
#include <algorithm>
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using std::max; using std::min;
typedef _Float16 __half;
struct __nv_bfloat16 { float v; };
static inline float __half2float(__half x) { return (float)x; }
static inline float __bfloat162float(__nv_bfloat16 x) { return x.v; }
static inline __half __float2half_rn(float x) { return (__half)x; }
static inline __nv_bfloat16 __float2bfloat16_rn(float x) { return {x}; }
static inline float __uint_as_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline float __int_as_float(int32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t __float_as_uint(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
struct D3 { int x, y, z; };
struct uint4 { uint32_t x, y, z, w; };
static inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
thread_local D3 threadIdx, blockIdx;
D3 gridDim;
using Shape = std::array<int32_t, 10>;
using Strides = std::array<int64_t, 10>;
std::barrier<>* g_bar;
std::vector<std::unique_ptr<std::barrier<>>> w_bar;
static float xbuf[1024];
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline void __syncwarp() { w_bar[threadIdx.x / 32]->arrive_and_wait(); }
static inline float __shfl_xor_sync(unsigned, float v, int off) {
  int t = threadIdx.x; xbuf[t] = v; w_bar[t / 32]->arrive_and_wait();
  float r = xbuf[t ^ off]; w_bar[t / 32]->arrive_and_wait(); return r;
}
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
static inline float2 make_float2(float x, float y) { return {x, y}; }
static inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
static inline uint32_t __byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  const uint64_t v = (uint64_t)x | ((uint64_t)y << 32); uint32_t r = 0;
  for (int n = 0; n < 4; ++n) r |= (uint32_t)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
  return r;
}
// cp.async as a plain copy: the kernels wait before they read, so a copy that completes
// at once is one of the orders the hardware may produce
template <int BYTES> static inline void vqk_cp_async(void* dst, const void* src) { memcpy(dst, src, BYTES); }
static inline void vqk_cp_commit() {}
template <int N> static inline void vqk_cp_wait() {}
static inline float __shfl_sync(unsigned, float v, int src) {
  int t = threadIdx.x; xbuf[t] = v; w_bar[t / 32]->arrive_and_wait();
  float r = xbuf[(t & ~31) + src]; w_bar[t / 32]->arrive_and_wait(); return r;
}
// tensor-core helpers, emulated: every lane posts its fragments, then computes its own
// accumulators from the whole warp's (PTX m16n8k16 .row.col layouts)
#define VQK_EMULATION 1
static inline uint32_t vqk_h2(float lo, float hi) {
  _Float16 l = (_Float16)lo, h = (_Float16)hi; uint16_t a, b;
  memcpy(&a, &l, 2); memcpy(&b, &h, 2); return (uint32_t)a | ((uint32_t)b << 16);
}
static inline float vqk_half(uint32_t r, int k, bool bf16 = false) {
  const uint16_t v = (uint16_t)(r >> (16 * k));
  if (bf16) { const uint32_t u = (uint32_t)v << 16; float f; memcpy(&f, &u, 4); return f; }  // a float32's top half
  _Float16 f; memcpy(&f, &v, 2); return (float)f;
}
static uint32_t xa[1024][4], xb[1024][2];
// the halves decoded as float16, or with BF16 as bfloat16 (fused_mass_kernel's vqm_mma)
template <bool BF16> static inline void vqm_mma(float* c, const uint32_t* a, const uint32_t* b) {
  const int t = threadIdx.x, w = t / 32, lane = t % 32, base = w * 32;
  for (int k = 0; k < 4; ++k) xa[t][k] = a[k];
  xb[t][0] = b[0]; xb[t][1] = b[1];
  w_bar[w]->arrive_and_wait();
  const int g = lane / 4, q = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + (e >= 2 ? 8 : 0), col = 2 * q + (e & 1);
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) {
      const float av = vqk_half(xa[base + (row % 8) * 4 + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)], k % 2, BF16);
      const float bv = vqk_half(xb[base + col * 4 + (k % 8) / 2][k >= 8], k % 2, BF16);
      sum += av * bv;
    }
    c[e] += sum;
  }
  w_bar[w]->arrive_and_wait();
}
static inline void vqk_mma(float* c, const uint32_t* a, const uint32_t* b) { vqm_mma<false>(c, a, b); }
template <class F> void launch(int gx, int gy, int nt, F f, bool together = true) {
  gridDim = {gx, gy, 1};
  for (int y = 0; y < gy; ++y) for (int x = 0; x < gx; ++x) {
    if (!together) {  // no barrier in the kernel: its threads one after another, in this one
      for (int t = 0; t < nt; ++t) { threadIdx = {t, 0, 0}; blockIdx = {x, y, 0}; f(); }
      continue;
    }
    std::barrier<> bar(nt); g_bar = &bar; w_bar.clear();
    for (int w = 0; w < (nt + 31) / 32; ++w) w_bar.emplace_back(new std::barrier<>(32));
    std::vector<std::thread> th;
    for (int t = 0; t < nt; ++t) th.emplace_back([&, t] { threadIdx = {t, 0, 0}; blockIdx = {x, y, 0}; f(); });
    for (auto& t : th) t.join();
  }
}
static std::vector<char> rd(const char* p) {
  FILE* f = fopen(p, "rb"); fseek(f, 0, SEEK_END); long n = ftell(f); fseek(f, 0, SEEK_SET);
  std::vector<char> v(n + 16); if (fread(v.data(), 1, n, f) != (size_t)n) {} fclose(f); return v;
}
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
"""

_CT = {"float16": "__half", "float32": "float", "uint32": "uint32_t", "int32": "int32_t", "uint8": "uint8_t",
       "uint16": "uint16_t"}


def _emu_function(name, source, inputs, outputs, template):
    """The function MLX's cuda_kernel would generate, as plain C++."""
    args = []
    for n, dt in inputs:
        args.append(f"const {_CT[dt]}* {n}")
        if n + "_shape" in source:
            args.append(f"const Shape {n}_shape")
        if n + "_strides" in source:
            args.append(f"const Strides {n}_strides")
    args += [f"{_CT[dt]}* {n}" for n, dt in outputs]
    body = "".join(f"  using {k} = {_CT[v]};\n" if isinstance(v, str)
                   else f"  constexpr bool {k} = {str(v).lower()};\n" if isinstance(v, bool)
                   else f"  constexpr int {k} = {v};\n" for k, v in template)
    return f"void {name}({', '.join(args)}) {{\n{body}{source}\n}}\n"


_NP = {"float32": np.float32, "uint32": np.uint32, "int32": np.int32, "float16": np.float16, "uint8": np.uint8,
       "uint16": np.uint16}


_WAITS = ("__syncthreads", "__syncwarp", "__shfl", "vqk_mma")  # what makes a block's threads wait for each other


def _strided(a: np.ndarray, dtype) -> tuple[np.ndarray, int, list[int]]:
    """A numpy view as MLX hands a strided input to a kernel that reads its strides: (the
    contiguous array it views, its first element's offset there, its strides in elements).
    An array that is not a view of one of ``dtype`` is copied: contiguous strides."""
    root = a
    while isinstance(root.base, np.ndarray):
        root = root.base
    if root.dtype != dtype or a.dtype != dtype or not root.flags.c_contiguous:
        root = a = np.ascontiguousarray(a, dtype)
    offset = a.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return root, offset // a.itemsize, [s // a.itemsize for s in a.strides]


def emulate_launch(source, inputs, outputs, template, blocks, threads, workdir, header=""):
    """One launch of a kernel's CUDA ``source`` as C++ threads on the CPU: ``inputs``
    [(name, dtype name, array)], ``outputs`` [(name, dtype name, size)] (filled with NaN,
    or all ones bits for integers, so that an unwritten entry shows), ``blocks`` (x, y)
    of ``threads`` each; the outputs as flat numpy arrays, by name."""
    src = _EMU_PRELUDE + header + _emu_function(
        "kmain", source, [(n, d) for n, d, _ in inputs], [(n, d) for n, d, _ in outputs], template)
    main, call = "int main() {\n", []
    for n, d, a in inputs:
        path = os.path.join(workdir, n + ".bin")
        if n + "_strides" in source:  # a numpy view stays one: its root's words, its offset and strides
            root, offset, strides = _strided(np.asarray(a), _NP[d])
            root.tofile(path)
        else:
            np.array(a).astype(_NP[d]).tofile(path)
        main += f'  auto b_{n} = rd("{path}");\n'
        call.append(f"(const {_CT[d]}*)b_{n}.data()")
        if n + "_strides" in source:
            call[-1] = f"((const {_CT[d]}*)b_{n}.data()) + {offset}"
        if n + "_shape" in source:
            call.append("Shape{" + ",".join(map(str, list(a.shape) + [0] * (10 - a.ndim))) + "}")
        if n + "_strides" in source:
            call.append("Strides{" + ",".join(map(str, strides + [0] * (10 - len(strides)))) + "}")
    for n, d, size in outputs:
        # an explicit conversion: GCC 13 takes _Float16 as C++23's extended floating type,
        # into which a float does not convert implicitly (vector's fill was ill-formed there)
        fill = f"static_cast<{_CT[d]}>(NAN)" if d.startswith("float") else "~0u"
        main += f"  std::vector<{_CT[d]}> o_{n}({size}, {fill});\n"
        call.append(f"o_{n}.data()")
    together = "true" if any(word in header + source for word in _WAITS) else "false"
    main += f"  launch({blocks[0]}, {blocks[1]}, {threads}, [&] {{ kmain({', '.join(call)}); }}, {together});\n"
    for n, d, _ in outputs:
        path = os.path.join(workdir, n + ".out")
        main += f'  {{ FILE* f = fopen("{path}", "wb"); fwrite(o_{n}.data(), sizeof(o_{n}[0]), o_{n}.size(), f); fclose(f); }}\n'
    main += "  return 0;\n}\n"
    exe = _compile(src + main, workdir, "-O1")
    subprocess.run([exe], check=True, timeout=600)
    return {n: np.fromfile(os.path.join(workdir, n + ".out"), _NP[d]) for n, d, _ in outputs}


_DTYPE_NAMES = {"float32": "float32", "float16": "float16", "uint32": "uint32", "int32": "int32", "uint8": "uint8",
                "uint16": "uint16"}


def _dtype_name(dtype) -> str:
    return _DTYPE_NAMES[str(dtype).rsplit(".", 1)[-1]]


def emulate_kernel_args(source, input_names, args: dict, output_names, workdir, header=""):
    """``emulate_launch`` of a runtime's launch arguments (``mx.fast.cuda_kernel``'s keywords:
    inputs, template with dtypes, grid, threadgroup, output shapes and dtypes): the outputs
    as numpy arrays of their shapes, by name."""
    ins = [(n, _dtype_name(a.dtype), a) for n, a in zip(input_names, args["inputs"])]
    template = [(k, _dtype_name(v) if isinstance(v, type(mx.float32)) else v) for k, v in args["template"]]
    shapes, dtypes = args["output_shapes"], args["output_dtypes"]
    outs = [(n, _dtype_name(d), int(np.prod(shape))) for n, shape, d in zip(output_names, shapes, dtypes)]
    threads = args["threadgroup"][0]
    gx, gy, _ = args["grid"]
    got = emulate_launch(source, ins, outs, template, (gx // threads, gy), threads, workdir, header=header)
    return {n: got[n].reshape(shape) for n, shape in zip(output_names, shapes)}


def runtime_launch(algo, args, *, scale, bits, group_size, chunk, target):
    """The runtime's (source, splits, threads, params, template) of a dispatched kernel."""
    q, kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres = args
    B, Hq, _, D = q.shape
    H = kc.shape[1]
    a = (None, D, Hq // H, bits, group_size, kc.shape[3], n_kq, n_kres, n_vq, n_vres, B * H,
         scale)
    if algo == "frag":
        ns, params, template, _, _ = kd._frag_launch_args(*a, target)
        return kd.CUDA_FRAG_SOURCE, ns, kd.FRAG_NT, params, template
    source = {"simt": kd.CUDA_SOURCE, "folded": kd.CUDA_FOLDED_SOURCE}[algo]
    ns, params, template = kd._chunk_launch_args(algo, *a, chunk, target)
    return source, ns, kd._NT, params, template


def emulate_cuda(args, source, ns, nt, params, template, workdir):
    """Run one launch of the main kernel ``source`` (``ns`` blocks of ``nt`` threads per kv
    head, its ``params`` and ``template``; T is taken from the queries) and the merge kernel
    as C++ on the CPU; the attention output (B, Hq, 1, D) in float32."""
    q, kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres = args
    B, Hq, _, D = q.shape
    H = kc.shape[1]
    dt = {mx.float16: "float16", mx.float32: "float32"}[q.dtype]
    ins = [("queries", dt, q), ("k_codes", "uint32", kc), ("k_scales", dt, ks),
           ("k_biases", dt, kb), ("k_res", dt, kr), ("v_codes", "uint32", vc),
           ("v_scales", dt, vs), ("v_biases", dt, vb), ("v_res", dt, vr),
           ("params", "int32", params)]
    template = [(k, dt if k == "T" else v) for k, v in template]
    src = _EMU_PRELUDE + kd.CUDA_HEADER + kd.CUDA_FOLDED_HEADER + kd.CUDA_FRAG_HEADER
    src += _emu_function("kmain", source, [(n, d) for n, d, _ in ins],
                         [("o_part", "float32"), ("ml_part", "float32")], template)
    src += _emu_function("kcomb", kd.CUDA_COMBINE_SOURCE,
                         [("o_part", "float32"), ("ml_part", "float32")], [("out", "float32")],
                         [("OT", "float32"), ("HEAD_DIM", D)])
    call = []
    for n, _, a in ins:
        src_ptr = f"(const {_CT[dict((x, y) for x, y, _ in ins)[n]]}*)b_{n}.data()"
        call.append(src_ptr)
        if n + "_shape" in source:
            shape = list(a.shape) + [0] * (10 - a.ndim)
            call.append("Shape{" + ",".join(map(str, shape)) + "}")
    main = "int main() {\n"
    for n, _, a in ins:
        path = os.path.join(workdir, n + ".bin")
        np.array(a).tofile(path)
        main += f'  auto b_{n} = rd("{path}");\n'
    main += (f"  std::vector<float> o_part({B * Hq * ns * D}, NAN), ml_part({B * Hq * ns * 2}, NAN),"
             f" out({B * Hq * D}, NAN);\n")
    main += (f"  launch({ns}, {B * H}, {nt}, [&] {{ kmain({', '.join(call)}, o_part.data(),"
             f" ml_part.data()); }});\n")
    main += (f"  launch({B * Hq}, {D // 32}, 256, [&] {{ kcomb(o_part.data(), Shape{{{B * Hq}, {ns},"
             f" {D}}}, ml_part.data(), out.data()); }});\n")
    out_path = os.path.join(workdir, "out.bin")
    main += f'  FILE* f = fopen("{out_path}", "wb"); fwrite(out.data(), 4, out.size(), f);'
    main += " fclose(f);\n  return 0;\n}\n"
    exe = _compile(src + main, workdir, "-O0")
    subprocess.run([exe], check=True, timeout=120)
    return np.fromfile(out_path, dtype=np.float32).reshape(B, Hq, 1, D)


_PRELUDE_HEADERS: dict[str, str] = {}  # optimisation flag -> a folder with the prelude precompiled


def _precompiled_prelude(opt: str) -> str | None:
    """A folder holding ``_EMU_PRELUDE`` as ``prelude.h`` and its precompiled header for
    ``opt`` (g++ takes a header's .gch only for the flags it was built with), made once a
    process: its standard headers were most of each emulation's build (0.65 of 0.85 s).
    None where g++ cannot precompile it (the emulation then includes the text)."""
    if opt not in _PRELUDE_HEADERS:
        folder = tempfile.mkdtemp(prefix="vq_emu_prelude_")
        atexit.register(shutil.rmtree, folder, True)
        header = os.path.join(folder, "prelude.h")
        with open(header, "w") as fh:
            fh.write(_EMU_PRELUDE)
        r = subprocess.run(["g++", *_GXX_FLAGS, opt, "-x", "c++-header", "-o", header + ".gch", header],
                           capture_output=True, text=True)
        _PRELUDE_HEADERS[opt] = folder if r.returncode == 0 else None
    return _PRELUDE_HEADERS[opt]


_GXX_FLAGS = ["-std=c++20", "-pthread", "-w"]


def _compile(src: str, workdir: str, opt: str) -> str:
    """``src`` (the prelude first) built with g++ in ``workdir``; the executable's path. The
    prelude comes from its precompiled header where there is one: the same text, built once."""
    cpp, exe = os.path.join(workdir, "k.cpp"), os.path.join(workdir, "k")
    folder = _precompiled_prelude(opt) if src.startswith(_EMU_PRELUDE) else None
    if folder is not None:
        src = '#include "prelude.h"\n' + src[len(_EMU_PRELUDE):]
    with open(cpp, "w") as fh:
        fh.write(src)
    include = ["-I", folder] if folder is not None else []
    r = subprocess.run(["g++", *_GXX_FLAGS, opt, *include, "-o", exe, cpp], capture_output=True, text=True)
    if r.returncode:
        pytest.fail("the CUDA source does not compile as C++ in the emulation:\n" + r.stderr[-3000:])
    return exe


def _gxx_can_emulate() -> bool:
    if shutil.which("g++") is None or sys.platform == "win32":
        return False
    probe = subprocess.run(
        ["g++", "-std=c++20", "-x", "c++", "-fsyntax-only", "-"],
        input="#include <barrier>\n_Float16 x; int main(){}\n", capture_output=True, text=True)
    return probe.returncode == 0


def skip_without_emulation():
    if not _gxx_can_emulate():
        pytest.skip("SKIPPED LOUDLY: no g++ with C++20 <barrier> and _Float16: the CUDA "
                    "source is not emulated on this machine")


@pytest.mark.parametrize(
    "algo,R,bits,G,n_kq,n_kres,n_vres,chunk,target,variant",
    [
        # simt, with the runtime's (TW, KUNROLL, VUNROLL): (8, 8, 8) at GQA 4, (4, 8, 8) at 8
        ("simt", 4, 4, 64, 512, 37, 128, 256, 1024, None),   # 3 splits, residual last
        pytest.param("simt", 8, 2, 32, 256, 100, 200, 128, 2, None,  # chunks per split
                     marks=pytest.mark.slow),
        # folded: splits of one chunk; several chunks per split (register prefetch),
        # 4-byte key loads (rows not 16-byte aligned), a chunk shorter than a group
        ("folded", 4, 4, 64, 512, 37, 131, 128, 2, None),
        pytest.param("folded", 8, 2, 32, 288, 100, 200, 128, 2, None, marks=pytest.mark.slow),
        pytest.param("folded", 4, 4, 64, 512, 37, 128, 128, 1024, None,
                     marks=pytest.mark.slow),
        pytest.param("folded", 3, 8, 128, 256, 19, 77, 64, 4, None, marks=pytest.mark.slow),
        # frag: several tiles per warp and tail blocks (4-bit G64, residual windows);
        # tiles spanning two key and two value groups (2-bit G64) with GQA 8 (hi and lo
        # value products); 8-bit with GQA 3; 4-byte key copies; exact codes (KEEP 0, what
        # runs past FRAG_KEEP_MAX_TILES tiles a block) unless "keep-1" (the runtime's
        # FRAG_KEEP_OFFSET: the codes 4 or more bits up their byte keep their offset);
        # with target 2 one block per kv head owns all 16 tiles and loops over 11 tail
        # chunks
        ("frag", 4, 4, 64, 512, 37, 131, None, 4, None),
        pytest.param("frag", 8, 2, 64, 512, 37, 131, None, 4, None, marks=pytest.mark.slow),
        ("frag", 3, 8, 32, 256, 37, 100, None, 3, None),
        pytest.param("frag", 4, 4, 32, 256, 37, 40, None, 3, "pad-key-words",
                     marks=pytest.mark.slow),
        ("frag", 4, 4, 64, 1024, 37, 131, None, 2, "keep-1"),
        ("frag", 4, 4, 64, 0, 37, 37, None, 4, None),   # no tile: every token a tail chunk
        pytest.param("frag", 4, 4, 64, 512, 37, 131, None, 64, None,  # tail chunks in blocks of their own
                     marks=pytest.mark.slow),
        pytest.param("frag", 3, 2, 64, 512, 37, 100, None, 2, "keep-1",
                     marks=pytest.mark.slow),
        pytest.param("frag", 8, 2, 32, 512, 37, 131, None, 4, None,  # four groups a tile
                     marks=pytest.mark.slow),
    ],
)
def test_cuda_source_emulated_on_cpu(tmp_path, monkeypatch, algo, R, bits, G, n_kq, n_kres,
                                     n_vres, chunk, target, variant):
    skip_without_emulation()
    args, _, _ = make_case(B=1, H=2, R=R, bits=bits, G=G, n_kq=n_kq, n_kres=n_kres,
                           n_vres=n_vres, dtype=mx.float16)
    kw = _kw(128, bits, G)
    if variant == "pad-key-words":  # key rows no longer 16-byte aligned: 4-byte copies
        a = list(args)
        a[1] = mx.concatenate([a[1], mx.zeros((*a[1].shape[:3], 1), mx.uint32)], -1)
        assert a[1].shape[3] % 4
        args = tuple(a)
    if algo == "frag" and variant != "keep-1":  # the runtime's exact codes
        monkeypatch.setattr(kd, "FRAG_KEEP_MAX_TILES", 0)
    launch = runtime_launch(algo, args, **kw, chunk=chunk, target=target)
    if algo == "frag":
        keep = dict(launch[4])["KEEP"]
        assert keep == (kd.FRAG_KEEP_OFFSET if variant == "keep-1" else 0)
    out = emulate_cuda(args, *launch, str(tmp_path))
    assert np.isfinite(out).all(), "emulated kernel left outputs unwritten"
    ref = kd.kivi_decode_attention_reference(args[0].astype(mx.float32), *args[1:], **kw)
    # simt: float32 throughout; folded and frag: exact codes, q*s and p*s as float16 pairs
    # (about 2^-22 each, less where the low part is subnormal); frag with the 1024 offset
    # kept by the codes at the top of their byte (KEEP 1): ~2^-22 too
    tol = {"simt": 1e-5, "folded": 1e-4, "frag": 1e-4}[algo]
    assert _rel(out, _f32(ref)) < tol


@pytest.mark.parametrize("R,bits,G,target,rows", [
    # CHECK_ROWS: tiles and tails of different lengths, a sequence without tiles, rings that
    # wrap; target 4: the tail chunks in the tile blocks (TAIL_FIRST), 64: blocks of their own
    (4, 4, 64, 4, kd.CHECK_ROWS),
    pytest.param(4, 4, 64, 64, kd.CHECK_ROWS, marks=pytest.mark.slow),
    # GQA 8 (two value products), 2-bit tiles spanning groups; equal rows (a batch of copies)
    pytest.param(8, 2, 32, 6, ((256, 40, 288, 8, 0), (256, 40, 288, 8, 0)),
                 marks=pytest.mark.slow),
    pytest.param(3, 8, 128, 4, ((128, 3, 130, 1, 5), (384, 20, 400, 4, 2)), marks=pytest.mark.slow),
])
def test_frag_rows_source_emulated_on_cpu(tmp_path, R, bits, G, target, rows):
    """A packed batch in one launch (ROWS): each sequence's output equals it attended alone
    (the rows reference), whatever lies past its counts."""
    skip_without_emulation()
    q, bufs = kd.rows_case(128, R, bits, G, mx.float16, rows=rows)
    kw = _kw(128, bits, G)
    ns, params, template = kd._frag_rows_launch_args(
        q.dtype, 128, R, bits, G, bufs[0].shape[3], rows, bufs[0].shape[1], kw["scale"], target)
    kc, ks, kb, kr, vc, vs, vb, vr = bufs
    args = (q, kc, ks, kb, 0, kr, 0, vc, vs, vb, 0, vr, 0)
    out = emulate_cuda(args, kd.CUDA_FRAG_SOURCE, ns, kd.FRAG_NT, params, template, str(tmp_path))
    assert np.isfinite(out).all(), "emulated kernel left outputs unwritten"
    ref = kd.kivi_decode_attention_rows_reference(q.astype(mx.float32), *bufs, rows, **kw)
    # as the single-sequence frag cases: float16 pairs for q*s and p*s, ~2^-22 each
    for b in range(len(rows)):
        assert _rel(out[b], _f32(ref[b])) < 1e-4, f"sequence {b} {rows[b]}"


def test_frag_rows_plan_is_the_widest_sequences():
    """The rows launch plans the split for the most tiles and tail chunks of any sequence, and
    gives each sequence its own counts, first tail token and ring start."""
    rows = ((256, 5, 257, 4, 3), (512, 37, 540, 9, 7), (0, 13, 0, 13, 11))
    ns, params, template = kd._frag_rows_launch_args(mx.float16, 128, 4, 4, 64, 64, rows, 2,
                                                     0.125, 4)
    tt = kd._frag_tile(4)
    # the widest: 512 // 32 = 16 tiles; tails (5 + 1) / 16 -> 1, (37 + 0) -> 3, 13 -> 1
    t_fast, ns_tail, ns_single, tps, tail0 = kd._frag_plan(512, 540, 549, 6, 4, 4)
    assert (ns, list(np.array(params[5:9]))) == (ns_single, [tps, t_fast, ns_tail, tail0])
    assert list(np.array(params[kd.ROW_PARAMS0:])) == [
        256, 5, 257, 4, 256 // tt * tt, 3, 512, 37, 540, 9, 512, 7, 0, 13, 0, 13, 0, 11]
    assert dict(template)["ROWS"] is True


def test_the_packed_launch_hands_the_kernel_the_batch_buffers_and_the_rows_plan(monkeypatch):
    """What ``kivi_decode_attention_rows`` launches (no GPU here: the kernel is a stand-in
    that records its call): the 8 buffers and the rows plan's params in the kernels' input
    order, a block per kv head of every sequence, the ROWS template, then the merge."""
    rows = kd.CHECK_ROWS
    q, bufs = kd.rows_case(128, 4, 4, 64, mx.float16, rows=rows)
    calls = {}

    def main(**kw):
        calls["main"] = kw
        return [mx.zeros(s, d) for s, d in zip(kw["output_shapes"], kw["output_dtypes"])]

    monkeypatch.setattr(kd, "_get_kernels", lambda *a: (main, None))
    monkeypatch.setattr(kd, "merge_partials", lambda *a: calls.setdefault("merge", a) and a[0])
    kd._rows_launch(q, bufs, rows, scale=0.125, bits=4, group_size=64)
    kw = calls["main"]
    B, H = len(rows), bufs[0].shape[1]
    ns, params, template = kd._frag_rows_launch_args(
        mx.float16, 128, 4, 4, 64, bufs[0].shape[3], rows, H, 0.125,
        kd.frag_target_blocks(B * H, max(r[0] + r[1] for r in rows), 4))
    assert all(x is y for x, y in zip(kw["inputs"], [q, *bufs], strict=False)) and len(kw["inputs"]) == 10
    assert mx.array_equal(kw["inputs"][9], params) and kw["template"] == template
    assert kw["grid"] == (ns * kd.FRAG_NT, B * H, 1) and kw["threadgroup"] == (kd.FRAG_NT, 1, 1)
    assert kw["output_shapes"] == [(B * 4 * H, ns, 128), (B * 4 * H, ns, 2)]
    assert calls["merge"][3:] == (q.shape, q.dtype)
