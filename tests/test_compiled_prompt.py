"""Prompt chunks' encoders and histories compiled for each shape (``kernels/compiled.py``):
the same stored bytes and outputs as the operations one by one, fewer kernels a chunk, and
a bounded number of traces kept."""

from __future__ import annotations

import sys

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from conformance import PROMPT, config, profile
from decode_steps import graph_nodes, steps_as_on_cuda
from tiny_models import prompt, tiny_model
from veloxquant_mlx import make_prompt_cache
from veloxquant_mlx.quant import store
from veloxquant_mlx.kernels.compiled import PerShape, index_range

CHUNK = 48


def test_a_function_is_traced_once_a_shape_and_the_oldest_shapes_are_dropped():
    traced = []

    def fn(x, y=None):
        traced.append(x.shape)  # Python runs only while tracing
        return x * 2 if y is None else x * y

    f = PerShape(fn, keep=2)
    a, b, c = mx.ones((2, 3)), mx.ones((4, 3)), mx.ones((5, 3))
    for x in (a, a, b, a):
        assert mx.array_equal(f(x), x * 2).item()
    assert traced == [(2, 3), (4, 3)]
    f(c)  # b is the least recently used: dropped
    assert f.shapes == [(((2, 3), mx.float32),), (((5, 3), mx.float32),)]
    f(b)
    assert traced == [(2, 3), (4, 3), (5, 3), (4, 3)]
    f(a, mx.full((2, 3), 3.0))  # another signature: an array in place of None
    assert traced[-1] == (2, 3) and len(f.shapes) == 2


def test_the_switch_runs_the_function_uncompiled(monkeypatch):
    calls = []
    f = PerShape(lambda x: calls.append(1) or x + 1)
    monkeypatch.setenv("VQ_COMPILED_PROMPT", "0")
    for _ in range(3):
        f(mx.zeros(4))
    assert len(calls) == 3 and not f.shapes


def test_an_index_range_is_arange_held_as_a_leaf():
    r = index_range(7)
    assert r.dtype == mx.int32 and mx.array_equal(r, mx.arange(7)).item()
    x = mx.ones((3, 7), mx.int32)
    mx.eval(x)
    assert graph_nodes([x + mx.arange(7)]) == graph_nodes([x + index_range(7)]) + 1  # the arange's own node


def test_keep_must_be_positive():
    with pytest.raises(ValueError, match="keep=0"):
        PerShape(lambda x: x, keep=0)


# Kernels a prompt chunk and layer (graph nodes as MLX's CUDA back-end builds them, views
# excluded, as ``benchmarks/prefill_census.py`` counts) with the compiled passes, recorded on
# 2026-12-07 at the third chunk of CHUNK tokens. The operations one by one (VQ_COMPILED_PROMPT=0)
# were then: adakv 163.5, amc 276.5 (its history alone is compiled), cachegen 149.5, gear 196.5
# (its fit, between the passes on the CPU streams, is most of the rest), kvquant 185.5, kvtc
# 158.5, nsnquant 139.5, turboquant 105.5, vecinfer 112.5, zipcache 122.5 (its history alone is
# compiled; the chunk's scoring and classing are the rest).
KERNELS = {"adakv": 102.5, "amc": 237.5, "cachegen": 97.5, "gear": 186.5, "kvquant": 128.5, "kvtc": 91.5,
           "nsnquant": 105.5, "turboquant": 61.5, "vecinfer": 91.5, "zipcache": 118.5}
VIEWS = frozenset({"Broadcast", "Reshape", "Squeeze", "ExpandDims", "Transpose", "Flatten", "Unflatten", "Slice",
                   "AsStrided"})


def _prefill(method: str, layers: int = 2, counted: bool = False):
    """A chunked prompt then 5 decode steps: every cache array and output, evaluated (or,
    ``counted``, the kernels of the prompt's third chunk a layer, built as on CUDA)."""
    model = tiny_model("llama", num_hidden_layers=layers)
    cache = make_prompt_cache(model, config(method, profile(method).compressing))
    tokens, start, outs, kernels = prompt(PROMPT), 0, [], None
    while PROMPT - start > 1:
        stop = min(start + CHUNK, PROMPT - 1)
        out = model(tokens[start:stop][None], cache=cache)
        if counted and len(outs) == 2:
            kernels = graph_nodes([out, *_arrays([c.state for c in cache])], skip=VIEWS) / layers
        mx.eval(out, [c.state for c in cache])
        outs.append(out)
        start = stop
    if counted:
        return kernels
    for i in range(5):
        outs.append(model(tokens[i : i + 1][None], cache=cache))
    arrays = _arrays([[c.state for c in cache], outs])
    mx.eval(arrays)
    return arrays


def _arrays(tree) -> list[mx.array]:
    return [x for _, x in tree_flatten(tree) if isinstance(x, mx.array)]


@pytest.mark.parametrize("method", sorted(KERNELS))
def test_a_compiled_prompt_stores_what_the_operations_one_by_one_store(method, monkeypatch):
    monkeypatch.setenv("VQ_COMPILED_PROMPT", "0")
    plain = _prefill(method)
    monkeypatch.setenv("VQ_COMPILED_PROMPT", "1")
    compiled = _prefill(method)
    assert len(plain) == len(compiled)
    for a, b in zip(plain, compiled):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert mx.array_equal(a, b, equal_nan=True).item(), f"{method}: {a.shape} {a.dtype} differs"


@pytest.mark.parametrize("method", sorted(KERNELS))
def test_a_compiled_prompt_chunk_launches_fewer_kernels(method, monkeypatch):
    make_prompt_cache(tiny_model("llama", num_hidden_layers=1), config(method, profile(method).compressing))
    paced = store.paced
    for module in list(sys.modules.values()):  # (its modules loaded) on a "GPU" a paced layer would run mid-chunk
        if getattr(module, "__name__", "").startswith("veloxquant_mlx") and getattr(module, "paced", None) is paced:
            monkeypatch.setattr(module, "paced", lambda out: out)
    with steps_as_on_cuda():
        monkeypatch.setenv("VQ_COMPILED_PROMPT", "0")
        plain = _prefill(method, counted=True)
        monkeypatch.setenv("VQ_COMPILED_PROMPT", "1")
        compiled = _prefill(method, counted=True)
    assert compiled <= KERNELS[method] + 0.5, f"{method}: {compiled} kernels a chunk and layer (recorded {KERNELS[method]})"
    assert compiled < plain, f"{method}: {compiled} kernels compiled against {plain} one by one"
