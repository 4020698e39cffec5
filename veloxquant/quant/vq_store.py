"""A store of product-VQ keys and values with a full-precision window, and its cache base.

``CodebookStore`` keeps a layer's tokens as packed codebook indices (``quant/vq.py``),
keys and values each in their own ``ProductVQ`` codec, and the newest ``window`` tokens
in full precision, written in place (``RecentRows``). A token leaves the window once, when
``window`` newer ones have come (one a decode step), and is encoded then; coded tokens are
never re-coded. Encoding is per token, so what is stored does not depend on how the
prompt was chunked, once the codebooks exist.

The codebooks come from a calibration (given to the store) or, without one, are fitted
once (``CodebookFit``) on the tokens the store holds when its first tokens are to be
encoded (the prompt, or its first chunk when it comes in chunks longer than the window;
the window plus one token when the prompt fits the window), and then kept fixed. The
codecs' arrays (centroids, smoothing factors) are kept per layer, saved with the state and
counted in ``nbytes``.

Attention: a prompt chunk attends over the decoded history plus itself; a decode step over
one part, keys read through lookup tables (``CodebookKeys``), values through centroids
gathered by index (``CodebookValues``), the window as the part's full-precision tail: the
pure-MLX path on every device.

``CodebookCache`` is the ``QuantizedCache`` of such methods: its ``sub_dim_fields`` must
divide head_dim, and the head_dim must admit the rotation where the method rotates.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from ..cache.buffers import GrowingArray, RecentRows
from ..kernels.decode import DecodePart
from .cache import QuantizedCache
from .packed import GROWTH_TOKENS
from .store import VALUE_ROOM, WINDOW_STEP, PackedStore, joined_history
from .vq import (CodebookKeys, CodebookValues, ProductVQ, index_words, kmeans, nearest,
                 pack_with_tables, packing_tables, rotation_problem)

SMOOTH_FLOOR = 1e-4  # smallest per-channel smoothing factor


def smoothing_factors(keys: mx.array) -> mx.array:
    """lambda_c = sqrt(max |K[., c]|) per KV head over every sequence and token, floored:
    (1, H, 1, D) float32."""
    peak = mx.abs(keys.astype(mx.float32)).max(axis=(0, 2), keepdims=True)
    return mx.maximum(mx.sqrt(peak), SMOOTH_FLOOR)


@dataclass(frozen=True)
class CodebookFit:
    """How a layer's codebooks are fitted: keys smoothed per channel and rotated, then
    k-means over their sub-vectors; values' raw sub-vectors likewise.

    ``sample``: points per centroid looked at, at most (a seeded sample beyond);
    ``iters``: Lloyd iterations at most; ``seed``: the k-means keys (split per codebook)."""

    key_sub_dim: int
    key_bits: int
    value_sub_dim: int
    value_bits: int
    iters: int
    sample: int
    seed: int = 0
    smooth: bool = True
    rotated: bool = True

    def fit(self, keys: mx.array, values: mx.array, progress=None) -> tuple[ProductVQ, ProductVQ]:
        """The (key, value) codecs for keys and values (B, H, T, D); ``progress(name, done,
        total)`` after each k-means iteration, name "keys" or "values"."""
        keys_rng, values_rng = mx.random.split(mx.random.key(self.seed))
        scale = smoothing_factors(keys) if self.smooth else None
        frame = ProductVQ(mx.zeros((1, self.key_sub_dim)), self.key_bits, scale, self.rotated)
        codecs = []
        for name, x, s, bits, rng, base in (
            ("keys", frame.to_code_space(keys), self.key_sub_dim, self.key_bits, keys_rng, frame),
            ("values", values, self.value_sub_dim, self.value_bits, values_rng, ProductVQ(None, self.value_bits)),
        ):
            k = 1 << bits
            report = (lambda d, t, name=name: progress(name, d, t)) if progress else None
            c = kmeans(x.reshape(-1, s), k, iters=self.iters, key=rng, sample=self.sample * k,
                       progress=report)
            codecs.append(ProductVQ(c.astype(mx.float16), bits, base.scale, base.rotated))
        return codecs[0], codecs[1]


def codec_arrays(key: ProductVQ | None, value: ProductVQ | None) -> dict[str, mx.array | None]:
    """What a layer's codecs keep, by name (the calibration file's names too)."""
    return {"key_centroids": None if key is None else key.centroids,
            "key_scale": None if key is None else key.scale,
            "value_centroids": None if value is None else value.centroids}


# -- the steady state's coding of the token leaving the window, as one compiled pass ---------
# (``_encode_fn``: what ``ProductVQ.encode`` computes), the indices packed through
# ``vq.packing_tables`` (constants built once outside the pass, evaluated with the first
# step that reads them).


@functools.lru_cache(maxsize=None)
def _encode_fn(bits: int, scaled: bool, rotated: bool):
    def run(x, centroids, scale, *fields):
        codec = ProductVQ(centroids, bits, scale if scaled else None, rotated)
        y = codec.to_code_space(x)
        idx = nearest(y.reshape(*y.shape[:-1], -1, codec.sub_dim), centroids)
        return pack_with_tables(idx, *fields)

    return mx.compile(run)


def _how(codec: ProductVQ) -> tuple:
    return codec.bits, codec.scale is not None, codec.rotated


@functools.lru_cache(maxsize=1)
def _no_scale() -> mx.array:
    return mx.zeros((0,), mx.float32)


def _scale_arg(codec: ProductVQ) -> mx.array:
    return codec.scale if codec.scale is not None else _no_scale()


def encode_one(codec: ProductVQ, x: mx.array) -> mx.array:
    """``codec.encode(x)`` as one compiled pass."""
    n = x.shape[-1] // codec.sub_dim
    fn = _encode_fn(*_how(codec))
    return fn(x, codec.centroids, _scale_arg(codec), *packing_tables(n, codec.bits))


class CodebookStore(PackedStore):
    def __init__(self, window: int, fit: CodebookFit, codecs: tuple[ProductVQ, ProductVQ] | None = None):
        self.window, self.fitter = window, fit
        self.key_codec, self.value_codec = codecs if codecs is not None else (None, None)
        self.fitted_from = "calibration" if codecs is not None else None
        self.k_win = RecentRows(step=WINDOW_STEP, limit=window + VALUE_ROOM, geometric=True)
        self.v_win = RecentRows(step=WINDOW_STEP, limit=window + VALUE_ROOM, geometric=True)
        self.k_codes = GrowingArray(axis=2, step=GROWTH_TOKENS)
        self.v_codes = GrowingArray(axis=2, step=GROWTH_TOKENS)
        self.dims: tuple[int, int] | None = None  # key and value head_dim (the first tokens')

    def install(self, key: ProductVQ, value: ProductVQ, source: str) -> None:
        self.key_codec, self.value_codec, self.fitted_from = key, value, source

    @property
    def count(self) -> int:
        """Tokens held as codes."""
        return self.k_codes.length

    @property
    def length(self) -> int:
        return self.count + self.k_win.held

    # -- writing -------------------------------------------------------------------------
    def _encode(self, keys: mx.array, values: mx.array, held_k, held_v) -> None:
        """Append ``keys``/``values`` as codes, fitting the codebooks first (on ``held``,
        every token held now) when there are none yet."""
        if self.key_codec is None:
            self.install(*self.fitter.fit(held_k, held_v), "prompt")
        self.k_codes.append(self.key_codec.encode(keys))
        self.v_codes.append(self.value_codec.encode(values))

    def commit(self, keys: mx.array, values: mx.array) -> None:
        """Take new tokens in; encode those that leave the window."""
        self.dims = self.dims or (keys.shape[-1], values.shape[-1])
        if keys.shape[2] == 1 and self.window:  # a decode step: rows written in place
            self.k_win.append(keys)
            self.v_win.append(values)
            if self.k_win.held > self.window:
                if self.key_codec is not None:  # the steady state: one token coded in one pass each
                    self.k_codes.append(encode_one(self.key_codec, self.k_win.pop_front(1)))
                    self.v_codes.append(encode_one(self.value_codec, self.v_win.pop_front(1)))
                    return
                held_k, held_v = self.k_win.view(), self.v_win.view()
                self._encode(self.k_win.pop_front(1), self.v_win.pop_front(1), held_k, held_v)
            return
        k_all = keys if self.k_win.view() is None else mx.concatenate([self.k_win.view(), keys], axis=2)
        v_all = values if self.v_win.view() is None else mx.concatenate([self.v_win.view(), values], axis=2)
        n_old = k_all.shape[2] - self.window
        if n_old > 0:
            self._encode(k_all[:, :, :n_old], v_all[:, :, :n_old], k_all, v_all)
            k_all, v_all = mx.contiguous(k_all[:, :, n_old:]), mx.contiguous(v_all[:, :, n_old:])
        self.k_win.reset(k_all if k_all.shape[2] else None)
        self.v_win.reset(v_all if v_all.shape[2] else None)

    # -- reading --------------------------------------------------------------------------
    def history(self, dtype) -> tuple[mx.array | None, mx.array | None]:
        """Every stored token in ``dtype``, in order (transient: prefill chunks and tests)."""
        parts_k, parts_v = [], []
        if self.count:
            d_k, d_v = self.dims
            parts_k.append(self.key_codec.decode(self.k_codes.view(), d_k, dtype))
            parts_v.append(self.value_codec.decode(self.v_codes.view(), d_v, dtype))
        return joined_history(parts_k, parts_v, self.k_win.view(), self.v_win.view(), dtype)

    def decode_parts(self, empty: mx.array) -> list[DecodePart]:
        keys = values = None
        if self.count:
            d_k, d_v = self.dims
            keys = CodebookKeys(self.k_codes.buffer, self.count, self.key_codec, d_k)
            values = CodebookValues(self.v_codes.buffer, self.count, self.value_codec, d_v)
        return [DecodePart(keys, self.k_win.view(), values, self.v_win.view())]

    # -- checks of a restored state ---------------------------------------------------------
    def layout_problems(self, head_dims: tuple[int, int]):
        f = self.fitter
        for name, sub, bits, d in (("key", f.key_sub_dim, f.key_bits, head_dims[0]),
                                   ("value", f.value_sub_dim, f.value_bits, head_dims[1])):
            centroids = getattr(self, f"{name}_codec")
            want = (1 << bits, sub)
            if centroids is not None and tuple(centroids.centroids.shape) != want:
                yield f"{name} codebook (centroids, sub_dim)", tuple(centroids.centroids.shape), want
            codes = getattr(self, f"{name[0]}_codes").view()
            words = index_words(d // sub, bits)
            if codes is not None and codes.shape[3] != words:
                yield f"{name} code words per token", codes.shape[3], f"{words} ({d // sub} indices of {bits} bits)"
        scale = self.key_codec.scale if self.key_codec is not None else None
        if scale is not None and scale.shape[-1] != head_dims[0]:
            yield "key smoothing factors' head_dim", scale.shape[-1], head_dims[0]

    def problems(self, offset: int):
        n_k, n_v = self.k_codes.length, self.v_codes.length
        held = self.k_win.held
        if n_k != n_v or held != self.v_win.held:
            yield "stored tokens", f"{n_k}+{held} keys / {n_v}+{self.v_win.held} values", "as many values as keys"
        if held != min(offset, self.window):
            yield "full-precision tokens", held, f"min(offset {offset}, window {self.window})"
        if n_k + held != offset:
            yield "tokens stored", n_k + held, f"the offset {offset}"
        if n_k and self.key_codec is None:
            yield "codebooks", None, f"codebooks for the {n_k} coded tokens"

    # -- what is kept ------------------------------------------------------------------------
    def arrays(self) -> dict[str, Any]:
        return {"k_codes": self.k_codes, "v_codes": self.v_codes, "k_res": self.k_win,
                "v_res": self.v_win, **codec_arrays(self.key_codec, self.value_codec)}

    def meta(self) -> dict[str, Any]:
        return {"codebooks_from": self.fitted_from or "", "head_dims": json.dumps(self.dims)}

    def restore(self, meta: dict[str, Any], arrays: dict[str, Any]) -> None:
        dims = json.loads(meta.get("head_dims") or "null")
        self.dims = None if dims is None else tuple(dims)
        for name in ("k_codes", "v_codes", "k_res", "v_res"):
            getattr(self, {"k_res": "k_win", "v_res": "v_win"}.get(name, name)).reset(arrays.get(name))
        f = self.fitter
        if arrays.get("key_centroids") is not None:
            self.install(ProductVQ(arrays["key_centroids"], f.key_bits, arrays.get("key_scale"), f.rotated),
                         ProductVQ(arrays["value_centroids"], f.value_bits),
                         meta.get("codebooks_from") or "prompt")


class CodebookCache(QuantizedCache):
    """A ``QuantizedCache`` whose codecs cut heads into sub-vectors: each field of
    ``sub_dim_fields`` must divide head_dim (keys, then values), and with ``rotates`` the
    head_dim must admit the Hadamard rotation."""

    sub_dim_fields: tuple[str, str]
    rotates = True
    group_field = ""

    @property
    def group(self) -> int:  # no group-affine codec: any head_dim passes QuantizedCache's check
        return 1

    @classmethod
    def sub_dim_problem(cls, config, d_k: int, d_v: int) -> str | None:
        """Why the sub-vector fields do not fit these key and value head_dims, or None."""
        for name, d in zip(cls.sub_dim_fields, (d_k, d_v)):
            sub = getattr(config.options, name)
            if d % sub:
                allowed = ", ".join(str(s) for s in range(1, d + 1) if d % s == 0)
                return f"{name}={sub} must divide head_dim={d}; allowed here: {allowed}"
        return None

    def update_and_fetch(self, keys, values):
        d_k, d_v = keys.shape[-1], values.shape[-1]
        problem = self.sub_dim_problem(self.config, d_k, d_v)
        if problem:
            raise ValueError(problem)
        problem = rotation_problem(d_k) if self.rotates else None
        if problem:
            raise ValueError(f"method {self.config.method!r}: {problem}")
        return super().update_and_fetch(keys, values)
