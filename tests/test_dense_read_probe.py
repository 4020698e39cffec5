"""The device probe ``benchmarks/dense_read.py`` (issue 30) times what its stores compute: a
packed store's decode step read as its decoded history + one fused SDPA gives the store's
own read to float32 rounding, for whole and lean (group-affine) patches alike, and the
patches are undone between methods."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def _probe():
    spec = importlib.util.spec_from_file_location("dense_read_probe", ROOT / "benchmarks" / "dense_read.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_dense_read_gives_each_stores_own_read(capsys):
    probe = _probe()
    assert probe._check(["kivi-4bit", "kitty", "palu"], context=160, steps=40) == 0
    printed = capsys.readouterr().out
    # each method's patched run read differently (not 0: the patch was in place) and within bounds
    for line in printed.splitlines():
        err = float(line.split("difference ")[1].split()[0])
        assert 0 < err < 1e-4, line
    # no store class keeps the patch after the check
    from veloxquant_mlx.quant.store import PackedStore

    assert all(c.__dict__.get("decode_attention") is not probe._dense_decode
               for c in [PackedStore, *probe._subclasses(PackedStore)])


def test_the_lean_read_serves_group_affine_parts_only():
    probe = _probe()
    from veloxquant_mlx.kernels import decode
    from veloxquant_mlx.quant import store

    original = decode.decode_attention
    patched = probe.install_lean()
    try:
        assert "veloxquant_mlx.quant.store" in patched and store.decode_attention is not original
        _lean_equals_own(store.decode_attention, original)
    finally:
        probe.uninstall_lean()
    # every module has the function of record again (a patch left behind would change the
    # reads of every later test in this process)
    assert all(getattr(sys.modules[name], "decode_attention") is original for name in patched)


def _lean_equals_own(lean_read, original):
    import mlx.core as mx

    from veloxquant_mlx.kernels.decode import DecodePart
    from veloxquant_mlx.quant.packed import AffineLayout

    mx.random.seed(0)
    k, v = mx.random.normal((1, 2, 70, 64)), mx.random.normal((1, 2, 70, 64))
    kc, ks, kb = mx.quantize(k[:, :, :64].swapaxes(-1, -2), group_size=32, bits=4)
    vc, vs, vb = mx.quantize(v[:, :, :64], group_size=32, bits=4)
    part = DecodePart(AffineLayout(kc, ks, kb, 64, 4, 32, "channel"), k[:, :, 64:],
                      AffineLayout(vc, vs, vb, 64, 4, 32, "token"), v[:, :, 64:])
    q = mx.random.normal((1, 4, 1, 64))
    lean = lean_read(q, [part], scale=0.125, use_kernel=False)
    own = original(q, [part], scale=0.125, use_kernel=False)
    assert 0 < mx.abs(lean - own).max().item() < 1e-5  # another computation, the same read
