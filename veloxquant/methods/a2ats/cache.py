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
stored pre-RoPE keys when the first step retrieves (in the metric's frame), seeded by the
layer index. Codes are computed then, for the tokens past the newest ``a2ats_window``, and
after that in blocks of ``a2ats_window`` tokens once that many more are past it: a decode
step between codes nothing and scores the coded tokens, and the newest ``a2ats_window``
to ``2 a2ats_window - 1`` tokens are attended exactly (the paper's window is fixed at
``a2ats_window``; the official code codes each token as it leaves it). Keys stay exact.

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
from types import SimpleNamespace

import mlx.core as mx

from ...cache.base import CompressedKVCache
from ...cache.options import A2ATSOptions
from ...cache.rope import Rotary, derotate
from .retrieval import RetrievalStore

N_SINK = 8  # first tokens always attended (the official code's)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(A2ATSOptions)}


def _square(field: str, value, shape: tuple[int, int]) -> mx.array:
    array = mx.array(value, dtype=mx.float32)
    if tuple(array.shape) != shape:
        raise ValueError(f"{field} has shape {tuple(array.shape)}; allowed: {list(shape)} "
                         f"(2**a2ats_codebook_bits x a2ats_sub_dim for the codebook, "
                         f"a2ats_sub_dim x a2ats_sub_dim for query_h)")
    return array


class A2ATSCache(CompressedKVCache):
    requires_attention_hook = True
    batchable = "stacked"  # its rows never mix (each row fits its own tables): sequences in the same state share one cache (cache/stacked.py)

    def _init_storage(self) -> None:
        self.options = self.config.options
        self.rotary = self._rotary()
        self.store = None
        self._pending = None

    def _rotary(self) -> Rotary:
        o = self.options
        model = Rotary.from_model_args(getattr(self.context, "model_args", None))
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

    def _make_store(self, head_dim: int, batch: int) -> RetrievalStore:
        o, s = self.options, self.options.a2ats_sub_dim
        if head_dim % s:
            allowed = ", ".join(str(d) for d in range(1, head_dim + 1) if head_dim % d == 0)
            raise ValueError(f"a2ats_sub_dim={s} must divide head_dim={head_dim}; allowed here: {allowed}")
        codebook = None if o.a2ats_codebook is None else _square("a2ats_codebook", o.a2ats_codebook, (1 << o.a2ats_codebook_bits, s))
        metric = None
        if o.a2ats_use_query_aware and o.a2ats_query_h is not None:
            metric = _square("a2ats_query_h", o.a2ats_query_h, (s, s))
        learn = o.a2ats_use_query_aware and metric is None and o.a2ats_beta < 1
        return RetrievalStore(
            bits=o.a2ats_codebook_bits, sub_dim=s, window=o.a2ats_window, n_sink=N_SINK,
            fraction=o.a2ats_retrieval_fraction, frame=self._frame, query_offset=o.a2ats_b,
            codebook=codebook, metric=metric, learn_metric=learn, beta=o.a2ats_beta, seed=self.layer,
            rotary=self.rotary, batch=batch)

    def _frame(self, x, positions):
        return derotate(x, positions, self.rotary)

    # -- the protocol ---------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        self._expect_attend()
        self._check_shape(keys, values)
        if self.store is None:
            self.store = self._make_store(keys.shape[-1], keys.shape[0])
        return self._stash_chunk(keys, values)

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        chunk_k, chunk_v = self._take_chunk(sinks)
        self.store.append(chunk_k, chunk_v)
        n = queries.shape[2]
        if n == 1:
            return self.store.decode_attention(queries, scale=scale, position=self.offset - 1)
        self.store.observe_queries(queries, mx.arange(self.offset - n, self.offset))
        return self.store.prefill_attention(queries, scale=scale, mask=mask)

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
        elif self.offset:
            yield "tokens stored", 0, f"the offset {self.offset}"

    def _rows_returned(self, n_new: int) -> int:
        return self.stored_length + n_new

