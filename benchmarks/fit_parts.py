"""Where a prompt chunk's fit goes, part by part, on this machine's default device.

Issue 31: gear's and palu's warm prefill on the H200 is 14.5x and 6.55x fp16's at 32k
(``notes/prefill.md``). Their fits take eigendecompositions on MLX's CPU stream (MLX has no
GPU ``eigh``), each a round trip between the device and the host. This times each part
of one chunk's fit at the 8B layer's shape (1 x 8 KV heads x ``--tokens`` x 128), every
part evaluated alone, medians of ``--repeats`` after one warm-up: the Gram product, the
``eigh`` on the CPU stream (the Gram ready; 8 heads, 16 in one call, 1, and the 8 split over
2, 4 and 8 CPU streams), ``gram_basis`` whole, ``leading_basis`` at GEAR's cap of 7 directions, the outliers' sort,
GEAR's whole key and value encode at its defaults, a thin ``orthonormalize`` (power
iteration's step), and palu's ``fit_basis`` over groups of 4 heads (a 512 x 512 eigh).

    python benchmarks/fit_parts.py                        # on the device
    MLX_DEFAULT_DEVICE=cpu python benchmarks/fit_parts.py --tokens 512 --repeats 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)
import mlx.core as mx  # noqa: E402

from veloxquant_mlx.lowrank.factors import gram_basis, leading_basis, orthonormalize  # noqa: E402
from veloxquant_mlx.lowrank.latent import fit_basis  # noqa: E402
from veloxquant_mlx.methods.gear.error_feedback import ErrorFeedback  # noqa: E402
from veloxquant_mlx.quant.outliers import tail_indices  # noqa: E402
from veloxquant_mlx.quant.packed import GroupAffine  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_mass import print_parts  # noqa: E402  (medians after one warm-up call)


def _split_eigh(gram: mx.array, n: int):
    """The heads' eighs as ``n`` calls, each on a CPU stream of its own (MLX runs each stream
    on a thread of its own): whether LAPACK's problems run side by side."""
    streams = [mx.new_stream(mx.cpu) for _ in range(n)]
    heads = gram.shape[1]

    def run():
        return mx.concatenate([mx.linalg.eigh(gram[:, i * heads // n:(i + 1) * heads // n],
                                              stream=s)[1] for i, s in enumerate(streams)], axis=1)

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of the chunk")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    mx.random.seed(0)
    x = mx.random.normal((1, 8, args.tokens, 128)).astype(dtype)
    xf = x.astype(mx.float32)
    gram = xf.swapaxes(-1, -2) @ xf
    grams = mx.concatenate([gram, gram * 0.5 + mx.eye(128)], axis=1)  # keys' and values' together
    thin = mx.random.normal((1, 8, args.tokens, 12))
    grouped = mx.random.normal((1, 2, args.tokens, 512))
    mx.eval(x, xf, gram, grams, thin, grouped)
    keys = ErrorFeedback(GroupAffine(2, 32, "channel"), None, 0.9, 0.01)
    values = ErrorFeedback(GroupAffine(2, 32, "token"), None, 0.9, 0.01)
    parts = {
        "Gram product (8 x 128 x 128), float32": lambda: xf.swapaxes(-1, -2) @ xf,
        "eigh of 8 Grams of 128 on the CPU stream": lambda: mx.linalg.eigh(gram, stream=mx.cpu)[1],
        "eigh of 16 Grams of 128 on the CPU stream (one call)": lambda: mx.linalg.eigh(grams, stream=mx.cpu)[1],
        "eigh of 1 Gram of 128 on the CPU stream": lambda: mx.linalg.eigh(gram[:, :1], stream=mx.cpu)[1],
        **{f"eigh of 8 Grams over {n} CPU streams (a call each)": _split_eigh(gram, n) for n in (2, 4, 8)},
        "gram_basis (Gram, eigh, singular values)": lambda: gram_basis(xf)[0],
        "leading_basis, 7 directions (GEAR's cap; iterations on the CPU stream)": lambda: leading_basis(xf, 7),
        "outliers' sort, keys (8 x 128 channels over the tokens)": lambda: tail_indices(xf.swapaxes(-1, -2), 10),
        "outliers' sort, values (tokens x 128)": lambda: tail_indices(xf, 1),
        "GEAR encode, keys (defaults)": lambda: keys.encode(x),  # mx.eval takes the whole tree
        "GEAR encode, values (defaults)": lambda: values.encode(x),
        "orthonormalize (8 x tokens x 12)": lambda: orthonormalize(thin),
        "palu fit_basis (2 groups of 512 channels)": lambda: fit_basis(grouped, None, 0.9)[1],
    }
    print(f"{mx.default_device()}, MLX {mx.__version__}, {args.tokens} tokens, {dtype}, "
          f"median of {args.repeats}\n")
    print_parts(parts, args.repeats)


if __name__ == "__main__":
    main()
