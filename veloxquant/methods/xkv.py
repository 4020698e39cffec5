"""xKV: one SVD shared by a group of neighbouring layers' keys (arXiv 2503.18893).

Layers are grouped ``xkv_group_size`` at a time, in order (the last group may be
shorter). What is kept:

- by the group's first layer (its owner, ``cache/cross_layer.py``), once for the group:
  the token latent ``A = U_r S_r`` of the joint SVD of ``X = [K_1 | ... | K_G]`` (heads
  side by side along the channels), quantized per latent channel to ``xkv_latent_bits``
  in groups of ``xkv_group_quant_size`` tokens, its last tokens short of a packing unit
  in the model dtype (``lowrank/shared_latent.py``; 16 bits keeps all of it so);
- by every layer: its rows of the basis ``B_l = V_r[cols(l)]ᵀ`` (r x n_kv*d, model
  dtype), the keys that came after the SVD exact, and every value exact (xKV's values
  are not compressed here: the options carry no value rank).

When: mlx-lm calls layers 0..L-1 in order for each chunk, so the SVD waits for the
group's last layer. A layer's prompt ends at its first single-token update; the group's
last member, at its own, takes every member's exact prompt keys, runs the SVD with rank
``xkv_rank`` (capped at min(T, G*n_kv*d)) or the smallest holding
``xkv_energy_threshold`` of the squared singular values (largest over the batch), puts
the latent in the owner and each member's ``B_l`` in it, and the members drop their
exact prompt keys. Until then every layer attends over its own exact keys (the first
members do so for that first decode step too), as xKV's prefill attends with the
original keys. Decode tokens are appended exact, as in the reference code; a later
prompt (a follow-up turn) is appended exact too: one SVD per cache, over the first
prompt. ``xkv_max_ctx`` bounds the exact prompt keys held for the SVD: a longer first
prompt is refused, naming the field. A prompt that arrives one token at a time
(``prefill_step_size=1``) never ends as a prompt, so nothing is compressed: the cache
warns at its first token (a boundary that depends on the chunking cannot be inferred).

Attention: a decode step scores the latent without rebuilding keys, ``q·k_t = (B_lᵀq)·a_t``
(``LatentKeys``), plus the exact keys, in one softmax (``kernels/decode.py``, pure-MLX
path); a prompt chunk attends over the rebuilt keys plus its own.

Adapted: the joint SVD is a bounded one (``lowrank/factors.py``'s ``randomized_basis``: over at
most 4,096 evenly spaced tokens, no QR or SVD over the T x G*n_kv*d matrix on the prefill
path; up to 512 tokens or channels, and up to 2,048 for the energy rule or a rank past a
third of them, one eigh of the smaller side's Gram matrix: the exact basis and rank, one
host read per group; past that a randomized SVD, subspace iteration with eigenproblems of
rank size, within 2% of the exact rank-r error in tests/test_xkv.py); keys are post-RoPE (mlx-lm hands them so; every layer rotates token t by the
same angle, so the group stays aligned, at a higher rank than pre-RoPE keys); the latent
is quantized (the paper keeps it in fp16); no selective reconstruction.
"""

from __future__ import annotations

import functools
import warnings

import mlx.core as mx

from ..cache.base import CompressedKVCache, causal_mask
from ..cache.buffers import GrowingArray
from ..cache.cross_layer import CrossLayer, CrossLayerError, consecutive_groups
from ..kernels import kivi_decode as kd
from ..lowrank.cpu_streams import fit_streams
from ..lowrank.shared_latent import SharedLatentCodec, LatentKeys, joint_bases, joint_factors
from ..quant.token_rows import ReadViews


class XKVCache(CrossLayer, CompressedKVCache):
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache at every layer, linked by a context of their own (cache/stacked.py)
    requires_attention_hook = True
    max_ctx_covers = "prompt"  # xkv_max_ctx bounds the first prompt; decode tokens are kept exact

    # The fields are read flat from the config (what ``config.options`` is built from): a
    # decode step reads the groups (through ``group_shared``) and the codec at every layer,
    # and ``config.options`` builds and validates an options object at each read.
    def layer_groups(self, compressed, n_layers):
        return consecutive_groups(compressed, self.config.xkv_group_size)

    @property
    def codec(self) -> SharedLatentCodec:
        return _codec(self.config.xkv_latent_bits, self.config.xkv_group_quant_size)

    def _init_storage(self) -> None:
        self._init_cross_layer()
        # exact rows grow with what they hold (geometric): a short prompt pays no 256-row step
        self.keys = GrowingArray(geometric=True)  # exact keys: the prompt until the SVD, then what follows
        self.values = GrowingArray(geometric=True)
        self.b = None  # (B, r, n_kv*d): this layer's rows of the group's basis
        self.n_latent = 0  # tokens the shared latent stands for
        self._views = ReadViews()  # the decode read's views of b, the latent and the scale

    # -- the protocol ---------------------------------------------------------------------------
    def update_and_fetch(self, keys, values):
        self._expect_attend()
        self._check_shape(keys, values)
        n = keys.shape[2]
        if not self.n_latent and not self.prompts_done and self.offset + n > self.config.xkv_max_ctx:
            limit = self.config.xkv_max_ctx
            raise ValueError(
                f"xkv_max_ctx={limit}: layer {self.layer} would hold {self.offset + n} exact "
                f"prompt keys for its group's SVD; allowed: at most xkv_max_ctx (raise it)")
        if n == 1 and self.offset == 0 and self.is_owner:
            warnings.warn(
                f"xkv: layer {self.layer}'s group got its prompt one token at a time (mlx-lm's "
                "prefill_step_size=1, or a 1-token prompt): the SVD runs when a prompt of 2 or "
                "more tokens ends, so this cache keeps every key exact and saves no memory; "
                "prefill in chunks of 2 tokens or more", RuntimeWarning, stacklevel=2)
        self._note_update(n)  # the group's SVD, when this update completes its prompt
        self.keys.append(keys)
        self.values.append(values)
        self.offset += n
        return keys, values

    def attend(self, queries, keys, values, *, scale, mask, sinks=None):
        self._own_attention_begins(sinks)
        latent = self.latent_keys()
        if queries.shape[2] == 1 and latent is not None:
            return self._decode_read(queries, latent, scale)
        k = self.keys.view()
        if latent is not None:
            k = mx.concatenate([latent.reconstruct(k.dtype), k], axis=2)
        if isinstance(mask, mx.array):
            mask = causal_mask(queries.shape[2], k.shape[2])
        return mx.fast.scaled_dot_product_attention(queries, k, self.values.view(), scale=scale, mask=mask)

    def _decode_read(self, queries, latent: LatentKeys, scale) -> mx.array:
        """One query token over the latent's tokens and the exact keys under one softmax:
        what ``kernels/decode.py``'s joint path computes for ``DecodePart(latent, keys, None,
        values)`` (``LatentKeys.scores`` then the exact keys' scores, float32), its folded
        basis, latent tail and scale read from views kept until b or the latent change."""
        b, hq, _, d = queries.shape
        h = self.kv_shape[1]
        r = hq // h
        b_heads, tail_t, scale_q = self._read_views(latent, b, h, r, d, scale)
        q = queries.astype(mx.float32).reshape(b, h, r, d) * scale_q
        scores = [latent.scores(q, (b_heads, tail_t))]
        k = self.keys.view()
        if k is not None:
            scores.append(q @ k.astype(mx.float32).swapaxes(-1, -2))
        p = mx.softmax(scores[0] if len(scores) == 1 else mx.concatenate(scores, axis=-1), axis=-1)
        o = kd.token_mix(p, self.values.view().astype(mx.float32))
        return o.reshape(queries.shape).astype(queries.dtype)

    def _read_views(self, latent: LatentKeys, b: int, h: int, r: int, d: int, scale):
        """(b as (B, H, d, rank), the latent tail transposed (B, 1, rank, n) or None, the
        scale broadcast over the folded queries (B, H, R, d)): views (a cast only where it
        is one), kept until b or the latent are replaced (an SVD, a restore)."""
        tail = latent.kept.get("latent_tail")
        key = (b, h, r, d, float(scale), self.b, tail)

        def build():
            return (*latent.read_views(h, d), mx.broadcast_to(mx.array(scale, mx.float32), (b, h, r, d)))

        return self._views.get(self, key, build)

    def latent_keys(self) -> LatentKeys | None:
        if not self.n_latent:
            return None
        return LatentKeys(self.codec, self.group_shared.items, self.b, self.n_latent, self.kv_shape[1])

    def on_group_prefill_done(self, members, end) -> None:
        if not end or any(m.n_latent for m in members):
            return  # one SVD per cache, over its first prompt
        o = self.config.options
        dtype = self.keys.view().dtype
        basis = self.owner.__dict__.pop("_prompt_basis", None)
        if basis is None or basis[0] != end:
            basis = self._fit_waiting_groups(members, end)
        a, bs, _ = joint_factors([m.keys.view()[:, :, :end] for m in members],
                                 o.xkv_rank, o.xkv_energy_threshold, basis=basis[1:])
        self.owner.shared.items.update(self.codec.encode(a, dtype))
        for m, b in zip(members, bs):
            rest = m.keys.view()[:, :, end:]
            m.keys.reset(mx.contiguous(rest) if rest.shape[2] else None)
            m.b, m.n_latent = mx.contiguous(b.astype(dtype)), end  # not a view pinning all of V

    def _fit_waiting_groups(self, members, end: int) -> tuple:
        """This group's ``(end, V_r, r)``, fitted with the bases of the later groups whose
        prompts (ending at the same token) wait for their first decode token, in one
        ``joint_bases`` call: their eigenproblems run side by side on the fit streams, with
        their ranks read together, where a group at a time waited for each alone at its last
        layer (mlx-lm's first decode step runs the layers in order; every layer's prompt keys
        are there before it starts). Each later group's owner holds its basis until its
        prompt ends there (``_prompt_basis``, not state: it lives within that one step). On one
        fit stream (the CPU's default) each group fits alone, as before: queued, the 2-core
        CPU was no faster (benchmarks/notes/prefill.md)."""
        o = self.config.options
        alone = len(fit_streams()) == 1  # nothing would run side by side: no bases held early
        groups = [members] + ([] if alone else self._waiting_groups(end))
        bases = joint_bases([[m.keys.view()[:, :, :end] for m in g] for g in groups],
                            o.xkv_rank, o.xkv_energy_threshold)
        for g, basis in zip(groups[1:], bases[1:]):
            g[0].owner._prompt_basis = (end, *basis)
        return (end, *bases[0])

    def _waiting_groups(self, end: int) -> list:
        """The groups after this one whose every member holds exactly a prompt of ``end``
        tokens, still open and not yet compressed (an unlinked or other-rank neighbour: not
        one of them)."""
        ctx = self.context
        if ctx is None:
            return []
        out = []
        for group in self.layer_groups(tuple(ctx.compressed_layers), ctx.n_layers):
            if group[0] <= self.layer:
                continue
            try:
                members = [self.member(i) for i in group]
            except CrossLayerError:
                continue
            if all(isinstance(m, XKVCache) and m.prompt_open and m.offset == end and not m.n_latent
                   and m.keys.length == end and m.config == self.config for m in members):
                out.append(members)
        return out

    # -- what is kept ------------------------------------------------------------------------------
    @property
    def stored_length(self) -> int:
        return self.n_latent + self.keys.length

    def _arrays(self):
        return {"keys": self.keys, "values": self.values, "b": self.b, **self.shared.arrays()}

    def _restore_arrays(self, arrays) -> None:
        super()._restore_arrays(self.shared.restore(arrays))

    def _meta(self):
        return {**super()._meta(), "n_latent": self.n_latent}

    def _restore_meta(self, meta) -> None:
        self.n_latent = int(meta.get("n_latent", 0))
        super()._restore_meta(meta)

    def _state_problems(self):
        if self.values.length != self.offset:
            yield "value rows", self.values.length, f"the offset {self.offset}"
        if self.n_latent + self.keys.length != self.offset:
            yield "tokens stored", f"{self.n_latent} in the latent + {self.keys.length} exact", f"the offset {self.offset}"
        if self.n_latent and self.b is None:
            yield "basis rows b", None, f"an array (the latent holds {self.n_latent} tokens)"
        if self.is_owner and self.n_latent:
            codec_problems = list(self.codec.problems(self.shared.items))
            if codec_problems:
                yield from codec_problems
                return
            held = LatentKeys(self.codec, self.shared.items, self.b, 0, 0)
            latent = held.codec.decode(held.kept, mx.float32)
            if latent.shape[1:] != (self.n_latent, self.b.shape[1]):
                yield "shared latent (tokens, rank)", latent.shape[1:], (self.n_latent, self.b.shape[1])


@functools.lru_cache(maxsize=None)
def _codec(bits: int, group: int) -> SharedLatentCodec:
    return SharedLatentCodec(bits, group)

