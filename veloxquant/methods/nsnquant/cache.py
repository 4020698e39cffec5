"""NSNQuant: normalize-shift-normalize, then one universal, calibration-free codebook, for K and V.

A configuration of the NSN store (``methods/nsnquant/nsn.py``). Per layer and KV head, keys and
values alike are cut into chunks of R = ``nsn_residual_length`` tokens; each complete
chunk is normalised per token (s1), shifted by its own channel mean (o), normalised again
(s2), rotated (Walsh-Hadamard), and its sub-vectors of ``nsn_subvector_dim`` channels are
coded with one universal codebook of ``nsn_codebook_size`` centroids fitted by k-means on
N(0, I) samples drawn from ``nsn_seed`` (explicit MLX PRNG keys: the same seed gives the
same codebook; it is built once per process and settings). ``nsn_bits`` 2: the
sub-vector's signs plus the index of the magnitude centroid (a codebook fitted on
|samples|); 1: the index of a signed centroid only. s1 and s2 per token and o per chunk
are float16. The incomplete last chunk (0..R-1 tokens) stays in full precision; a chunk is
coded once, when its R-th token comes, so the coded frontier is a multiple of R and the
state does not depend on how the prompt was chunked. ``nsn_max_ctx`` caps a layer's
tokens: the buffers stop growing there and a longer context is refused, naming the field.

Adapted (the card's third-party reading; the paper is unread beyond its abstract): keys
are coded post-RoPE, as mlx-lm hands them over (the paper codes them pre-RoPE with a
RoPE-aware kernel; NSN itself is position-agnostic); the value rotation is applied here,
not fused into the V/O projections; the codebook is not fine-tuned; metadata are float16,
not double-quantized.

Memory per token, KV head and tensor (K and V each): ``(D/s) log2(C)/8`` bytes of indices
(+ ``D/8`` of signs at 2 bits), rounded up to whole 32-bit words a token, + 4 (s1, s2) +
``2D/R`` (o); plus the full-precision tail and the codebook (``C s`` float32, one array
shared by every layer, counted by each).

Attention: a prompt chunk attends over the decoded history plus itself; a decode step over
one part read through ``NSNKeys`` and ``NSNValues`` (query rotated once, chunk means scored
once per chunk, centroids gathered by index; at 1 bit, key scores through lookup tables),
the tail as its full-precision rows: the pure-MLX path (no fused kernel reads codebooks).
On CUDA a step reads in the rotated frame instead: the rows rebuilt as ``s1 (s2 y_hat + o
H)`` in the queries' dtype, the tail rotated, one fused attention of the rotated queries,
the output rotated back (``nsn.NSNStore.attend_parts``).
"""

from __future__ import annotations

from .nsn import NSNCodec, NSNStore, universal_codebook
from ...quant.cache import QuantizedCache
from ...quant.vq import MAX_BITS
from ...quant.vq_store import CodebookCache


class NSNQuantCache(CodebookCache):
    sub_dim_fields = ("nsn_subvector_dim", "nsn_subvector_dim")
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)

    def make_store(self):
        o = self.config.options
        if o.nsn_codebook_size > 1 << MAX_BITS:
            raise ValueError(f"nsn_codebook_size={o.nsn_codebook_size}: indices are packed at "
                             f"{MAX_BITS} bits at most; allowed: a power of two up to {1 << MAX_BITS}")
        codebook = universal_codebook(o.nsn_bits, o.nsn_codebook_size, o.nsn_subvector_dim, o.nsn_seed)
        return NSNStore(NSNCodec(codebook, o.nsn_bits), o.nsn_residual_length, o.nsn_max_ctx)

    _dims_checked = None  # (key, value) head_dims that passed CodebookCache's checks

    def update_and_fetch(self, keys, values):
        cap = self.config.nsn_max_ctx  # the flat field: ``options`` builds an object a read
        if self.offset + keys.shape[2] > cap:
            raise ValueError(f"nsn_max_ctx={cap}: layer {self.layer} holds {self.offset} tokens and "
                             f"{keys.shape[2]} more came; allowed: at most {cap} (raise nsn_max_ctx)")
        dims = (keys.shape[-1], values.shape[-1])
        if dims == self._dims_checked:  # the sub-vector and rotation checks passed for these
            return QuantizedCache.update_and_fetch(self, keys, values)
        out = super().update_and_fetch(keys, values)
        self._dims_checked = dims
        return out
