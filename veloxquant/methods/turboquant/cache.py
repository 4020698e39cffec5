"""TurboQuant (Zandieh et al., arXiv 2504.19874): every key and value rotated by a random
orthogonal transform, its coordinates coded with the Lloyd-Max levels of their known
density, keys with a 1-bit QJL sketch of the residual so that scores stay unbiased.

A configuration of the quantized store (``quant/store.py``): keys and values each a
``TurboCodec`` run (``codec.py``), coded once they leave a sliding window of the newest
``turboquant_window`` = W tokens kept in full precision (keys and values alike: a
per-token codec needs no blocks of tokens). A prompt codes every token but the last W at
once (the paper codes every token as it comes: W = 0); decode steps code theirs
``FLUSH_TOKENS`` at a time, so up to W + 31 tokens are exact between two flushes. A prompt chunk attends over the decoded history plus itself; a decode
step over the packed rows with the rotation folded into the query (``TurboScores``: on a
GPU its own fused kernel, ``kernel.py``; the pure-MLX path elsewhere or with
``fused_attention=False``) and the window rows as they are, merged by log-sum-exp.

Layer i rotates with the seed ``turboquant_seed + i`` (its keys and values share it; the
QJL matrix comes from the same seed). Memory per token and KV head, in bits: keys
``d b_k + 32`` with the sketch (``d b_k + 16`` without), values ``d b_v + 16``, rows padded
to whole 32-bit words per bit plane, plus the window's rows in the model's dtype.
"""

from __future__ import annotations

from ...quant.cache import QuantizedCache
from ...quant.hadamard import rotation_problem
from ...quant.packed import GROWTH_TOKENS
from ...quant.store import QuantizedKVStore
from .codec import TurboCodec

# Decode steps code their tokens FLUSH_TOKENS at a time (one batched step, not one small
# one a token: a decode step's host time); until then they wait in full precision.
FLUSH_TOKENS = 32


class TurboQuantCache(QuantizedCache):
    batchable = "stacked"  # its rows never mix: sequences in the same state share one cache (cache/stacked.py)
    group = 1  # no quantization groups: the rotation decides which head_dims are taken

    def make_store(self):
        o = self.config.options
        seed = o.turboquant_seed + self.layer
        keys = TurboCodec(o.turboquant_key_bits, o.turboquant_qjl, seed)
        values = TurboCodec(o.turboquant_value_bits, False, seed)
        return QuantizedKVStore(keys, values, window=o.turboquant_window, key_block=None,
                                step_tokens=GROWTH_TOKENS, attend_then_flush=True,
                                slide_block=FLUSH_TOKENS)

    _dims_checked = None  # the (key, value) head_dims whose rotation was found possible

    def update_and_fetch(self, keys, values):
        dims = (keys.shape[-1], values.shape[-1])
        if dims != self._dims_checked:
            for d in set(dims):
                problem = rotation_problem(d)
                if problem:
                    raise ValueError(f"method 'turboquant': {problem}")
            self._dims_checked = dims
        return super().update_and_fetch(keys, values)

    def _restore_meta(self, meta) -> None:
        super()._restore_meta(meta)
        if self.kv_shape is not None:  # the runs read their head_dim from the rows they coded
            self.store.keys.dim, self.store.values.dim = self.kv_shape[2:]
