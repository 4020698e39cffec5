"""Where ``lowrank.factors.leading_basis`` spends its time (GEAR's fit at the 8B shape: 1 x 8
KV heads x ``--tokens`` x 128, k = 7), and whether orthonormalising on the device instead of
the CPU stream would pay. Medians of ``--repeats`` after one warm-up, each part evaluated
alone:

- ``leading_basis`` whole; the Gram product alone; ``gram_leading`` (the CPU-stream block)
  on an evaluated Gram made on the device, and on one made on the CPU stream (the
  difference: the Gram's move to the host); one CPU-stream ``trace`` of the device's Gram
  (a round trip with next to no work);
- two device-side experiments, not runtime code: the same subspace iteration with each
  QR replaced by Newton-Schulz steps towards the polar factor (matrix products only; the
  Ritz step's width x width eigh still on the CPU stream), and with no Ritz step at all
  (columns ordered by their Rayleigh quotients on the device). Their rank-k error against
  ``leading_basis``'s is printed with them.

    python benchmarks/leading_basis_parts.py                 # on the device
    MLX_DEFAULT_DEVICE=cpu python benchmarks/leading_basis_parts.py --tokens 512 --repeats 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx.lowrank import factors  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_mass import print_parts  # noqa: E402  (medians after one warm-up call)

NEWTON_SCHULZ_STEPS = 10


def polar(y: mx.array) -> mx.array:
    """Orthonormal columns of the span of ``y`` by Newton-Schulz steps (products only)."""
    y = y / mx.linalg.norm(y, axis=(-2, -1), keepdims=True)
    for _ in range(NEWTON_SCHULZ_STEPS):
        y = 1.5 * y - 0.5 * y @ (y.swapaxes(-1, -2) @ y)
    return y


def device_iteration(gram: mx.array, k: int, ritz: bool):
    width = min(k + factors.OVERSAMPLE, gram.shape[-1])
    v = factors._gaussian_start(gram.shape[-1], width, factors.SEED)
    for _ in range(factors.POWER_ITERATIONS):
        v = polar(gram @ v)
    if ritz:
        _, u = mx.linalg.eigh(v.swapaxes(-1, -2) @ gram @ v, stream=mx.cpu)
        return (v @ u)[..., -1:-k - 1:-1]
    quotient = ((gram @ v) * v).sum(axis=-2)
    order = mx.argsort(-quotient, axis=-1)[..., :k]
    return mx.take_along_axis(v, mx.broadcast_to(order[..., None, :], (*v.shape[:-1], k)), axis=-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    mx.random.seed(0)
    x = mx.random.normal((1, 8, args.tokens, 128))  # a nearly white residual, as GEAR's
    gram = x.swapaxes(-1, -2) @ x
    host_gram = mx.matmul(x.swapaxes(-1, -2), x, stream=mx.cpu)
    mx.eval(x, gram, host_gram)
    k = 7

    def error(v):
        return float(mx.linalg.norm(x - (x @ v) @ v.swapaxes(-1, -2)) / mx.linalg.norm(x))

    parts = {
        "leading_basis whole": lambda: factors.leading_basis(x, k),
        "Gram product alone": lambda: x.swapaxes(-1, -2) @ x,
        "gram_leading on the device's Gram (CPU stream)": lambda: factors.gram_leading(gram, k),
        "gram_leading on a Gram made on the CPU stream": lambda: factors.gram_leading(host_gram, k),
        "one CPU-stream trace of the device's Gram": lambda: mx.trace(gram, axis1=-2, axis2=-1, stream=mx.cpu),
        "device iteration (Newton-Schulz), Ritz on the CPU stream": lambda: device_iteration(gram, k, True),
        "device iteration (Newton-Schulz), no Ritz": lambda: device_iteration(gram, k, False),
    }
    print(f"{mx.default_device()}, MLX {mx.__version__}, 8 heads x {args.tokens} tokens x 128, k = {k}, "
          f"median of {args.repeats}\n")
    print_parts(parts, args.repeats)
    base = error(factors.leading_basis(x, k)[0])
    print(f"\nrank-{k} relative error: leading_basis {base:.6f}, "
          f"Newton-Schulz with Ritz {error(device_iteration(gram, k, True)):.6f}, "
          f"without {error(device_iteration(gram, k, False)):.6f}")


if __name__ == "__main__":
    main()
