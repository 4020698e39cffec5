"""Benchmark-side kernel code (benchmarks/kernels_extra.py) and the benchmark scripts.

What the dispatcher never runs lives there: the "mma" kernel, the stage-skipping modes,
the sweeps' knobs (chunk, split target, simt variants, frag's KEEP / TAIL_FIRST / launch
bounds), NaN-poisoned outputs and the timelines' extra outputs. Here: its CUDA sources
and variants emulated on the CPU (the harness of tests/test_kernel_kivi_decode.py), its
knobs reaching the launches (recorded through stand-in kernels, no GPU needed), knobs
left at None giving exactly the runtime's launches, and every benchmark script importing
and parsing its arguments.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys

import numpy as np
import pytest

import mlx.core as mx

import test_kernel_kivi_decode as tk

kd = tk.kd
kx = tk.bench_kernels()
BENCHMARKS = tk.ROOT / "benchmarks"


def _launch_args(args, bits, G):
    """The arguments every launch-argument builder takes, from a make_case cache."""
    q, kc, ks, kb, n_kq, kr, n_kres, vc, vs, vb, n_vq, vr, n_vres = args
    B, Hq, _, D = q.shape
    H = kc.shape[1]
    return (None, D, Hq // H, bits, G, kc.shape[3], n_kq, n_kres, n_vq, n_vres, B * H,
            D ** -0.5)


# ----------------------------------------------------------------------------------
# the mma kernel and the frag variants, emulated on the CPU
# ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "algo,R,bits,G,n_kq,n_kres,n_vres,chunk,target,variant",
    [
        ("mma", 4, 4, 32, 288, 37, 130, 128, 2, (4, 16, 8)),      # super-tile cut by n_kq
        pytest.param("mma", 3, 2, 64, 256, 19, 77, 512, 1024, (4, 16, 8),  # GQA 3
                     marks=pytest.mark.slow),
        # frag with every code keeping its float16 offset (KEEP 3)
        pytest.param("frag", 1, 2, 128, 256, 5, 5, None, 2, "keep-3",
                     marks=pytest.mark.slow),
        # tail chunks in the tile blocks after the tiles (TAIL_FIRST forced off)
        pytest.param("frag", 4, 4, 64, 512, 37, 131, None, 4, "tail-last",
                     marks=pytest.mark.slow),
    ],
)
def test_benchmark_kernels_emulated_on_cpu(tmp_path, algo, R, bits, G, n_kq, n_kres, n_vres,
                                           chunk, target, variant):
    tk.skip_without_emulation()
    args, _, _ = tk.make_case(B=1, H=2, R=R, bits=bits, G=G, n_kq=n_kq, n_kres=n_kres,
                              n_vres=n_vres, dtype=mx.float16)
    kw = tk._kw(128, bits, G)
    a = _launch_args(args, bits, G)
    if algo == "mma":
        ns, params, template = kx.chunk_launch_args("mma", *a, chunk, target, variant)
        launch = (kx.CUDA_MMA_SOURCE, ns, kd._NT, params, template)
    else:
        keep = 3 if variant == "keep-3" else 0
        tail_first = False if variant == "tail-last" else None
        ns, params, template, tail0, _ = kx.frag_launch_args(*a, target, keep, tail_first)
        assert dict(template)["KEEP"] == keep
        if variant == "tail-last":
            assert tail0 == 0 and dict(template)["TAIL_FIRST"] is False
        launch = (kd.CUDA_FRAG_SOURCE, ns, kd.FRAG_NT, params, template)
    out = tk.emulate_cuda(args, *launch, str(tmp_path))
    assert np.isfinite(out).all(), "emulated kernel left outputs unwritten"
    ref = kd.kivi_decode_attention_reference(args[0].astype(mx.float32), *args[1:], **kw)
    # mma: float16 operands (dequantized K/V, q, p), about the unit roundoff of float16 on
    # each; frag with the 1024 offset kept by every code (KEEP 3): float32 rounding of sums
    # ~1024x larger than the codes' (2^-24 * 1024 * sum |q s| per product, ~1e-4 here),
    # bounded by the 1e-3
    tol = {"mma": 2e-3, "keep-3": 1e-3, "tail-last": 1e-4}[algo if algo == "mma" else variant]
    assert tk._rel(out, tk._f32(ref)) < tol


# ----------------------------------------------------------------------------------
# knobs and launches (stand-in kernels record what the GPU would be given)
# ----------------------------------------------------------------------------------


@pytest.fixture
def recorded(monkeypatch):
    """Every kernel built and called while the test runs, on stand-ins returning zeros."""
    log = []

    def make(kind):
        def build(**spec):
            def call(**c):
                log.append(dict(kind=kind, name=spec["name"], source=spec["source"],
                                header=spec.get("header", ""), **c))
                return [mx.zeros(s, d) for s, d in zip(c["output_shapes"], c["output_dtypes"])]
            return call
        return build

    monkeypatch.setattr(mx.fast, "cuda_kernel", make("cuda"))
    monkeypatch.setattr(mx.fast, "metal_kernel", make("metal"))
    for module in {kd, kx.kd}:  # the kernels built so far hold the real constructors
        monkeypatch.setattr(module, "_KERNELS", {})
    monkeypatch.setattr(kx, "_MMA", {})
    return log


def _untagged(call: dict) -> str:
    """A recorded launch's kernel name without its text's digest, which is checked here."""
    base = call["name"].rsplit("_", 1)[0]
    assert call["name"] == kd.source_tagged(base, call["source"], call["header"])
    return base


def _calls(log):
    """What a recorded call gives the GPU: kernel, template, grid, params, init."""
    out = []
    for c in log:
        params = c["inputs"][-1]
        out.append((c["name"], c["source"], c["header"], [(k, str(v)) for k, v in
                    c.get("template", [])], c["grid"], c["threadgroup"],
                    [tuple(s) for s in c["output_shapes"]], c["output_dtypes"],
                    params.tolist() if params.dtype == mx.int32 else None,
                    repr(c.get("init_value"))))
    return out


_SHAPES = [  # dtype, bits, G, R, B, n_kq, n_kres, n_vres
    (mx.float16, 4, 64, 4, 1, 1024, 37, 131), (mx.float16, 2, 32, 8, 2, 512, 5, 33),
    (mx.float16, 8, 128, 3, 2, 384, 64, 64), (mx.bfloat16, 4, 64, 4, 1, 256, 70, 128),
    (mx.float32, 2, 32, 1, 1, 256, 0, 1), (mx.float16, 4, 64, 4, 1, 0, 40, 40),
]


@pytest.mark.parametrize("shape", _SHAPES, ids=lambda s: "-".join(map(str, s[1:])))
def test_knobs_left_at_none_are_the_dispatchers_launches(recorded, shape):
    """kernels_extra.attention with no knob makes exactly the runtime's launches, for every
    dispatched kernel on CUDA and the Metal twin; poison only adds NaN initial values."""
    dtype, bits, G, R, B, n_kq, n_kres, n_vres = shape
    args, _, _ = tk.make_case(B=B, H=2, R=R, bits=bits, G=G, n_kq=n_kq, n_kres=n_kres,
                              n_vres=n_vres, dtype=dtype)
    kw = tk._kw(128, bits, G)
    for algo in ("simt", "folded", "frag", None):
        if algo and not kd.kernel_supports(128, R, bits, G, dtype, algo=algo):
            continue
        kd.kivi_decode_attention_cuda(*args, **kw, algo=algo)
        runtime = _calls(recorded)
        recorded.clear()
        kx.attention(*args, **kw, algo=algo)
        assert _calls(recorded) == runtime
        recorded.clear()
        kx.attention(*args, **kw, algo=algo, poison=True)
        poisoned = _calls(recorded)
        recorded.clear()
        assert [c[:-1] for c in poisoned] == [c[:-1] for c in runtime]
        assert [c[-1] for c in poisoned] == ["nan", "nan"]
        assert [c[-1] for c in runtime] == ["None", "None"]
    kd.kivi_decode_attention_metal(*args, **kw)
    runtime = _calls(recorded)
    recorded.clear()
    kx.attention(*args, **kw, backend="metal")
    assert _calls(recorded) == runtime and _untagged(recorded[0]) == "vq_kivi_decode"


def test_knobs_reach_the_launch(recorded):
    args, _, _ = tk.make_case(B=1, H=2, R=4, bits=4, G=64, n_kq=1024, n_kres=37, n_vres=131)
    kw = tk._kw(128, 4, 64)

    def launch(**knobs):
        recorded.clear()
        kx.attention(*args, **kw, **knobs)
        main, merge = recorded
        assert _untagged(merge) == "vq_kivi_decode_combine"
        return _untagged(main), dict(main["template"]), main["grid"], main["source"]

    name, t, grid, source = launch(algo="mma", chunk=512, target_blocks=4,
                                   variant=(4, 16, 8), mode=1)
    assert name == "vq_kivi_decode_mma" and source == kx.CUDA_MMA_SOURCE
    assert (t["CHUNK"], t["TW"], t["KUNROLL"], t["VUNROLL"], t["MODE"]) == (512, 4, 16, 8, 1)
    assert grid[0] == 2 * kd._NT  # 3 chunks of 512 over 2 blocks a kv head (2 kv heads)
    name, t, _, _ = launch(algo="simt", variant=(4, 8, 8), mode=2)
    assert name == "vq_kivi_decode" and (t["TW"], t["MODE"], t["CHUNK"]) == (4, 2, 256)
    name, t, _, _ = launch(algo="folded", chunk=64, target_blocks=8)
    assert name == "vq_kivi_decode_folded" and t["CHUNK"] == 64 and "MODE" not in t
    name, t, grid, _ = launch(algo="frag", keep=3, tail_first=False, min_blocks=5,
                              target_blocks=4)
    assert name == "vq_kivi_decode_frag_mb5" and (t["KEEP"], t["TAIL_FIRST"]) == (3, False)
    assert recorded[0]["header"] == kd.cuda_header(5) and grid[0] == 2 * kd.FRAG_NT
    name, t, _, _ = launch(algo="frag")
    assert name == f"vq_kivi_decode_frag_mb{kd.FRAG_MIN_BLOCKS}"
    assert (t["KEEP"], t["TAIL_FIRST"]) == (kd.FRAG_KEEP_OFFSET, False)  # tail: own blocks
    with pytest.raises(ValueError, match="stage-skipping"):
        kx.attention(*args, **kw, algo="folded", mode=1)
    with pytest.raises(ValueError, match="stage-skipping"):
        kx.attention(*args, **kw, algo="frag", mode=1)
    with pytest.raises(ValueError, match="does not handle"):
        kx.attention(*args, **kw, algo="simt", chunk=96)
    with pytest.raises(ValueError, match="Metal twin"):
        kx.attention(*args, **kw, algo="mma", backend="metal")


def test_frag_stamped_launch_adds_its_outputs(recorded):
    """frag_call with extra outputs (the timelines' stamps): the partials first, the same
    launch otherwise; (outputs, blocks per kv head, first tail block, tail chunks)."""
    args, _, _ = tk.make_case(B=1, H=2, R=4, bits=4, G=64, n_kq=1024, n_kres=37, n_vres=131)
    cache = args[1:]
    kernel = kx.main_kernel("cuda", "frag", 6)
    plain = kx.frag_call(kernel, args[0], cache, scale=0.1, bits=4, group_size=64)
    outs, ns, tail0, ns_tail = kx.frag_call(
        kernel, args[0], cache, scale=0.1, bits=4, group_size=64,
        extra_outputs=lambda ns: [((2 * ns * 4,), mx.uint64)])
    assert plain[1:] == (ns, tail0, ns_tail) and len(plain[0]) == 2 and len(outs) == 3
    assert outs[2].shape == (2 * ns * 4,) and outs[2].dtype == mx.uint64
    first, second = _calls(recorded)
    assert first[:6] == second[:6] and first[8] == second[8]
    assert second[6][:2] == first[6] and second[6][2] == (2 * ns * 4,)


def test_keep_follows_the_dispatchers_rule():
    """A KEEP of one's own replaces FRAG_KEEP_OFFSET: still exact codes past
    FRAG_KEEP_MAX_TILES tiles a block (as the benchmarks' old module-global override)."""
    def keep(T, value):
        _, _, template, _, _ = kx.frag_launch_args(
            mx.float16, 128, 4, 4, 64, 4, T - 64, 64, T - 128, 128, 64, 0.1, None, value)
        return dict(template)["KEEP"]

    assert keep(131072, 3) == 3 and keep(131072, None) == kd.FRAG_KEEP_OFFSET
    assert keep(262144, 3) == 0 and keep(262144, None) == 0


def test_with_template_keeps_the_order_and_refuses_unknown_names():
    t = [("T", mx.float16), ("BITS", 4), ("MODE", 0)]
    assert kx.with_template(t, MODE=2) == [("T", mx.float16), ("BITS", 4), ("MODE", 2)]
    assert kx.with_template(t) == t
    with pytest.raises(ValueError, match="KEEP"):
        kx.with_template(t, KEEP=1)


def test_supports_is_the_runtimes_at_its_defaults():
    for (bits, G, R), dtype, D, algo in itertools.product(
            tk._GRID, (mx.float16, mx.bfloat16, mx.float32), (64, 96, 128, 192, 256),
            ("simt", "folded", "frag")):
        assert kx.supports(D, R, bits, G, dtype, algo=algo) == kd.kernel_supports(
            D, R, bits, G, dtype, algo=algo), (bits, G, R, dtype, D, algo)
    assert not kx.supports(128, 16, 4, 64, mx.float16, algo="mma")  # GQA above 8
    assert not kx.supports(128, 4, 4, 64, mx.float16, chunk=96, algo="simt")
    assert not kx.supports(128, 4, 4, 64, mx.float16, tw=16, algo="simt")


def test_mma_support_and_chunks():
    for bits, G, R in tk._GRID:
        assert kx.supports(128, R, bits, G, mx.float16, algo="mma")
    # a key super-tile is 8 words: 4 a chunk
    assert [kx.default_chunk("mma", b) for b in (2, 4, 8)] == [512, 256, 256]
    assert kx.default_chunk("folded", 8) == 64 and kx.default_chunk("simt", 2) == 256


def test_packed_bytes_read():
    assert kx.packed_bytes_read(1, 8, 32, 128, 32768, 0, 32768, 0, 4, 64) == (
        2 * 8 * 32768 * (128 // 2 + 2 * 2 * 2) + 32 * 128 * 2)


def test_mma_kernel_matches_reference_on_cuda():
    if not tk._cuda_available():
        pytest.skip("SKIPPED LOUDLY: MLX's CUDA back-end is not available here "
                    "(mx.cuda.is_available() is False); the benchmarks' mma kernel is NOT "
                    "exercised. Run benchmarks/fused_attention.py on an NVIDIA GPU.")
    tk._run_gpu_cases("cuda", ("mma",))


# ----------------------------------------------------------------------------------
# the benchmark scripts import and parse their arguments
# ----------------------------------------------------------------------------------


_SCRIPTS = sorted(p.name for p in BENCHMARKS.glob("*.py")
                  if 'if __name__ == "__main__":' in p.read_text())

# Every script run as ``script --help`` in one process (a process each cost ~2.4 s of
# imports, 42 times): its exit code, what it printed, and the end of any traceback.
_HELP_DRIVER = r"""
import contextlib, io, json, runpy, sys, traceback
out = {}
for path in sys.argv[1:]:
    sys.argv, printed = [path, "--help"], io.StringIO()
    code, error = None, ""
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(path, run_name="__main__")
    except SystemExit as stop:
        code = stop.code or 0
    except BaseException:
        code, error = "raised", traceback.format_exc()[-3000:]
    out[path] = [code, printed.getvalue(), error]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def helped():
    r = subprocess.run([sys.executable, "-c", _HELP_DRIVER, *(str(BENCHMARKS / s) for s in _SCRIPTS)],
                       capture_output=True, text=True, timeout=600, cwd=tk.ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", _SCRIPTS)
def test_benchmark_script_parses_its_arguments(script, helped):
    code, printed, error = helped[str(BENCHMARKS / script)]
    assert code == 0, error or printed[-3000:]
    assert "usage:" in printed
