"""``kernels/checks.py``: the self-check the row kernels make once a process."""

from __future__ import annotations

import pytest

import veloxquant_mlx  # noqa: F401  (before mlx binds its CPU BLAS)
from veloxquant_mlx.kernels import checks
from veloxquant_mlx.kernels import kivi_decode as kd


def test_a_failed_check_warns_once_and_keeps_the_answer(monkeypatch):
    monkeypatch.setattr(kd, "_gpu_kind", lambda: "cuda")
    table, asked = {}, []

    def problem():
        asked.append(1)
        return "rows differ"

    with pytest.warns(RuntimeWarning, match="the cuda row kernel failed its self-check: rows differ; the MLX ops run"):
        assert not checks.checked_once(table, "cuda", ("k",), problem, "row kernel", "the MLX ops run")
    assert not checks.checked_once(table, "cuda", ("k",), problem, "row kernel", "the MLX ops run")
    assert asked == [1]
    assert checks.checked_once(table, "cuda", ("other",), lambda: None, "row kernel", "-")


def test_a_process_on_another_back_end_asks_nothing(monkeypatch):
    monkeypatch.setattr(kd, "_gpu_kind", lambda: None)
    table = {}
    assert not checks.checked_once(table, "cuda", ("k",), lambda: pytest.fail("asked"), "row kernel", "-")
    assert table == {}


def test_a_kernel_is_named_with_its_text(monkeypatch):
    """MLX's CUDA back-end keeps compiled kernels by name (on disk, across processes): a
    changed source or header under one name must not meet the old compiled code."""
    from veloxquant_mlx.kernels.names import source_tagged

    made = []
    monkeypatch.setattr(checks.mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw["name"])
    checks.gpu_kernel.cache_clear()
    try:
        names = [checks.gpu_kernel("cuda", "vq_x", ("a",), ("b",), (src, "metal"), (head, ""))
                 for src, head in (("s1", "h"), ("s2", "h"), ("s1", "h2"), ("s1", "h"))]
    finally:
        checks.gpu_kernel.cache_clear()
    assert len(set(names)) == 3 and names[0] == names[3] and len(made) == 3
    assert all(n.startswith("vq_x_") and len(n) == len("vq_x_") + 12 for n in names)
    assert names[1] == source_tagged("vq_x", "s2", "h") and made[1]["source"] == "s2"
