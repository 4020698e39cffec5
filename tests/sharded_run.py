"""Greedy generation on a model sharded by mlx-lm, against one process (tests/test_sharded.py).

Run by ``mlx.launch -n 2 --backend ring --hosts 127.0.0.1 tests/sharded_run.py OUT [MODES [METHODS]]``
(comma-separated; modes ``pipeline``, ``tensor``).
Every rank builds the same tiny 4-layer qwen2 (same seed); rank 0 also runs each method
unsharded for the reference. Then, in one launch, each method runs on the model
pipeline-sharded (rank 1 runs layers 0-1, rank 0 layers 2-3: every cross-layer pair in one
rank) and tensor-sharded (one KV head a rank). Rank 0 writes {mode: {method: [reference,
sharded]}} as JSON to OUT. Prompt chunks of 64 tokens: mlx-lm evaluates only the caches'
state between chunks, which is what must carry the pipeline's send.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import veloxquant_mlx  # noqa: F401  (before mlx: registers the caches)
import mlx.core as mx
from mlx_lm.generate import generate_step

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conformance import config, profile  # noqa: E402
from tiny_models import char_tokenizer, prompt, tiny_model  # noqa: E402

from veloxquant_mlx.integrations.mlx_lm import make_prompt_cache, prefill_with_reconstruction  # noqa: E402

# One method of each base, then every method whose layers share or rank across layers.
METHODS = ["full", "snapkv", "kivi", "palu", "minicache", "xkv", "xquant", "kvzip", "squeeze",
           "pyramidkv", "chunkkv"]
EXTRA = {"chunkkv": {"chunkkv_reuse_layers": 2}, "squeeze": {"squeeze_strength": 1.0}}
TOKENS, CHUNK, LAYERS, PROMPT = 3, 64, 4, 100


def build():
    return tiny_model("qwen2", num_hidden_layers=LAYERS)


def greedy(model, method: str) -> list[int]:
    cfg = config(method, {**profile(method).compressing, **EXTRA.get(method, {})})
    cache = make_prompt_cache(model, cfg)
    ids = prompt(PROMPT)
    if method == "kvzip":  # its own prefill: the reconstruction pass and the global ranking
        prefill_with_reconstruction(model, char_tokenizer(), ids.tolist()[:-1], cache, prefill_step_size=CHUNK)
        ids = ids[-1:]
    steps = generate_step(ids, model, prompt_cache=cache, prefill_step_size=CHUNK)
    return [int(t) for t, _ in (next(steps) for _ in range(TOKENS))]


def main() -> None:
    faulthandler.enable()  # a crash inside a collective then names its line
    out = sys.argv[1]
    modes = sys.argv[2].split(",") if len(sys.argv) > 2 else ["pipeline", "tensor"]
    methods = sys.argv[3].split(",") if len(sys.argv) > 3 else METHODS
    group = mx.distributed.init()
    assert group.size() == 2, f"run under mlx.launch -n 2 (group size {group.size()})"
    reference = {m: greedy(build(), m) for m in methods} if group.rank() == 0 else {}
    results = {}
    for mode in modes:
        model = build()
        if mode == "pipeline":
            model.model.pipeline(group)
        else:
            model.shard(group)
        mx.eval(model.parameters())
        results[mode] = {}
        for m in methods:
            try:
                got = greedy(model, m)
            except Exception as exc:  # noqa: BLE001  (reported, with the method, by the test)
                got = f"{type(exc).__name__}: {exc}"
            results[mode][m] = [reference.get(m), got]
    if group.rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main()
