"""A quantized cache whose saved form is entropy-coded: resident codes, coded streams on disk.

Attention cannot read an entropy-coded stream without decoding all of it at every step,
so such a cache keeps two forms of the same symbols:

- **resident** (what attention reads, what ``nbytes`` counts, and what ``state`` holds):
  the store's fixed-length codes, scales and full-precision rows, as ``QuantizedCache``
  keeps them, with ``meta["form"] = "resident"``. mlx-lm's generate (and
  ``bench.runner.prefill``) evaluates ``state`` after every prefill chunk: reading it
  costs no entropy coding and no host read, only the arrays the cache already holds;
- **coded** (what ``save_prompt_cache`` of ``veloxquant_mlx`` writes, and what
  ``stored_nbytes`` counts): the method's ``stored_arrays()``, its symbols entropy-coded
  (``quant/entropy.py``) with their tables, plus what is not coded (scales, bases, the
  full-precision rows), with ``meta["form"] = "coded"``. ``state`` gives it only inside
  ``coded_states()`` (this thread), which ``integrations/saved.py`` enters while mlx-lm's
  ``save_prompt_cache`` reads the states; a file saved by mlx-lm's own
  ``save_prompt_cache`` holds the resident form (larger, and loadable the same way).

Coding runs on the host, so the coded form is built in segments (``CodedSegments``), each
with its own tables (the released CacheGen codec's per-chunk CDFs) and kept: tokens become
a sealed segment, coded once, when at least ``SEGMENT_TOKENS`` of them are not coded yet
at a save (or a read of ``stored_nbytes``); fewer are coded as the open segment, kept
until the run grows. Saving twice, or saving after reading ``stored_nbytes``, codes each
sealed segment once. The kept segments are host memory besides ``nbytes`` (the size of the
coded form, ``stored_nbytes``, below the resident codes').

Loading takes either form (``restore_stored``): the resident arrays as they are, or the
coded streams decoded back into the resident codes (a file without ``form`` in its meta,
saved before the resident form existed, is the coded form); either way the same checks
apply and a loaded cache holds exactly the codes it was saved with.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any

import mlx.core as mx
import numpy as np

from ..cache.base import CacheStateError, CompressedKVCache
from .cache import QuantizedCache


SEGMENT_TOKENS = 4096  # the fewest tokens a sealed segment codes: its tables stay ~2% of its size
FORMS = ("resident", "coded")

_saving = threading.local()


@contextmanager
def coded_states():
    """While active (in this thread; nests), ``state`` of an ``EntropyCodedCache`` is its
    coded form: entered by ``integrations.saved.save_prompt_cache`` around mlx-lm's save."""
    depth = getattr(_saving, "depth", 0)
    _saving.depth = depth + 1
    try:
        yield
    finally:
        _saving.depth = depth


def coding_states() -> bool:
    """Whether ``state`` gives the coded form here (inside ``coded_states()``)."""
    return getattr(_saving, "depth", 0) > 0


class CodedSegments:
    """The coded form of one growing run of codes, in segments of tokens [start, end).

    ``code(start, end)`` returns the segment's coded arrays by name (1-D numpy arrays);
    it is called once per sealed segment and once per read of the open one (a save, or
    ``stored_nbytes``) while the run does not grow. Segments are
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
        """The coded form, by name (entropy-coded streams, their tables, the rest)."""
        raise NotImplementedError

    def restore_stored(self, meta: dict[str, Any], arrays: dict[str, mx.array]) -> None:
        """Rebuild the store from a saved state of either form (``saved_form(meta)``):
        ``stored_arrays()``'s output, or the resident arrays of ``state``."""
        raise NotImplementedError

    @property
    def stored_nbytes(self) -> int:
        """Bytes of the arrays the coded form holds (the file adds its header and meta)."""
        return sum(a.nbytes for a in self.stored_arrays().values() if a is not None)

    @property
    def state(self) -> dict[str, Any]:
        """The resident form (no coding, no host read); the coded form inside
        ``coded_states()``."""
        resident = CompressedKVCache.state.fget(self)
        if coding_states():
            return {"arrays": self.stored_arrays(), "meta": {**resident["meta"], "form": "coded"}}
        # derived arrays (kvtc's field layout: a tuple) and empty ones (None) are not kept
        arrays = {k: v for k, v in resident["arrays"].items() if isinstance(v, mx.array)}
        return {"arrays": arrays, "meta": {**resident["meta"], "form": "resident"}}

    @state.setter
    def state(self, state: dict[str, Any]) -> None:
        CompressedKVCache.state.fset(self, state)

    def saved_form(self, meta: dict[str, Any]) -> str:
        """The form of a saved state, ``"resident"`` or ``"coded"`` (a state without
        ``form`` was saved before there were two: coded)."""
        form = meta.get("form", "coded")
        if form not in FORMS:
            raise CacheStateError(
                f"saved cache, layer {self.layer} ({type(self).__name__}, method "
                f"{self.config.method!r}): form is {form!r}, expected one of {FORMS}")
        return form

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
