"""Equality of two computations that the math makes equal, where a CPU may round them apart."""

import mlx.core as mx
import numpy as np

# spectral's logits and rows, equal bit for bit on the Intel CPUs where its tests were
# written, come apart by an ulp or a few on an AMD EPYC (session 63): a fitted and a
# file-calibrated cache give layer 0's prompt attention an ulp apart (their graphs differ:
# the fitted one keeps moments), so layer 1's keys differ by an ulp in 2% of their entries;
# a saved and reloaded cache reads the same rows in other layouts (OpenBLAS picks its
# kernels by CPU and shape). Nothing grows with the steps.
SPECTRAL_ULPS = 8


def assert_same_logits(a, b, ulps: int = 0):
    """Equal bit for bit, or (``ulps``) within that many float32 ulps of ``a``'s largest
    magnitude."""
    if ulps == 0:
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())
        return
    bound = ulps * np.finfo(np.float32).eps * mx.abs(a).max().item()
    assert mx.abs(a - b).max().item() <= bound, (float(mx.abs(a - b).max()), bound)
