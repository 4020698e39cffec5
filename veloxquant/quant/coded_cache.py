"""A quantized cache whose saved form is entropy-coded: resident codes, coded streams on disk.

Attention cannot read an entropy-coded stream without decoding all of it at every step,
so such a cache keeps two forms of the same symbols:

- **resident** (what attention reads, what ``nbytes`` counts): the store's fixed-length
  codes, scales and full-precision rows, as ``QuantizedCache`` keeps them;
- **stored** (what ``state`` holds, so what ``save_prompt_cache`` writes, and what
  ``stored_nbytes`` counts): the method's ``stored_arrays()``, its symbols entropy-coded
  (``quant/entropy.py``) with their tables, plus what is not coded (scales, bases, the
  full-precision rows). It is computed when asked for, never kept.

Loading decodes the streams back into the resident codes (``restore_stored``): a loaded
cache holds exactly the codes it was saved with.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..cache.base import CompressedKVCache
from .cache import QuantizedCache


class EntropyCodedCache(QuantizedCache):
    def stored_arrays(self) -> dict[str, mx.array]:
        """The saved form, by name (entropy-coded streams, their tables, the rest)."""
        raise NotImplementedError

    def restore_stored(self, meta: dict[str, Any], arrays: dict[str, mx.array]) -> None:
        """Rebuild the resident form from ``stored_arrays()``'s output."""
        raise NotImplementedError

    @property
    def stored_nbytes(self) -> int:
        """Bytes of the arrays the saved form holds (the file adds its header and meta)."""
        return sum(a.nbytes for a in self.stored_arrays().values() if a is not None)

    @property
    def state(self) -> dict[str, Any]:
        meta = CompressedKVCache.state.fget(self)["meta"]
        return {"arrays": self.stored_arrays(), "meta": meta}

    @state.setter
    def state(self, state: dict[str, Any]) -> None:
        CompressedKVCache.state.fset(self, state)

    def _restore_meta(self, meta) -> None:
        self.restore_stored(meta, self.__dict__.pop("_saved_arrays", {}))


def to_numpy(x: mx.array) -> np.ndarray:
    return np.asarray(x)


def from_numpy(x: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(x))
