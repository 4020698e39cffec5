"""What broke for users: saved caches in a fresh process, the server's copies of caches."""

import json
import subprocess
import sys
import textwrap

import mlx.core as mx
from mlx_lm.models.cache import save_prompt_cache

from test_methods_exactness import run
from tiny_models import prompt, tiny_model
from veloxquant_mlx import KVCacheConfig, make_prompt_cache

KIVI = KVCacheConfig(method="kivi", kv_bits=4, residual_window=64)


def _fresh_process(code: str) -> dict:
    """Run ``code`` in a new interpreter (nothing of ours imported); it prints one JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
        timeout=300, cwd=__file__.rsplit("/", 1)[0],
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_saved_cache_loads_after_importing_the_package_and_decodes_right_unpatched(tmp_path):
    """Before: KeyError 'KIVICache' in load_prompt_cache; with the module imported and the
    model unpatched, a first decode step silently off by ~15 in the logits."""
    model = tiny_model("llama")
    tokens = prompt(150)
    cache = make_prompt_cache(model, KIVI)
    run(model, cache, tokens, decode=0)
    path = tmp_path / "kivi.safetensors"
    save_prompt_cache(str(path), cache)
    nxt = mx.array([[7]])
    expected = model(nxt, cache=cache)[0, -1]
    out = _fresh_process(f"""
        import json, mlx.core as mx, veloxquant_mlx
        from mlx_lm.models.cache import load_prompt_cache
        from tiny_models import tiny_model
        model = tiny_model("llama")
        cache = load_prompt_cache({str(path)!r})
        logits = model(mx.array([[7]]), cache=cache)[0, -1]
        print(json.dumps({{"cls": type(cache[0]).__name__, "logits": logits.tolist()}}))
    """)
    assert out["cls"] == "KIVICache"
    assert mx.allclose(mx.array(out["logits"]), expected, atol=1e-4)
