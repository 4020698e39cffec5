"""What one operation costs the host to submit, by kind, on this machine's default device.

``benchmarks/notes/decode_host_bound.md`` found a compressed cache's decode step on the
H200 bound by the host, and most of the host's time in ``mx.async_eval``: MLX's CUDA
back-end encodes every node of the graph on the calling thread. This times that per
operation kind. Each kind is a chain of ``--ops`` dependent operations (so none is
skipped or fused), built, submitted and waited for apart; per operation: the build,
submission and wait in microseconds (medians over ``--repeats``). Kinds are the
operations a decode step is made of: small and large elementwise ops, views that launch
nothing, MLX's own matrix-vector kernel, a batched product that cuBLAS serves, the fused
attention, a compiled fused chain, ``mx.dequantize``, a slice write, a gather; a small int32 array
that a step hands over made on the host, made on the device, or a view of a device-made table
at a host index (written into a table, or added); on a GPU
also custom kernels (``mx.fast.cuda_kernel``/``metal_kernel``): a small one, the same with
its source padded to the size of the fused KIVI kernel's, and the KIVI dispatcher's two
launches (main kernel and merge) over a 4-bit cache. MLX builds a custom kernel's whole
source at every call and hashes it at every submission, so its size may cost the host.

    python benchmarks/submit_cost.py                 # on the device, after install_on_device.sh
    python benchmarks/submit_cost.py --ops 32 --repeats 2 --tokens 256   # a CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import veloxquant_mlx  # noqa: F401  (first: it may load OpenBLAS)
import mlx.core as mx  # noqa: E402


def kinds(tokens: int, dtype):
    """name -> (inputs, one operation: x -> x of the same shape and dtype)."""
    g = mx.random.normal
    q_small = (g((1, 8, 4, 128)) * 0.1).astype(dtype)
    rows = (g((1, 8, tokens, 128)) * 0.1).astype(dtype)
    w_vec = (g((4096, 4096)) * (1 / 64)).astype(dtype)
    keys = (g((1, 8, 128, tokens)) * 0.1).astype(dtype)
    back = (g((1, 8, tokens, 128)) * (1 / tokens)).astype(dtype)
    k, v = rows, rows
    packed, scales, biases = mx.quantize(rows.reshape(-1, 128), group_size=32, bits=4)
    index = mx.random.randint(0, tokens, (1, 8, tokens, 1)).astype(mx.uint32)

    @mx.compile
    def fused(x):
        return mx.maximum(x * 0.5 + 0.25, x) - mx.exp(x * 0.01) + 1.0

    def write(x):
        x[:, :, 3:4, :] = x[:, :, 5:6, :] * 0.5
        return x

    device_seven = mx.array(7, mx.int32)
    counts = mx.arange(4096, dtype=mx.int32)  # a device-made table a host counter indexes (a view)
    mx.eval(device_seven, counts)

    def host_row_write(x, row):  # the row's slot in a (1, 8, 64) int32 table, added back to x
        table = mx.zeros((1, 8, 64), mx.int32)
        table[:, :, 3:4] = row
        return x + table[:, :, :1, None].astype(x.dtype) * 0

    table = {
        "add (1x8x4x128)": (q_small, lambda x: x + 0.5),
        f"add (1x8x{tokens}x128)": (rows, lambda x: x + 0.5),
        "six views (transposes, reshapes, a broadcast)": (
            q_small, lambda x: mx.broadcast_to(x.swapaxes(2, 3).reshape(1, 8, 128, 4)[None], (1, 1, 8, 128, 4))
            .reshape(1, 8, 128, 4).swapaxes(2, 3)),
        "matrix-vector (1x4096 @ 4096x4096)": (g((1, 4096)).astype(dtype), lambda x: (x @ w_vec) * 0.5),
        f"batched product (8x4x128 @ 8x128x{tokens}, back)": (q_small, lambda x: (x @ keys) @ back),
        f"fused attention (32 heads over {tokens} rows)": (
            q_small.reshape(1, 32, 1, 128),
            lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=0.088)),
        "compiled elementwise chain (6 ops)": (q_small, fused),
        f"dequantize 4-bit ({tokens}x8 rows of 128), added": (
            rows, lambda x: x + mx.dequantize(packed, scales, biases, group_size=32, bits=4)
            .reshape(rows.shape).astype(dtype)),
        "slice write": (rows, write),
        # an eviction step wrote its token's position from such an array (session 82: 0.71-0.92x
        # -> 0.90-1.06x KVCache at 4k without it); which of the two costs mattered was not timed
        "slice write of a host-made (1x8x1) int32 array": (
            rows, lambda x: host_row_write(x, mx.array([[[7]] * 8], mx.int32))),
        "slice write of a device-made (1x8x1) int32 array": (
            rows, lambda x: host_row_write(x, mx.broadcast_to(device_seven, (1, 8, 1)))),
        "slice write of a view of a device-made table at a host index": (
            rows, lambda x: host_row_write(x, mx.broadcast_to(counts[7:8].reshape(1, 1, 1), (1, 8, 1)))),
        "add a host-made scalar (mx.array(7))": (q_small, lambda x: x + mx.array(7, dtype)),
        "add a view of a device-made table at a host index": (q_small, lambda x: x + counts[7].astype(dtype)),
        f"gather along the tokens ({tokens})": (rows, lambda x: mx.take_along_axis(x, index, axis=2) + x),
    }
    table.update(custom_kernel_kinds(tokens, dtype))
    return table


#: the small custom kernel: out = x * 0.5 + 0.25, one thread an element
_SMALL_SOURCE = """
    unsigned int i = blockIdx.x * blockDim.x + threadIdx.x;
    out[i] = x[i] * static_cast<T>(0.5) + static_cast<T>(0.25);
"""
_SMALL_SOURCE_METAL = """
    uint i = thread_position_in_grid.x;
    out[i] = x[i] * static_cast<T>(0.5) + static_cast<T>(0.25);
"""


def custom_kernel_kinds(tokens: int, dtype) -> dict:
    """The custom-kernel kinds, on a GPU back-end only (none on the CPU)."""
    from veloxquant_mlx.kernels import kivi_decode as kd

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import fused_attention  # noqa: E402  (its KIVI-layout cache builder)

    backend = kd.gpu_backend()
    if backend is None:
        return {}
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    small = _SMALL_SOURCE if backend == "cuda" else _SMALL_SOURCE_METAL
    fused_size = len(kd.cuda_header(kd.FRAG_MIN_BLOCKS)) + len(kd.CUDA_FRAG_SOURCE)
    padding = "// padding\n" * (fused_size // len("// padding\n"))

    def kernel(source, name):
        k = make(name=name, input_names=["x"], output_names=["out"], source=source)
        return lambda x: k(inputs=[x], template=[("T", x.dtype)], grid=(x.size, 1, 1),
                           threadgroup=(min(x.size, 256), 1, 1), output_shapes=[x.shape],
                           output_dtypes=[x.dtype])[0]

    q = (mx.random.normal((1, 32, 1, 128)) * 0.1).astype(dtype)
    table = {
        f"custom kernel, {len(small)} B of source (1x32x1x128)": (q, kernel(small, "vq_submit_small")),
        f"custom kernel, {len(small) + len(padding)} B of source": (
            q, kernel(padding + small, "vq_submit_padded")),
    }
    if dtype == mx.float16:
        g = mx.random.normal
        K, V = ((g((1, 8, tokens, 128)) * 0.5).astype(dtype) for _ in range(2))
        cache = fused_attention.make_cache(K, V, 64, 128, 4, 32, spare=False)
        mx.eval(*[a for a in cache if isinstance(a, mx.array)])
        table[f"KIVI dispatcher, 4-bit, {tokens} tokens (main kernel + merge)"] = (
            q, lambda x: kd.kivi_decode_attention(x, *cache, scale=128 ** -0.5, bits=4,
                                                  group_size=32))
    return table


def build_submit_wait(build):
    """Run ``build()`` (it returns the arrays of a lazy graph), submit its result
    (``mx.async_eval``) and wait for it: (result, (build s, submit s, wait s))."""
    t0 = time.perf_counter()
    out = build()
    t1 = time.perf_counter()
    mx.async_eval(out)
    t2 = time.perf_counter()
    mx.eval(out)
    return out, (t1 - t0, t2 - t1, time.perf_counter() - t2)


def medians(parts, per: float = 1.0) -> list[float]:
    """The median of each part over ``parts`` ((build, submit, wait) tuples), times ``per``."""
    return [statistics.median(p[i] for p in parts) * per for i in range(3)]


def time_chain(x, op, n_ops, repeats):
    def chain():
        y = x
        for _ in range(n_ops):
            y = op(y)
        return y

    mx.eval(op(x))  # first use: compilation, kernel loading
    mx.eval(x)
    return medians([build_submit_wait(chain)[1] for _ in range(repeats)], 1e6 / n_ops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", type=int, default=256, help="dependent operations in a chain")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--out")
    args = ap.parse_args()
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.float16
    rows = []
    for name, (x, op) in kinds(args.tokens, dtype).items():
        build, submit, wait = time_chain(x, op, args.ops, args.repeats)
        rows.append({"kind": name, "build_us": build, "submit_us": submit, "wait_us": wait})
        print(f"{name:52s} build {build:7.2f}  submit {submit:7.2f}  wait {wait:8.2f} us an op", flush=True)
    print(f"\n{mx.default_device()}, MLX {mx.__version__}, {args.ops} dependent ops a chain, "
          f"median of {args.repeats}\n")
    print("| operation | build us | submit us | wait us (device, after submission) |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['build_us']:.2f} | {r['submit_us']:.2f} | {r['wait_us']:.2f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"mlx": mx.__version__, "device": str(mx.default_device()), "ops": args.ops,
                       "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
