"""A quantized cache whose saved form is entropy-coded: resident codes, coded streams on disk.

Attention cannot read an entropy-coded stream without decoding all of it at every step,
so such a cache keeps two forms of the same symbols:

- **resident** (what attention reads, what ``nbytes`` counts): the store's fixed-length
  codes, scales and full-precision rows, as ``QuantizedCache`` keeps them;
- **stored** (what ``state`` holds, so what ``save_prompt_cache`` writes, and what
  ``stored_nbytes`` counts): the method's ``stored_arrays()``, its symbols entropy-coded
  (``quant/entropy.py``) with their tables, plus what is not coded (scales, bases, the
  full-precision rows).

mlx-lm reads ``state`` after every prefill chunk, so the coded form must not cost a pass
over the whole history each time: a run's codes are coded in segments
(``CodedSegments``), each with its own tables (the released CacheGen codec's per-chunk
CDFs). Tokens become a sealed segment, coded once and kept on the host, when at least
``SEGMENT_TOKENS`` of them are not coded yet at a read of ``state``; fewer are coded as
the open segment, kept until the run grows. A prompt prefilled in chunks of at least
``SEGMENT_TOKENS`` tokens is coded chunk by chunk, each once; a second read of ``state``
codes nothing. The kept segments are host memory besides ``nbytes`` (the size of the
coded form, ``stored_nbytes``, below the resident codes').

Loading decodes the streams back into the resident codes (``restore_stored``): a loaded
cache holds exactly the codes it was saved with.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from ..cache.base import CompressedKVCache
from .cache import QuantizedCache


SEGMENT_TOKENS = 4096  # the fewest tokens a sealed segment codes: its tables stay ~2% of its size


class CodedSegments:
    """The coded form of one growing run of codes, in segments of tokens [start, end).

    ``code(start, end)`` returns the segment's coded arrays by name (1-D numpy arrays);
    it is called once per sealed segment and once per state of the open one. Segments are
    dropped when the run they coded is replaced or holds fewer tokens than they cover.
    """

    def __init__(self):
        self.run = None
        self.sealed: list[tuple[int, int, dict[str, np.ndarray]]] = []
        self.open: tuple[int, int, dict[str, np.ndarray]] | None = None

    def segments(self, run, count: int, code) -> list[tuple[int, int, dict[str, np.ndarray]]]:
        if run is not self.run:
            self.run, self.sealed, self.open = run, [], None
        self.sealed = [seg for seg in self.sealed if seg[1] <= count]
        start = self.sealed[-1][1] if self.sealed else 0
        if count - start >= SEGMENT_TOKENS:
            self.sealed.append((start, count, code(start, count)))
            self.open = None
        elif count == start:
            self.open = None
        elif self.open is None or self.open[:2] != (start, count):
            self.open = (start, count, code(start, count))
        return self.sealed + ([self.open] if self.open else [])

    def adopt(self, run, segments: list[tuple[int, int, dict[str, np.ndarray]]]) -> None:
        """Keep segments read from a file as sealed (a loaded cache saves without coding)."""
        self.run, self.sealed, self.open = run, list(segments), None


def join_segments(prefix: str, segments) -> dict[str, mx.array]:
    """The segments as saved: each coded array's segments concatenated, and
    ``{prefix}_segments`` (int64, one row a segment: its tokens, then each array's length
    in name order) to split them again."""
    if not segments:
        return {}
    names = sorted(segments[0][2])
    rows = [[end - start, *(arrays[n].shape[0] for n in names)] for start, end, arrays in segments]
    out = {f"{prefix}_{n}": from_numpy(np.concatenate([arrays[n] for _, _, arrays in segments])) for n in names}
    out[f"{prefix}_segments"] = from_numpy(np.asarray(rows, dtype=np.int64))
    return out


def split_segments(prefix: str, arrays: dict[str, mx.array], names: tuple[str, ...]):
    """Inverse of ``join_segments``: [(start, end, {name: numpy array})]."""
    rows = to_numpy(arrays[f"{prefix}_segments"]).astype(np.int64)
    if rows.ndim != 2 or rows.shape[1] != 1 + len(names):
        raise ValueError(f"{prefix}_segments has shape {rows.shape}, expected (segments, {1 + len(names)})")
    names = sorted(names)
    flat = {n: to_numpy(arrays[f"{prefix}_{n}"]) for n in names}
    ends = np.cumsum(rows, axis=0)
    out, start = [], 0
    for i, row in enumerate(rows):
        parts = {n: flat[n][ends[i, j + 1] - row[j + 1] : ends[i, j + 1]] for j, n in enumerate(names)}
        out.append((start, start + int(row[0]), parts))
        start += int(row[0])
    return out


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

    def coded_segments(self, prefix: str) -> CodedSegments:
        """The coded segments kept for the run saved under ``prefix``."""
        kept = self.__dict__.setdefault("_coded_segments", {})
        return kept.setdefault(prefix, CodedSegments())


def to_numpy(x: mx.array) -> np.ndarray:
    return np.asarray(x)


def from_numpy(x: np.ndarray) -> mx.array:
    return mx.array(np.ascontiguousarray(x))
