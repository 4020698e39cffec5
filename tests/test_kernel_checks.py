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
