"""The fused prompt-mass kernels (``evict/fused_mass_kernel.py``): their CUDA source run on the
CPU by emulation (tensor-core products included, float16 and bfloat16) against MLX's float32
masses (masked, per-head positions, none; several tiles, split rows, a row that sees no key),
``reference_mass`` against ``attention.attention_mass``, and the dispatch."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.evict import attention
from veloxquant_mlx.evict import fused_mass_kernel as fk
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.methods import keyformer

def _bits(a: mx.array) -> np.ndarray:
    """A 16-bit array's words, as the kernels read them."""
    return np.array(a.view(mx.uint16))


def _emulated_args(names, args, keys_words=None):
    """The emulator's inputs; ``keys_words``: the keys' 16-bit words as a numpy view (strided,
    as a store's keys are) in place of the keys' own contiguous words."""
    ins = []
    for name, a in zip(names, args["inputs"]):
        if name == "keys" and keys_words is not None:
            ins.append((name, "uint16", keys_words))
        elif a.dtype in (mx.float16, mx.bfloat16):
            ins.append((name, "uint16", _bits(a)))
        else:
            ins.append((name, {mx.float32: "float32", mx.int32: "int32", mx.uint32: "uint32"}[a.dtype], np.array(a)))
    template = [(k, "uint16" if k == "T" else v) for k, v in args["template"]]
    return ins, template


def words_in_a_larger_buffer(words: np.ndarray) -> np.ndarray:
    """(B, H, n, D) words as a store holds them: the first n rows of a buffer of more rows,
    whose rows beyond are +inf (a read of one shows)."""
    b, h, n, d = words.shape
    root = np.full((b, h, n + 29, d), 0x7C00, np.uint16)
    root[:, :, :n] = words
    return root[:, :, :n]


def emulate(case, workdir, noise=None, keys_words=None) -> tuple[np.ndarray, np.ndarray]:
    """Both launches of ``fused_mass`` emulated, the second fed the first's output:
    (masses (B, Hkv, n), the rows' log-sum-exps in base 2); ``keys_words`` as
    ``_emulated_args``'."""
    from test_kernel_kivi_decode import emulate_launch

    header = fk.CUDA_HEADER  # the emulator's prelude has vqm_mma for both 16-bit types
    lse_args, col_args, _ = fk.launch_args("cuda", *case, noise)
    ins, template = _emulated_args(fk.LSE_IN, lse_args, keys_words)
    (size,) = lse_args["output_shapes"][0]
    gx, gy, _ = lse_args["grid"]
    lse = emulate_launch(fk.LSE_CUDA, ins, [("lse", "float32", size)], template, (gx // fk.NT, gy), fk.NT,
                         workdir, header=header)["lse"]
    col_args["inputs"][2] = mx.array(lse)
    ins, template = _emulated_args(fk.COLUMNS_IN, col_args, keys_words)
    shape = col_args["output_shapes"][0]
    gx, gy, _ = col_args["grid"]
    partial = emulate_launch(fk.COLUMNS_CUDA, ins, [("partial", "float32", int(np.prod(shape)))], template,
                             (gx // fk.NT, gy), fk.NT, workdir, header=header)["partial"]
    b, hkv, n = case[1].shape[:3]
    return partial.reshape(shape).sum(axis=0).reshape(b, hkv, n), lse


@pytest.mark.parametrize("dtype, masked, per_head, nq, n, d", [
    (mx.float16, True, False, 37, 150, 32),    # H2O's chunk: causal positions shared by the heads, padding slots
    pytest.param(mx.float16, True, True, 37, 150, 32, marks=pytest.mark.slow),  # positions per KV head (a store's slots)
    (mx.float16, False, False, 37, 150, 32),   # every key visible
    (mx.bfloat16, True, False, 37, 150, 32),   # bfloat16's products
    # the 8B head: 8 products a tile row, 5 key tiles, 3 row tiles (9 s of the CI's two workers;
    # nvcc compiles this head dim below)
    pytest.param(mx.float16, True, False, 70, 300, 128, marks=pytest.mark.slow),
])
def test_the_cuda_source_gives_mlxs_float32_masses(tmp_path, dtype, masked, per_head, nq, n, d):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):
        case = fk.check_case(dtype, masked, per_head, nq=nq, n=n, d=d)
        assert fk.launch_args("cuda", *case)[2] > 1  # the rows split into shares, summed after
        # the keys read in place from a larger buffer, as a store's are
        got, lse = emulate(case, str(tmp_path), keys_words=words_in_a_larger_buffer(_bits(case[1])))
        ref = np.array(fk.reference_mass(*case))
        # the emulation sums each product's 16 terms in float32, as MLX's product does in
        # another order: a few float32 roundings of the largest logit's exponential
        assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max(), np.abs(got - ref).max()
        if masked:  # padding keys get nothing; every row sees its own key, so its lse is finite
            assert np.all(got[np.array(case[4]) < 0] == 0) and np.isfinite(lse).all()
        total = got.sum(axis=-1)  # each row's softmax sums to 1, times its weight
        assert np.allclose(total, np.array(case[5]).sum() * (case[0].shape[1] // case[1].shape[1]), rtol=1e-5)


@pytest.mark.parametrize("layout", [
    # a store's keys: 16-byte loads in place (in CI through the masses' test above)
    pytest.param("rows of a larger buffer", marks=pytest.mark.slow),
    pytest.param("transposed", marks=pytest.mark.slow),  # words a row apart: one word a load
    pytest.param("rows off 16 bytes", marks=pytest.mark.slow),  # adjacent words, rows not aligned
])
def test_the_cuda_source_reads_the_keys_where_they_lie(tmp_path, layout):
    """The launches read the keys through their strides, so a store's keys (a view of its
    larger buffer) are not copied at each launch (MLX keeps such copies until the command
    buffer ends: at 32k, 64 MiB a layer). Two sequences of two KV heads; the masses and
    log-sum-exps equal those of the same keys given contiguous, bit for bit (the same products
    in the same order, whatever the loads)."""
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):
        case = fk.check_case(mx.float16, b=2, nq=37, n=150, d=32)
        words = _bits(case[1])
        b, h, n, d = words.shape
        if layout == "rows of a larger buffer":
            view = words_in_a_larger_buffer(words)
        elif layout == "transposed":
            view = np.ascontiguousarray(words.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
        else:
            root = np.full((b, h, n, d + 3), 0x7C00, np.uint16)
            root[..., 3:] = words
            view = root[..., 3:]
        assert not view.flags.c_contiguous
        (tmp_path / "view").mkdir()
        (tmp_path / "contiguous").mkdir()
        got, lse = emulate(case, str(tmp_path / "view"), keys_words=view)
        want, want_lse = emulate(case, str(tmp_path / "contiguous"))
        assert np.array_equal(got, want) and np.array_equal(lse, want_lse)
        ref = np.array(fk.reference_mass(*case))
        assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()


@pytest.mark.parametrize("noisy", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_the_cuda_source_gives_keyformers_masses(tmp_path, noisy):
    """keyformer's prompt scores: softmax((x scale + zeta) / tau) summed over the queries and a
    group's heads, zeta the hash of the query head, query and key positions made inside the
    kernels (``keyformer.gumbel_mass``'s own, through MLX's float32 ops, is the reference);
    without noise, softmax(x scale / tau)."""
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):
        q, k, scale, _, _, _ = fk.check_case(mx.float16, nq=37, n=150, d=32)
        b, hq, nq, _ = q.shape
        hkv, n = k.shape[1], k.shape[2]
        k_pos = mx.broadcast_to(mx.arange(n, dtype=mx.int32), (b, hkv, n))
        stream = keyformer.noise_stream(5, 3, b, hq, hkv) if noisy else None
        tau = 0.7
        ref = np.array(keyformer.gumbel_mass(q, k, scale, n - nq, k_pos, tau, stream))
        q_pos = mx.arange(n - nq, n, dtype=mx.int32)
        case = (q, k, scale if noisy else scale / tau, q_pos, k_pos, mx.ones((nq,), mx.float32))
        got, _ = emulate(case, str(tmp_path), (stream[0], stream[1], tau) if noisy else None)
        # the logs of the noise by the C library here and by MLX's vectorised log: a few
        # float32 roundings of a logit, as the products' order
        assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max(), np.abs(got - ref).max()
        assert np.isclose(got.sum(), hq * nq, rtol=1e-5)  # every row's softmax sums to 1


def test_keyformer_takes_the_fused_kernels_where_they_run(monkeypatch):
    """On a GPU whose fused kernels passed their check, ``gumbel_mass`` is one ``fused_mass``
    over every query (a stand-in here that emulates nothing: it records its call and returns
    the logits' path's masses), the noise's keys and tau passed along."""
    calls = []
    q, k, scale, _, _, _ = fk.check_case(mx.float16, nq=9, n=50, d=16)
    k_pos = mx.broadcast_to(mx.arange(50, dtype=mx.int32), (1, 2, 50))
    stream = keyformer.noise_stream(1, 0, 1, 4, 2)
    ref = keyformer.gumbel_mass(q, k, scale, 41, k_pos, 0.5, stream)

    def stand_in(backend, queries, keys, scale_, q_positions, k_positions, weights, noise=None):
        calls.append((scale_, q_positions.tolist(), weights.tolist(), noise[2]))
        assert noise[0] is stream[0] and noise[1] is stream[1]
        return ref

    monkeypatch.setattr(fk, "kernel_backend", lambda queries, keys: "cuda")
    monkeypatch.setattr(keyformer, "checked_once", lambda *args: True)  # the noise's check: its own test
    monkeypatch.setattr(fk, "fused_mass", stand_in)
    assert keyformer.gumbel_mass(q, k, scale, 41, k_pos, 0.5, stream) is ref
    assert calls == [(scale, list(range(41, 50)), [1.0] * 9, 0.5)]


def test_the_cuda_source_compiles_for_hopper(tmp_path):
    """The kernels as ``mx.fast.cuda_kernel`` wraps them (a template over the launch's
    constants, the inputs as pointers), compiled by nvcc for sm_90: the tensor-core
    instructions' operand constraints, the shared tiles and both dtypes, which the CPU
    emulation does not see. Without spilling: registers are what an H100 block of 128 threads
    can hold."""
    import shutil
    import subprocess

    if shutil.which("nvcc") is None:
        pytest.skip("SKIPPED LOUDLY: no nvcc here: the CUDA source is not compiled (the emulation above runs it)")
    types = {"queries": "const T*", "keys": "const T*", "lse": "const float*", "q_pos": "const int32_t*",
             "k_pos": "const int32_t*", "head_keys": "const uint32_t*", "col_key": "const uint32_t*",
             "weights": "const float*", "scale": "const float*", "params": "const int32_t*"}
    # MLX's own Strides (mlx/backend/cuda/device/utils.cuh), after the keys as MLX passes them
    code = ("#include <cstdint>\n#include <cuda_fp16.h>\n#include <cuda_bf16.h>\n#include <cuda/std/array>\n"
            "using Strides = cuda::std::array<int64_t, 8>;\n" + fk.CUDA_HEADER)
    calls = []
    for name, source, inputs, output in (("vq_lse", fk.LSE_CUDA, fk.LSE_IN, "lse"),
                                         ("vq_columns", fk.COLUMNS_CUDA, fk.COLUMNS_IN, "partial")):
        params = [f"{types[n]} {n}" for n in inputs]
        params.insert(inputs.index("keys") + 1, "const __grid_constant__ Strides keys_strides")
        args = ", ".join(params + [f"float* {output}"])
        code += (f"template <typename T, int HEAD_DIM, bool MASKED, bool BF16, bool NOISE, int NT>\n"
                 f"__global__ void {name}({args}) {{\n{source}\n}}\n")
        nulls = ["nullptr"] * (len(inputs) + 1)
        nulls.insert(inputs.index("keys") + 1, "Strides{}")
        nulls = ", ".join(nulls)
        for t, bf16, noise in (("__half", "false", "false"), ("__nv_bfloat16", "true", "true")):
            calls.append(f"  {name}<{t}, 128, true, {bf16}, {noise}, {fk.NT}><<<1, {fk.NT}>>>({nulls});")
    code += "void launch_all() {\n" + "\n".join(calls) + "\n}\n"
    src = tmp_path / "fused_mass.cu"
    src.write_text(code)
    r = subprocess.run(["nvcc", "-arch=sm_90", "-std=c++17", "-c", str(src), "-o", str(tmp_path / "fused_mass.o"),
                        "-Xptxas", "-v"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "spill stores" in r.stderr and " 0 bytes spill stores" in r.stderr
    assert "bytes spill stores" not in r.stderr.replace(" 0 bytes spill stores", "")


def test_a_row_that_sees_no_key_adds_nothing(tmp_path):
    from test_kernel_kivi_decode import skip_without_emulation

    skip_without_emulation()
    with mx.stream(mx.cpu):
        q, k, scale, q_pos, k_pos, w = fk.check_case(mx.float16)
        k_pos = mx.where(mx.arange(k_pos.shape[-1]) < 120, -1, k_pos)
        q_pos = mx.where(mx.arange(q_pos.shape[0]) < 10, 100, q_pos)  # the first 10 queries see only padding
        got, lse = emulate((q, k, scale, q_pos, k_pos, w), str(tmp_path))
        lse = lse.reshape(2, 2, 37)  # (KV head, query head of its group, query)
        assert np.all(np.isinf(lse[..., :10])) and np.isfinite(lse[..., 10:]).all()
        ref = np.array(fk.reference_mass(q, k, scale, q_pos, k_pos, w))
        assert np.all(got[..., :120] == 0)
        assert np.abs(got - ref).max() <= 2e-6 * np.abs(ref).max()


def test_reference_mass_is_attention_masss_scores():
    """``reference_mass`` is what ``attention_mass`` sums (its float32 path), so the
    self-check and the emulation hold the kernels to what the scores were."""
    for per_head in (False, True):
        q, k, scale, q_pos, k_pos, w = fk.check_case(mx.float16, True, per_head, nq=9, n=40, d=16)
        g = q.shape[1] // k.shape[1]
        ref = attention.attention_mass(q, k, scale, q_pos, k_pos, w * g)
        assert mx.allclose(fk.reference_mass(q, k, scale, q_pos, k_pos, w), ref, rtol=1e-5, atol=1e-7)


def test_the_kernels_take_16_bit_heads_of_16s():
    q16, k16 = mx.zeros((1, 4, 3, 128), mx.float16), mx.zeros((1, 2, 9, 128), mx.float16)
    assert fk.takes(q16, k16) and fk.takes(q16.astype(mx.bfloat16), k16.astype(mx.bfloat16))
    assert not fk.takes(q16.astype(mx.float32), k16.astype(mx.float32))  # logits written as before
    assert not fk.takes(q16, k16.astype(mx.bfloat16))
    assert not fk.takes(q16[..., :120], k16[..., :120])  # not a multiple of 16
    assert not fk.takes(mx.zeros((1, 4, 3, 512), mx.float16), mx.zeros((1, 2, 9, 512), mx.float16))


def test_splits_fill_the_gpu_and_keep_a_tile_of_rows_a_share():
    assert fk.splits_for(8192, 4096, 8) == 2    # 512 blocks of keys -> 2 shares
    assert fk.splits_for(100, 300, 1) == 2      # 5 blocks of keys, 2 tiles of rows
    assert fk.splits_for(8192, 32768, 8) == 1   # 4,096 blocks of keys already
    # shares are a parameter, not a constant of the source: one kernel serves every chunk
    q, k = mx.zeros((1, 4, 3, 128), mx.float16), mx.zeros((1, 2, 300, 128), mx.float16)
    lse, columns, splits = fk.launch_args("cuda", q, k, 0.1, None, None, mx.ones((3,)))
    assert splits == 1 and columns["inputs"][-1].tolist()[4] == splits
    # a scale given as an array (as some caches hold it) is taken as it is, not read
    assert mx.array_equal(fk.launch_args("cuda", q, k, mx.array(0.1), None, None, mx.ones((3,)))[0]["inputs"][-2],
                          lse["inputs"][-2])
    assert [name for name, _ in columns["template"]] == ["T", "HEAD_DIM", "MASKED", "BF16", "NOISE", "NT"]


def test_a_test_that_takes_a_gpus_paths_on_the_cpu_writes_logits(monkeypatch):
    if kd._gpu_kind() is not None:
        pytest.skip("a GPU back-end is here: its kernels run, there is no stand-in to test")
    monkeypatch.setenv("VQ_FUSED_MASS", "1")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fk, "_CHECKED", {})
    q, k = mx.zeros((1, 4, 3, 128), mx.float16), mx.zeros((1, 2, 9, 128), mx.float16)
    assert fk.kernel_backend(q, k) is None and fk._CHECKED == {}


def test_the_kernels_run_unless_switched_off(monkeypatch):
    """On by default (timed on an H100, session 82): a GPU whose kernels passed their check
    takes them for shapes they take, unless ``VQ_FUSED_MASS=0``."""
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(fk, "kernel_checked", lambda backend, dtype: True)
    q, k = mx.zeros((1, 4, 3, 128), mx.float16), mx.zeros((1, 2, 9, 128), mx.float16)
    monkeypatch.delenv("VQ_FUSED_MASS", raising=False)
    assert fk.kernel_backend(q, k) == "cuda"
    monkeypatch.setenv("VQ_FUSED_MASS", "0")
    assert fk.kernel_backend(q, k) is None
    monkeypatch.setenv("VQ_FUSED_MASS", "1")
    assert fk.kernel_backend(q, k) == "cuda"
    assert fk.kernel_backend(q.astype(mx.float32), k.astype(mx.float32)) is None


def test_attention_mass_takes_the_fused_kernels_where_they_run(monkeypatch):
    """On a GPU whose fused kernels passed their check, the whole call's mass is one
    ``fused_mass`` (a stand-in here that computes the reference) over every query, with the
    weights over the group's heads: the same masses as the logits' path, and no block."""
    calls = []

    def stand_in(backend, queries, keys, scale, q_positions, k_positions, weights):
        calls.append((backend, queries.shape))
        return fk.reference_mass(queries, keys, scale, q_positions, k_positions, weights)

    q, k, scale, q_pos, k_pos, w = fk.check_case(mx.float16, nq=9, n=50, d=16)
    ref = attention.attention_mass(q, k, scale, q_pos, k_pos, w)
    monkeypatch.setattr(fk, "kernel_backend", lambda queries, keys: "cuda")
    monkeypatch.setattr(fk, "fused_mass", stand_in)
    monkeypatch.setattr(attention, "SCORE_ELEMENTS", 400)  # blocks of 2 queries for the logits' path
    got = attention.attention_mass(q, k, scale, q_pos, k_pos, w)
    assert calls == [("cuda", q.shape)]
    assert mx.allclose(got, ref, rtol=1e-5, atol=1e-7)
    calls.clear()  # a float16 product asked for: the fused float32 sums are at least as exact
    assert mx.allclose(attention.attention_mass(q, k, scale, None, None, None, None),
                       attention.attention_mass(q, k, scale, None, None, None, mx.float32), rtol=1e-5, atol=1e-7)
    assert len(calls) == 2


def test_keyformer_keeps_written_logits_where_the_noise_fails_its_check(monkeypatch):
    """The kernels' own check has no noise: keyformer checks it once against its written
    logits (on a CUDA back-end emulated by a stand-in whose noise is off by a factor) and, when
    it fails, scores through written logits with a warning."""
    q, k, scale, _, _, _ = fk.check_case(mx.float16, nq=9, n=50, d=16)
    k_pos = mx.broadcast_to(mx.arange(50, dtype=mx.int32), (1, 2, 50))
    stream = keyformer.noise_stream(1, 0, 1, 4, 2)
    ref = keyformer.gumbel_mass(q, k, scale, 41, k_pos, 0.5, stream)
    monkeypatch.setattr(fk, "kernel_backend", lambda queries, keys: "cuda")
    monkeypatch.setattr(kd, "_gpu_kind", lambda: "cuda")
    monkeypatch.setattr(keyformer, "_NOISE_CHECKED", {})
    monkeypatch.setattr(keyformer, "_fused_gumbel_mass",
                        lambda backend, *a: keyformer._written_gumbel_mass(*a[:5], a[5] * 1.1, a[6]))
    with pytest.warns(RuntimeWarning, match="Gumbel noise failed its self-check"):
        got = keyformer.gumbel_mass(q, k, scale, 41, k_pos, 0.5, stream)
    assert mx.array_equal(got, ref) and list(keyformer._NOISE_CHECKED.values())[0] is not None


def test_on_a_gpu_the_fused_kernels_give_mlxs_float32_masses():
    if kd.gpu_backend() is None:
        pytest.skip("SKIPPED LOUDLY: no GPU here: the fused kernels run on a GPU only (their CUDA source is "
                    "emulated above)")
    for dtype in (mx.float16, mx.bfloat16):
        assert fk.kernel_checked(kd.gpu_backend(), dtype), fk._CHECKED
        assert keyformer._noise_problem(kd.gpu_backend(), dtype) is None
        for masked, per_head, nq in ((True, False, 200), (True, True, 5), (False, False, 64)):
            case = fk.check_case(dtype, masked, per_head, nq=nq, n=3000, d=128)
            assert fk.within_check_tolerance(fk.fused_mass(kd.gpu_backend(), *case), fk.reference_mass(*case))
        # keys read in place: a store's (rows of a larger buffer) and a transposed buffer's, the
        # same masses bit for bit as the keys made contiguous
        q, k, scale, q_pos, k_pos, w = fk.check_case(dtype, b=2, nq=100, n=1000, d=128)
        want = fk.fused_mass(kd.gpu_backend(), q, mx.contiguous(k), scale, q_pos, k_pos, w)
        for keys in (fk.in_a_larger_buffer(k), mx.contiguous(k.swapaxes(2, 3)).swapaxes(2, 3)):
            assert mx.array_equal(fk.fused_mass(kd.gpu_backend(), q, keys, scale, q_pos, k_pos, w), want)


def test_the_self_check_reads_a_stores_keys_in_place(monkeypatch):
    """The kernels' once-a-process check includes keys given as a store holds them (a view of
    a larger buffer, two sequences): a GPU that read them wrongly in place would fail it and
    keep the written logits. A stand-in that computes the reference from the keys it is given
    passes; one that reads the view's spare rows (+inf) fails."""
    seen = []

    def stand_in(backend, queries, keys, *rest):
        seen.append(keys.shape)
        return fk.reference_mass(queries, keys, *rest)

    monkeypatch.setattr(fk, "fused_mass", stand_in)
    assert fk._check_problem("cuda", mx.float16) is None
    assert (2, 2, 300, 128) in seen

    def past_the_view(backend, queries, keys, *rest):
        if keys.shape[0] == 2:  # the rows past the view: the buffer's spare ones
            keys = mx.concatenate([keys[:, :, 1:], mx.full(keys[:, :, :1].shape, float("inf"), keys.dtype)], axis=2)
        return fk.reference_mass(queries, keys, *rest)

    monkeypatch.setattr(fk, "fused_mass", past_the_view)
    assert fk._check_problem("cuda", mx.float16) is not None
