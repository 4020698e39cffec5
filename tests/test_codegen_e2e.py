"""Adding a method is: edit the spec, regenerate, use it. Proven on a copy of the package."""

import json
import os
import shutil
import subprocess
import sys

from codegen.__main__ import main

NEW_METHOD = """
  - key: toy
    class: ToyOptions
    title: "Toy configuration (an example eviction method)."
    family: eviction
    category: "eviction"
    status: adapted
    checks:
      - expr: "toy_budget > toy_n_sink"
        message: "toy_budget must exceed toy_n_sink."
    fields:
      - name: toy_budget
        type: int
        default: 256
        doc: "Tokens kept per layer and KV head."
        range: "[1, inf)"
      - name: toy_n_sink
        type: int
        default: 4
        doc: "First tokens always kept."
        range: "[0, inf)"
"""

SCRIPT = r"""
import json, warnings
import veloxquant_mlx
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import ToyOptions
from veloxquant_mlx.registry import METHODS

config = KVCacheConfig(method="toy", options=ToyOptions(toy_budget=64))
errors = []
for bad in (dict(toy_budget=0), dict(toy_budget=4, toy_n_sink=4)):
    try:
        ToyOptions(**bad)
    except ValueError as exc:
        errors.append(str(exc))
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    config.toy_n_sink = 8
print(json.dumps({
    "file": veloxquant_mlx.__file__,
    "budget": config.toy_budget,
    "options": repr(config.options),
    "dict": config.to_dict(),
    "errors": errors,
    "warning": str(caught[0].message),
    "status": METHODS["toy"].status,
    "implemented": METHODS["toy"].implemented,
}))
"""


def test_add_a_method_regenerate_and_use_it(repo_root, tmp_path):
    spec = tmp_path / "methods.yaml"
    spec.write_text((repo_root / "spec" / "methods.yaml").read_text() + NEW_METHOD)
    package = tmp_path / "site" / "veloxquant_mlx"
    shutil.copytree(repo_root / "veloxquant", package, ignore=shutil.ignore_patterns("__pycache__"))
    assert main(["--spec", str(spec), "--out", str(package / "_generated")]) == 0
    assert "ToyOptions" in (package / "_generated" / "API.md").read_text()

    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["file"].startswith(str(tmp_path))  # the regenerated copy, not the checkout
    assert out["budget"] == 64
    assert out["options"] == "ToyOptions(toy_budget=64, toy_n_sink=8)"  # effective values
    assert out["dict"]["options"] == {"toy_budget": 64, "toy_n_sink": 8}
    assert out["errors"] == [
        "toy_budget=0 is out of range; allowed: int, in [1, inf), at most 2**31 - 1",
        "toy_budget must exceed toy_n_sink. (got toy_budget=4, toy_n_sink=4)",
    ]
    assert "options=ToyOptions(toy_n_sink=8)" in out["warning"]
    assert out["status"] == "adapted" and out["implemented"] is False
