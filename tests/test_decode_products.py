"""benchmarks/decode_products.py: the census of a decode step's products is taken on the
path MLX's CUDA back-end runs (the device's ``cluster_products.py --shapes`` runs them)."""

import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (before mlx)

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import decode_products  # noqa: E402


def test_the_census_takes_the_cuda_path_of_a_store_that_chooses_its_read_by_device():
    """cachegen reads its runs rebuilt in the queries' dtype under one fused attention on a
    GPU, and through float32 products over its packed codes and window on the CPU
    (``kivi_decode._pure_path``). Session 78's census stubbed only the kernels and listed the
    CPU's products (``(1, 8, 4, 128) x (1, 8, 128, n)`` float32, the window's scores); a step
    on the CUDA path builds none but the model's own one-row projections."""
    found = decode_products.census(["cachegen"], context=256, layers=1, warm=2, steps=1)["cachegen"]
    assert found, "no product recorded"
    assert all(p["a"][-2] == 1 and p["dtypes"] == ["float16", "float16"] for p in found), found
