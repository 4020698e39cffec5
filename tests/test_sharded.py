"""Models that mlx-lm shards across processes (issue 33).

The launch tests run tests/sharded_run.py in two processes on loopback (MLX's ring
back-end on the CPU) and hold each method's greedy tokens, on the sharded model, equal to
the same model's in one process. The others check, in this process, what mlx-lm's pipeline
code does to a cache and how a layout that splits a layer group is refused.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys

import veloxquant_mlx  # noqa: F401
import mlx.core as mx
import pytest

from conformance import config, profile
from tiny_models import prompt, tiny_model
from veloxquant_mlx.integrations.mlx_lm import make_prompt_cache
from veloxquant_mlx.registry import METHODS

HERE = os.path.dirname(os.path.abspath(__file__))
LAUNCH = os.path.join(os.path.dirname(sys.executable), "mlx.launch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(tmp_path, modes: str, timeout: int) -> dict:
    if not (os.path.exists(LAUNCH) and mx.distributed.is_available()):
        pytest.skip(f"no mlx.launch next to {sys.executable} or no distributed back-end")
    out = tmp_path / "sharded.json"
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--hosts", "127.0.0.1",
           "--starting-port", str(_free_port()), "--python", sys.executable,
           os.path.join(HERE, "sharded_run.py"), str(out), modes]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)
    assert out.exists(), f"the launch wrote nothing (rc {run.returncode}):\n{run.stderr[-3000:]}"
    return json.loads(out.read_text())


def _differences(results: dict) -> list[str]:
    return [f"{mode} {method}: one process {ref}, sharded {got}"
            for mode, by_method in results.items()
            for method, (ref, got) in by_method.items() if ref != got]


def test_pipeline_sharded_greedy_tokens_equal_one_process(tmp_path):
    results = _launch(tmp_path, "pipeline", timeout=240)
    assert len(results["pipeline"]) == 11
    assert _differences(results) == []


@pytest.mark.slow
def test_tensor_sharded_greedy_tokens_equal_one_process(tmp_path):
    results = _launch(tmp_path, "tensor", timeout=400)
    assert _differences(results) == []


# -- in one process: what mlx-lm's pipeline code does to the last cache of a stage ------------
# A rank that sends its hidden state on runs ``cache[-1].keys = mx.depends(cache[-1].keys, h)``
# (mlx_lm/models/qwen2.py); the cache sees it as code of an mlx_lm.models module.
PIPELINE_LINE = compile("cache[-1].keys = mx.depends(cache[-1].keys, h)", "<pipeline>", "exec")


def _as_model_code(cache, h):
    from veloxquant_mlx.cache.base import ends_pipeline_stage

    ends_pipeline_stage(cache[-1])  # what make_prompt_cache does on a pipelined model
    exec(PIPELINE_LINE, {"__name__": "mlx_lm.models.qwen2", "mx": mx, "cache": cache, "h": h})


@pytest.mark.parametrize("method", [m for m, info in METHODS.items() if info.implemented])
def test_pipeline_keys_dependency_leaves_every_cache_computing_the_same(method):
    """Each cache takes the pipeline's line (AttributeError or std::bad_cast before) and
    computes exactly what it computes without it."""
    model = tiny_model("qwen2")
    cfg = config(method, profile(method).compressing)
    ids = prompt(120)
    logits = []
    for with_line in (False, True):
        cache = make_prompt_cache(model, cfg)
        own = [c.__dict__.get("keys") for c in cache]
        h = model(ids[None, :-1], cache=cache)
        if with_line:
            _as_model_code(cache, h)
            assert [c.__dict__.get("keys") for c in cache] == own  # a method's own storage stays
        mx.eval([c.state for c in cache])
        logits.append(model(ids[None, -1:], cache=cache))
    assert mx.array_equal(logits[0], logits[1])


def _layout(stages, rank=0):
    from veloxquant_mlx.cache.context import ShardLayout

    return ShardLayout(stages=stages, pipeline_rank=rank, pipeline_group=object())


@pytest.mark.parametrize("method,settings,layers", [
    ("minicache", {"minicache_start_frac": 0.0}, [2, 3]),
    ("xkv", {}, [2, 3]),
    ("xquant", {}, [2, 3]),
])
def test_a_pipeline_split_through_a_layer_group_is_refused_naming_the_layers(method, settings, layers):
    from veloxquant_mlx.cache.context import ModelContext

    cfg = config(method, settings)
    # rank 0 runs layers 3-5 and rank 1 layers 0-2: the group (2, 3) crosses the boundary
    ctx = ModelContext(cfg, 6, tuple(range(6)), shard=_layout(((3, 6), (0, 3))))
    cache = METHODS[method].load_implementation()(cfg, ctx, 3)
    with pytest.raises(ValueError) as err:
        cache.check_layout()
    assert str(err.value) == (
        f"method {method!r}: shares what it keeps across layers {layers} together, but the "
        "pipeline puts them on different ranks (rank 0: layers 3-5, rank 1: layers 0-2); "
        "allowed: layouts that keep each group on one rank: pass split= (layers per rank, "
        "rank 0 first, rank 0 running the last layers) to model.model.pipeline(group, split) "
        "so that no group crosses a boundary (now split=[3, 3])")
    ctx = ModelContext(cfg, 6, tuple(range(6)), shard=_layout(((2, 6), (0, 2))))
    METHODS[method].load_implementation()(cfg, ctx, 3).check_layout()  # split [4, 2]: accepted


def test_chunkkv_reuse_group_split_by_the_pipeline_is_refused():
    from veloxquant_mlx.cache.context import ModelContext

    cfg = config("chunkkv", {"chunkkv_budget": 48, "chunkkv_reuse_layers": 2})
    ctx = ModelContext(cfg, 4, tuple(range(4)), shard=_layout(((1, 4), (0, 1))))
    with pytest.raises(ValueError, match=r"layers \[0, 1\] together, but the pipeline"):
        METHODS["chunkkv"].load_implementation()(cfg, ctx, 1)



def test_a_sharded_prompt_cache_deep_copies_sharing_its_distributed_group():
    """mlx-lm's server deep-copies prompt caches; a group cannot be copied (TypeError before)."""
    import copy

    from veloxquant_mlx.cache.context import ShardLayout

    model = tiny_model("qwen2")
    cache = make_prompt_cache(model, config("snapkv", profile("snapkv").compressing))
    group = mx.distributed.init()
    cache[0].context.shard = ShardLayout(stages=((0, 2),), tensor_group=group)
    model(prompt(60)[None], cache=cache)
    copied = copy.deepcopy(cache)
    assert copied[0].context is not cache[0].context and copied[0].context is copied[1].context
    assert copied[0].context.shard.tensor_group is group
    assert mx.array_equal(copied[0].state["arrays"]["keys"], cache[0].state["arrays"]["keys"])
