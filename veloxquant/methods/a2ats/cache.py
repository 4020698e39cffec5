"""A2ATS: retrieval-based sparse attention, tokens picked through VQ codes of their keys.

A configuration of the retrieval store (``methods/a2ats/retrieval.py``), as the paper's official
code does it (the card's "paper" column), not the card's compression-only adaptation:

- every token's key and value are kept **exactly** (the paper offloads them to CPU memory;
  here they stay in the layer's cache on the device: MLX has no host tier, and Apple's
  unified memory has no other to offload to), counted in ``nbytes``: A2ATS saves
  attention reads, not memory;
- beside them, product-VQ codes (``a2ats_codebook_bits`` bits per ``a2ats_sub_dim``
  channels) of the **pre-RoPE** keys: mlx-lm hands over post-RoPE keys, rotated back at
  their positions with the model's rotary settings (``cache/rope.py``);
- each decode step at position i scores every token but the first ``N_SINK`` and the
  newest ``a2ats_window`` with windowed RoPE: ``q~ = R_b q_pre`` (the query rotated to
  position ``a2ats_b``) against the centroids, through lookup tables (``s_t = q~ .
  C[id_t]``: every far key as if ``b`` tokens away), takes the top
  ``floor(a2ats_retrieval_fraction * (i + 1))`` tokens per query head (the paper's top-K
  ratio, 0.03 in its README; the card's field, read as such), their union over each KV
  head's query heads, and attends exactly over sinks, chosen tokens and window. A
  fraction whose K covers every candidate is exact attention. Prompt chunks attend
  exactly (as in the paper).

Codes: ``a2ats_use_query_aware=False`` assigns plain nearest centroids. With it (the
default) assignment minimises the paper's query-aware error ``(k - c) H (k - c)^T``:
``H`` is ``a2ats_query_h`` when given (the paper's calibrated second moment of queries
rotated to b, one [sub_dim, sub_dim] block for every sub-space), else the second moment
of this prompt's own queries rotated to b (pooled over heads and sub-spaces, unit mean
eigenvalue) blended with the identity: ``beta I + (1 - beta) H`` (``a2ats_beta``: 1 is
plain nearest; the card's cosine-proxy blend is not used, since this cache sees the
queries). The codebook is ``a2ats_codebook`` when given, else fitted by k-means on the
stored pre-RoPE keys when the first step retrieves (in the metric's frame), seeded with
``KMEANS_SEED`` (every layer alike: what ``veloxquant calibrate``'s default ``--seed``
gives). Codes are computed then, for the tokens past the newest ``a2ats_window``, and
after that in blocks of ``a2ats_window`` tokens once that many more are past it: a decode
step between codes nothing and scores the coded tokens, and the newest ``a2ats_window``
to ``2 a2ats_window - 1`` tokens are attended exactly (the paper's window is fixed at
``a2ats_window``; the official code codes each token as it leaves it). Keys stay exact.

Calibrated (a config's ``calibration_file``, written by ``veloxquant calibrate --method
a2ats``; the paper calibrates offline, per layer, on a text): the file holds each layer's
codebook ``codebook`` (2**bits, s) and, where the metric is learned (query-aware with
``a2ats_beta`` < 1), its metric ``query_h`` (s, s) and the metric's Cholesky factor
``factor`` (s, s), float32. They are what the per-sequence fit produces on the text taken
as a one-chunk prompt followed by a retrieving step (``A2ATSCache.calibrate``: the metric
from the queries of all T tokens, the codebook from the pre-RoPE keys of the first
``T + 1 - a2ats_window``, at most T; the same code, seed ``--seed``), so a file calibrated
on a prompt's own tokens (all but its last, which mlx-lm feeds as the first step) fits as
that prompt does, bit for bit. A cache installs the codebook and factor before its first
token: it keeps no query moment, runs no k-means and no Cholesky factorisation, and
afterwards behaves as a cache whose fit produced them. The file is checked (method,
``calibration_fields``, model, keys' heads and head_dim, the key rotary it was fitted
under) when the cache has a model context and again at the first keys, and refused naming
the field and both values. ``a2ats_codebook``/``a2ats_query_h`` given with a file are
refused (one source of tables). There are no refits, with or without a file: the tables
are fixed once there.

Per sequence: the codebook, the metric's factor and the query moment have the batch first
(B, ...): each row's are fitted from its own keys and queries (a given one is copied to
every row) and read by its own codes and scores only, so a cache fed B rows holds each row
as it would alone, and sequences in the same state share one cache (``cache/stacked.py``).

Rotary settings: the model's (``context.model_args``: rope_theta, traditional,
rope_scaling) when known; ``a2ats_rope_base``/``a2ats_rope_scaling`` de-rotate otherwise,
and a non-default value that contradicts the model's is refused, naming both. Sinks:
``N_SINK = 8`` (the official code's; no field). Memory per token and KV head: 2 D model
dtype rows (K and V) + ``D / s`` bytes of codes (one an index, unpacked; two past 8
bits), plus, per sequence, the codebook, the metric's factor and the query moment.
Attention is pure MLX on every device (gathers and SDPA); no fused kernel.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import mlx.core as mx

from ...cache.base import CompressedKVCache
from ...cache.buffers import arrays_written
from ...cache.calibration import layer_calibration
from ...cache.options import A2ATSOptions
from ...cache.rope import Rotary, derotate
from .retrieval import RetrievalStore, blended_metric

N_SINK = 8  # first tokens always attended (the official code's)
KMEANS_SEED = 0  # the codebook's k-means, every layer: a file calibrated with --seed 0 fits alike
DEFAULTS = {f.name: f.default for f in dataclasses.fields(A2ATSOptions)}
GIVEN_TABLES = ("a2ats_codebook", "a2ats_query_h")


def _learns_metric(o) -> bool:
    """Whether the metric comes from the queries (query-aware, none given, beta < 1)."""
    return bool(o.a2ats_use_query_aware) and o.a2ats_query_h is None and o.a2ats_beta < 1


def _calibrated_names(o) -> tuple[str, ...]:
    return ("codebook", "query_h", "factor") if _learns_metric(o) else ("codebook",)


def key_rotary(o, model_args) -> Rotary:
    """The rotary keys are de-rotated with: the model's (``model_args``) when it names
    one, else ``a2ats_rope_base``/``a2ats_rope_scaling``; a non-default field contradicting
    the model's is refused, naming both."""
    model = Rotary.from_model_args(model_args)
    scaling = o.a2ats_rope_scaling
    if scaling is not None and not isinstance(scaling, dict):
        raise ValueError(f"a2ats_rope_scaling={scaling!r}; allowed: None or a rope_scaling dict")
    given = Rotary.from_model_args(SimpleNamespace(rope_theta=o.a2ats_rope_base, rope_scaling=scaling))
    if model is None:
        return given
    if o.a2ats_rope_base not in (DEFAULTS["a2ats_rope_base"], model.base):
        raise ValueError(f"a2ats_rope_base={o.a2ats_rope_base!r} contradicts the model's rope_theta="
                         f"{model.base!r}: keys are de-rotated with the model's; leave it at "
                         f"{DEFAULTS['a2ats_rope_base']!r} or set it to {model.base!r}")
    if scaling is not None and given.scaling != model.scaling:
        raise ValueError(f"a2ats_rope_scaling={scaling!r} contradicts the model's rope_scaling "
                         f"{model.scaling or None}: leave it None or set it to the model's")
    return model


class A2ATSCache(CompressedKVCache):
    requires_attention_hook = True
    batchable = "stacked"  # its rows never mix (each row fits its own tables): sequences in the same state share one cache (cache/stacked.py)
    # the fields a calibration file's tables depend on: the window's too, as it decides which
    # of the text's keys the codebook is fitted on (the rotary is recorded as ``key_rotary``)
    calibration_fields = ("a2ats_codebook_bits", "a2ats_sub_dim", "a2ats_window", "a2ats_b",
                          "a2ats_use_query_aware", "a2ats_beta")
    calibration_queries = True  # ``calibrate`` takes the text's queries (the metric)

    def _init_storage(self) -> None:
        self.options = self.config.options
        self.rotary = key_rotary(self.options, getattr(self.context, "model_args", None))
        self.store = None
        self._pending = None
        if self.config.calibration_file:
            given = [f for f in GIVEN_TABLES if getattr(self.options, f) is not None]
            if given:
                raise ValueError(f"calibration_file={self.config.calibration_file!r} and {given[0]} are both "
                                 f"given: the file holds the codebook and metric {given[0]} would give; "
                                 f"give one of them")
            if self.context is not None:  # a wrong file fails at once
                self._calibration(None)

    def _calibration(self, kv_shape) -> dict[str, mx.array]:
        """This layer's tables in ``calibration_file``, checked against the config, the
        model, the keys' (heads, head_dim) when known and the key rotary."""
        return layer_calibration(self.config, self.calibration_fields, _calibrated_names(self.options),
                                 self.layer, model_args=getattr(self.context, "model_args", None),
                                 kv_shape=kv_shape, cache_metadata={"key_rotary": self.rotary.to_json()})

    def _make_store(self, head_dim: int, batch: int, tables: dict | None = None) -> RetrievalStore:
        """The layer's store; ``tables``: a calibration file's (installed, nothing learned).
        A calibrated cache restored from a saved state gets its tables from the state."""
        return _new_store(self.options, self.rotary, head_dim, batch, self._frame, seed=KMEANS_SEED,
                          tables=tables, calibrated=bool(self.config.calibration_file))

    # -- offline calibration (``veloxquant calibrate --method a2ats``) ------------------------
    @classmethod
    def calibrate(cls, keys, values, config, *, iters: int, seed: int, progress=None, model_args=None,
                  queries=None):
        """A layer's tables from its post-RoPE keys (1, H, T, D) and queries (1, Hq, T, D)
        of a text: what the per-sequence fit makes of the text as one prompt chunk followed
        by a retrieving step (``RetrievalStore.fit_tables``): the query metric from all T
        queries, the codebook by k-means (seeded with ``seed``) on the pre-RoPE keys of the
        tokens before the window, the first ``T + 1 - a2ats_window`` (at most T: with no
        window the step's own key is not the text's). Keys and queries are framed with
        ``model_args``' rotary, as the cache does. ``iters`` changes nothing: the Lloyd
        iterations and the sample are the per-sequence fit's."""
        o = config.options
        given = [f for f in GIVEN_TABLES if getattr(o, f) is not None]
        if given:
            raise ValueError(f"{given[0]} is given: calibrate fits the codebook and metric; leave it None")
        rotary = key_rotary(o, model_args)
        recorded = cls.calibration_metadata(model_args)["key_rotary"]
        if rotary.to_json() != recorded:
            raise ValueError(f"keys de-rotated with a2ats_rope_base/a2ats_rope_scaling ({rotary.to_json()}), "
                             f"but the file records the model's rotary ({recorded}): the model names no "
                             f"rope_theta; leave both at their defaults")
        b, _, t, d = keys.shape
        stop = min(t, t + 1 - o.a2ats_window)
        if stop <= N_SINK:
            raise ValueError(f"{t} calibration tokens leave no keys to fit: a2ats fits those before its "
                             f"a2ats_window={o.a2ats_window} past its {N_SINK} sinks (use more --tokens)")
        learns = _learns_metric(o)
        if learns and (queries is None or queries.shape[0] != b or queries.shape[2:] != (t, d)):
            found = None if queries is None else tuple(queries.shape)
            raise ValueError(f"the query metric needs the text's queries (1, n_heads, {t}, {d}); given {found}")
        store = _new_store(o, rotary, d, b, functools.partial(derotate, rotary=rotary), seed=seed)
        store.keys.append(keys[:, :, :stop])
        if learns:
            store.observe_queries(queries, mx.arange(t))
        factor = store.fit_tables(stop)
        arrays = {"codebook": store.centroids[0]}
        if factor is not None:
            arrays.update(query_h=blended_metric(store.h_sum, o.a2ats_beta)[0], factor=factor[0])
        if progress:
            progress("codebook and metric" if learns else "codebook", 1, 1)
        return arrays

    @classmethod
    def calibration_metadata(cls, model_args) -> dict[str, str]:
        """What the file's tables depend on besides the fields: the rotary the keys and
        queries were framed with (a cache whose keys are de-rotated otherwise refuses it)."""
        return {"key_rotary": key_rotary(A2ATSOptions(), model_args).to_json()}

    def _frame(self, x, positions):
        return derotate(x, positions, self.rotary)

    # -- the protocol ---------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        self._expect_attend()
        self._check_shape(keys, values)
        if self.store is None:  # the first keys: a calibration file's tables installed before them
            tables = (self._calibration((keys.shape[1], keys.shape[-1]))
                      if self.config.calibration_file else None)
            self.store = self._make_store(keys.shape[-1], keys.shape[0], tables)
        return self._stash_chunk(keys, values)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        chunk_k, chunk_v = self._take_chunk(sinks)
        self.store.append(chunk_k, chunk_v)
        n = queries.shape[2]
        if n == 1:
            return self.store.decode_attention(queries, scale=scale, position=self.offset - 1)
        self.store.observe_queries(queries, mx.arange(self.offset - n, self.offset))
        out = self.store.prefill_attention(queries, scale=scale, mask=mask)
        return mx.depends(out, arrays_written(self.store.arrays()))  # stored with its layer

    # -- what is kept -------------------------------------------------------------------------------
    @property
    def stored_length(self) -> int:
        return 0 if self.store is None else self.store.length

    def _arrays(self):
        return {} if self.store is None else self.store.arrays()

    def _meta(self):
        return {"rotary": self.rotary.to_json()}

    def _restore_arrays(self, arrays) -> None:
        self._saved_arrays = arrays

    def _restore_meta(self, meta) -> None:
        self.rotary = Rotary.from_json(meta["rotary"])
        arrays = self.__dict__.pop("_saved_arrays", {})
        if self.kv_shape is not None:
            self.store = self._make_store(self.kv_shape[2], self.kv_shape[0])
            self.store.restore(arrays, self.kv_shape[0])

    def _layout_problems(self):
        if self.store is not None:
            yield from self.store.layout_problems(self.kv_shape[2], self.kv_shape[0])

    def _state_problems(self):
        if self.store is not None:
            yield from self.store.problems(self.offset)
            if self.config.calibration_file and self.store.centroids is None:
                yield "codebook", None, f"the one of calibration_file={self.config.calibration_file!r}"
        elif self.offset:
            yield "tokens stored", 0, f"the offset {self.offset}"

    def _rows_returned(self, n_new: int) -> int:
        return self.stored_length + n_new


def _square(field: str, value, shape: tuple[int, int]) -> mx.array:
    array = mx.array(value, dtype=mx.float32)
    if tuple(array.shape) != shape:
        raise ValueError(f"{field} has shape {tuple(array.shape)}; allowed: {list(shape)} "
                         f"(2**a2ats_codebook_bits x a2ats_sub_dim for the codebook, "
                         f"a2ats_sub_dim x a2ats_sub_dim for query_h)")
    return array


def _new_store(o, rotary: Rotary, head_dim: int, batch: int, frame, *, seed: int,
               tables: dict | None = None, calibrated: bool = False) -> RetrievalStore:
    """A layer's store for options ``o``: tables given (``a2ats_codebook``/``a2ats_query_h``),
    a calibration file's (``tables``: its codebook and factor), or none (fitted at the first
    retrieving step; ``calibrated``: a file's, restored from a saved state: none learned)."""
    s = o.a2ats_sub_dim
    if head_dim % s:
        allowed = ", ".join(str(d) for d in range(1, head_dim + 1) if head_dim % d == 0)
        raise ValueError(f"a2ats_sub_dim={s} must divide head_dim={head_dim}; allowed here: {allowed}")
    k = 1 << o.a2ats_codebook_bits
    codebook = metric = factor = None
    if tables is not None:
        codebook, factor = _square("codebook", tables["codebook"], (k, s)), tables.get("factor")
        factor = None if factor is None else _square("factor", factor, (s, s))
    elif o.a2ats_codebook is not None:
        codebook = _square("a2ats_codebook", o.a2ats_codebook, (k, s))
    if o.a2ats_use_query_aware and o.a2ats_query_h is not None:
        metric = _square("a2ats_query_h", o.a2ats_query_h, (s, s))
    learn = _learns_metric(o) and tables is None and not calibrated
    return RetrievalStore(
        bits=o.a2ats_codebook_bits, sub_dim=s, window=o.a2ats_window, n_sink=N_SINK,
        fraction=o.a2ats_retrieval_fraction, frame=frame,
        query_offset=o.a2ats_b, codebook=codebook, metric=metric, factor=factor, learn_metric=learn,
        beta=o.a2ats_beta, seed=seed, rotary=rotary, batch=batch)
