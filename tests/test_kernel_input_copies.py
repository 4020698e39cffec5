"""No custom-kernel launch or fused attention of any method gets an input that MLX would copy
first (``benchmarks/kernel_input_copies.py``): on CUDA such a copy is no node of the step's graph
(the census does not see it), a pass over the input at each launch (a store's history in a
decode step) and a buffer kept until the command buffer ends (session 82's fused prompt-mass
kernels copied a store's keys, 64 MiB a launch at 32k)."""

from __future__ import annotations

import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (before mlx)
import mlx.core as mx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import kernel_input_copies as kic  # noqa: E402
from veloxquant_mlx.kernels.names import source_tagged  # noqa: E402
from veloxquant_mlx.registry import implemented_methods  # noqa: E402


def test_the_recorder_sees_a_view_that_would_be_copied():
    recorder = kic.Recorder()
    buffer = mx.zeros((1, 2, 10, 4), mx.float16)
    for contiguous in (True, False):
        launch = recorder.factory(name=f"k{contiguous}", input_names=["x", "y"], ensure_row_contiguous=contiguous)
        launch(inputs=[buffer[:, :, :5], buffer], output_shapes=[(1,)], output_dtypes=[mx.float32])
    launch(inputs=[buffer.swapaxes(2, 3), mx.broadcast_to(buffer[:, :1], (1, 2, 10, 4))], output_shapes=[(1,)],
           output_dtypes=[mx.float32])
    # the whole buffer is no copy; a view of its rows, a transpose and a broadcast are, and a
    # kernel that reads strides (ensure_row_contiguous=False) copies nothing
    assert dict(recorder.copies["prefill"]) == {("kTrue", "x", (1, 2, 5, 4)): [1, 80]}
    assert kic.row_contiguous(buffer.swapaxes(2, 3)) is False
    assert kic.row_contiguous(mx.broadcast_to(buffer[:, :1], (1, 2, 10, 4))) is False
    assert kic.row_contiguous(buffer[:1, :, :3].astype(mx.bfloat16)) is True


@pytest.mark.filterwarnings("ignore")  # a launch node's values are wrong: qfilters' retention warns
@pytest.mark.parametrize("method", implemented_methods())
def test_no_launch_gets_an_input_mlx_would_copy(method):
    """Every method on the tiny model (float16, so that the fused prompt-mass kernels run),
    its prompt's chunks and 44 decode steps built as on CUDA. With the keys copied as before
    session 83 (``results/h200_s83/fused_copy_switch.patch``), seven fail: h2o's and
    keyformer's prompt chunks and the prompt-end scoring of snapkv, pyramidkv, chunkkv,
    qfilters and rocketkv."""
    recorder = kic.audit(method, mx.float16)
    copied = {phase: dict(table) for phase, table in recorder.copies.items() if table}
    assert not copied, copied
    # and every kernel made is named with its text's digest (kernels/names.py)
    for name, (source, header) in recorder.kernels.items():
        assert source and name == source_tagged(name.rsplit("_", 1)[0], source, header), name


def test_attention_copies_follow_mlxs_cuda_rules():
    """``attention_copies`` reads MLX's CUDA rules: at a decode step a store's keys (rows of a
    larger buffer, two sequences) are read in place; keys whose heads are not one run apart
    from their sequences (a (B, n, H, D) buffer seen as (B, H, n, D)) or whose last axis is not
    adjacent are copied; with more than 8 queries only the last axis counts."""
    b, h, n, d = 2, 2, 5, 4
    store = mx.zeros((b, h, 9, d), mx.float16)
    q1, q9 = mx.zeros((b, 4, 1, d), mx.float16), mx.zeros((b, 4, 9, d), mx.float16)
    view = store[:, :, :n]
    assert kic.attention_copies(q1, view, view) == []
    token_major = mx.zeros((b, n, h, d), mx.float16).swapaxes(1, 2)
    assert kic.attention_copies(q1, token_major, view) == ["keys"]
    assert kic.attention_copies(q9, token_major, view) == []
    last_apart = mx.zeros((b, h, d, n), mx.float16).swapaxes(2, 3)
    assert kic.attention_copies(q1, view, last_apart) == ["values"]
    assert kic.attention_copies(q9, last_apart, view) == ["keys"]
    # the model's own queries, (B, L, H, D) seen as (B, H, L, D): read in place for one sequence
    assert kic.attention_copies(mx.zeros((1, 2, 4, d), mx.float16).swapaxes(1, 2), view[:1], view[:1]) == []
    assert kic.attention_copies(mx.zeros((b, 2, 4, d), mx.float16).swapaxes(1, 2), view, view) == ["queries"]
