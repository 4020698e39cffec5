"""Probe (issue 30): every packed store's decode step as its whole history decoded in the
query dtype, then one ``mx.fast.scaled_dot_product_attention`` (the fp16 cache's kernel).

Does a GPU step spend less device time decoding the history to float16 rows and handing
them to the fused attention than it does in the stores' own float32 reads (scores per
part, one softmax, each part's mix)? Installed into a process by ``install()`` (the
device runs import it from sitecustomize when ``VQ_DENSE_READ=1``); ``benchmarks/decode.py``
then times the methods as usual. What the patch leaves out, so the figures are a bound on
this read's device time, not a method: a store's own decode-time bookkeeping in its
``decode_attention`` (zipcache's saliency, a skvq window's sink logic). Each layer's
history is decoded only once its queries exist (``PackedStore.history_after``), as kitty's
CUDA read does, so that MLX does not hold several layers' decoded rows at once.

    VQ_DENSE_READ=1 python benchmarks/decode.py --preset llama3-8b --contexts 4096 --isolate \
        --methods "mlx-lm KVCache" kitty skvq
    python benchmarks/dense_read.py [METHOD ...]   # CPU check: the patched read against the stores' own
"""

from __future__ import annotations

import os

import veloxquant_mlx  # noqa: F401  (before mlx: the system BLAS)
import mlx.core as mx

from veloxquant_mlx.quant.store import PackedStore


def _dense_decode(self, queries, keys, values, *, scale, use_kernel):
    # a store that attends before it flushes (KIVI's order) reads the step's rows exact
    then_flush = getattr(self, "attend_then_flush", False) and (self.window or self.sliding_keys)
    if then_flush:
        self.k_win.append(keys)
        self.v_win.append(values)
    else:
        self.commit(keys, values)
    k, v = self.history_after(queries.dtype, queries)
    out = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)
    if then_flush:
        self._flush_windows()
    return out


def _subclasses(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)


def install() -> list[str]:
    """Every ``PackedStore`` subclass's ``decode_attention`` replaced; their names."""
    import veloxquant_mlx.methods  # noqa: F401  (every room's store classes defined)

    patched = []
    for cls in [PackedStore, *_subclasses(PackedStore)]:
        cls.decode_attention = _dense_decode
        patched.append(cls.__name__)
    return patched


def _affine_rows(layout, tail, dtype) -> list:
    """A part's keys or values as (B, H, n, D) rows: its packed run dequantized in one
    ``mx.dequantize``, then its full-precision tail."""
    rows = []
    if layout is not None and layout.count:
        x = mx.dequantize(layout.codes, layout.scales, layout.biases, group_size=layout.group, bits=layout.bits)
        x = x[..., :layout.count].swapaxes(-1, -2) if layout.axis == "channel" else x[:, :, :layout.count]
        rows.append(x.astype(dtype))
    if tail is not None and tail.shape[2]:
        rows.append(tail.astype(dtype))
    return rows


def _lean(original):
    """``kernels/decode.decode_attention`` reading parts that are all group-affine (KIVI's
    layouts) as their rows dequantized by ``mx.dequantize`` + one fused SDPA; other parts as before."""
    from veloxquant_mlx.quant.packed import AffineLayout

    def affine(layout):
        return layout is None or (isinstance(layout, AffineLayout) and layout.bits in (2, 4, 8))

    def decode_attention(queries, parts, *, scale, use_kernel=True, n_kv_heads=None):
        parts = [p for p in parts if p.length]
        if not parts or any(p.heads is not None or not (affine(p.keys) and affine(p.values)) for p in parts):
            return original(queries, parts, scale=scale, use_kernel=use_kernel, n_kv_heads=n_kv_heads)
        ks, vs = [], []
        for p in parts:
            key_tail, value_tail = p.tails()
            ks += _affine_rows(p.keys, key_tail, queries.dtype)
            vs += _affine_rows(p.values, value_tail, queries.dtype)
        k = ks[0] if len(ks) == 1 else mx.concatenate(ks, axis=2)
        v = vs[0] if len(vs) == 1 else mx.concatenate(vs, axis=2)
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)

    return decode_attention


def install_lean() -> list[str]:
    """Every module of the package that took ``decode_attention`` from ``kernels/decode.py``
    given the lean dense read for group-affine parts; their names."""
    import sys

    import veloxquant_mlx.methods  # noqa: F401
    from veloxquant_mlx.kernels import decode

    original = decode.decode_attention
    lean = _lean(original)
    lean.original = original
    patched = []
    for name, module in list(sys.modules.items()):
        if name.startswith("veloxquant_mlx") and getattr(module, "decode_attention", None) is original:
            module.decode_attention = lean
            patched.append(name)
    return patched


def uninstall_lean() -> None:
    """``install_lean`` undone in every module it patched."""
    import sys

    for name, module in list(sys.modules.items()):
        f = getattr(module, "decode_attention", None) if name.startswith("veloxquant_mlx") else None
        if hasattr(f, "original"):
            module.decode_attention = f.original


if __name__ != "__main__":
    if os.environ.get("VQ_DENSE_READ") == "1":
        install()
    elif os.environ.get("VQ_DENSE_READ") == "2":
        install_lean()


def _check(methods, context=160, steps=48) -> int:
    """Each method's decode logits with the patched read against its own read, on the tiny
    float32 preset: the same history, so they agree to float32 rounding (returns failures).
    The default prompt is past palu's first 128 tokens: with a shorter one the two runs'
    logits part at the step that reaches 128, where palu fits its bases (1.2e-3 at a
    100-token prompt), although one layer's store read both ways over such a fit agrees to
    2.5e-7 (random rows, the cache's own protocol): the runs part at the fit, not the read."""
    import argparse
    import importlib.util
    import pathlib

    spec = importlib.util.spec_from_file_location("decode_bench", pathlib.Path(__file__).with_name("decode.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    import veloxquant_mlx.methods  # noqa: F401  (every store class defined before they are listed)

    model = bench.build_model("tiny", mx.float32)
    tokens = mx.random.randint(0, model.args.vocab_size, (context,), key=mx.random.key(1))
    originals = {c: c.__dict__.get("decode_attention") for c in [PackedStore, *_subclasses(PackedStore)]}

    def logits_of(name):
        bench.resolve_methods([name], argparse.ArgumentParser(prog="dense_read.py"), False)
        config = bench.METHODS[name]
        cache = bench.make_cache(model, config)
        out = [bench.prefill(model, cache, tokens)]
        y = mx.argmax(out[0])[None]
        for _ in range(steps):
            logits = model(y[:, None], cache=cache)[:, -1]
            y = mx.argmax(logits, axis=-1)
            out.append(logits)
        return mx.concatenate([o.reshape(1, -1) for o in out])

    def restore():
        for c in [PackedStore, *_subclasses(PackedStore)]:  # classes made since count too
            if originals.get(c) is not None:
                c.decode_attention = originals[c]
            elif "decode_attention" in c.__dict__:
                delattr(c, "decode_attention")

    failures = 0
    for name in methods:
        restore()
        own = logits_of(name)
        install()
        try:
            dense = logits_of(name)
        finally:
            restore()
        err = mx.abs(dense - own).max().item() / mx.abs(own).max().item()
        ok = err < 1e-4
        failures += not ok
        print(f"{name:12s} largest difference {err:.2e} of the largest logit {'ok' if ok else 'FAILED'}")
    return failures


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("methods", nargs="*", help="decode.py's method rows (default: eight quantized stores)",
                    default=["kitty", "skvq", "zipcache", "gear", "kvquant", "age_tiered", "palu", "nsnquant"])
    ap.add_argument("--context", type=int, default=160)
    ap.add_argument("--steps", type=int, default=48)
    args = ap.parse_args()
    raise SystemExit(_check(args.methods, args.context, args.steps))
