"""Lossless entropy coding of integer symbols: range ANS over many lanes at once (numpy).

The API is two functions and their tables:

- ``encode(symbols, freqs) -> bytes`` and ``decode(data, freqs, n) -> symbols``: ``symbols``
  is ``(lanes, n)`` (or ``(n,)``: one lane) of integers in ``[0, alphabet)``; ``freqs`` the
  quantized frequency table, ``(lanes, alphabet)`` (one model per lane) or ``(alphabet,)``
  (one model for every lane), each row summing to ``2**PRECISION``; a symbol that occurs
  needs a frequency of at least 1.
- ``frequencies(counts)`` turns symbol counts into such a table (zero counts stay zero: a
  table made from the data it codes never needs them; every nonzero count gets >= 1);
  ``histogram(symbols, alphabet)`` counts per lane; ``entropy_bits(counts)`` is the
  empirical entropy (the ideal coded size, in bits) the coded size is measured against.
- ``pack(symbols, alphabets, pooled)`` / ``unpack(stream, table, n, alphabets, pooled)``:
  what a cache stores, the coded stream and its tables (uint16, each lane's trimmed to its
  own alphabet, or one pooled table), as numpy arrays ready to be saved.

The coder: rANS with a 32-bit state per lane, renormalised by 16-bit words (state in
``[2**16, 2**32)``, at most one word per symbol). Lanes are coded in lockstep, one numpy
step per symbol position, so the per-step Python cost is shared by every lane (one lane
per channel or component in the caches). The words of all lanes go into one stream in
the order the decoder asks for them: position by position, and at one position in lane
order, only the lanes whose state ran low; the decoder knows which lanes those are from
its own states, so no per-lane lengths are stored. The coded size is
``4 * lanes + 2 * words`` bytes: the empirical entropy plus the table rounding (at most a
fraction of a percent for counts in the thousands, ``PRECISION`` = 15) plus the final
states.
"""

from __future__ import annotations

import numpy as np

PRECISION = 15  # frequency tables sum to 2**PRECISION (fits uint16, and at most 16 for the coder)
_TOTAL = 1 << PRECISION
_LOW = 1 << 16  # the state's lower bound; words are 16 bits


def histogram(symbols: np.ndarray, alphabet: int) -> np.ndarray:
    """Counts ``(lanes, alphabet)`` of each lane's symbols (``(n,)`` input: one lane)."""
    sym = np.atleast_2d(np.asarray(symbols, dtype=np.int64))
    lanes = sym.shape[0]
    flat = sym + (np.arange(lanes, dtype=np.int64) * alphabet)[:, None]
    return np.bincount(flat.ravel(), minlength=lanes * alphabet).reshape(lanes, alphabet)


def entropy_bits(counts: np.ndarray) -> float:
    """Σ over rows of the row's empirical entropy times its symbol count, in bits."""
    c = np.asarray(counts, dtype=np.float64)
    n = c.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(c > 0, -c * np.log2(c / n), 0.0)
    return float(terms.sum())


def frequencies(counts: np.ndarray) -> np.ndarray:
    """Counts (..., alphabet) -> uint16 frequencies summing to 2**PRECISION per nonempty row,
    >= 1 where the count is nonzero, 0 where it is zero (rows without symbols stay zero)."""
    c = np.asarray(counts, dtype=np.int64)
    present = c > 0
    k = present.sum(axis=-1, keepdims=True)
    if (k > _TOTAL).any():
        raise ValueError(f"an alphabet of more than 2**{PRECISION} symbols cannot be coded")
    n = np.maximum(c.sum(axis=-1, keepdims=True), 1)
    # One for each symbol present, the rest of the total shared in proportion (floor):
    # never zero where a symbol occurs, never over the total; the remainder goes to the
    # most frequent symbol, where it costs the least.
    f = np.where(present, (c * (_TOTAL - k)) // n + 1, 0)
    short = np.where(k > 0, _TOTAL - f.sum(axis=-1, keepdims=True), 0)
    top = np.argmax(c, axis=-1)[..., None]
    np.put_along_axis(f, top, np.take_along_axis(f, top, axis=-1) + short, axis=-1)
    return f.astype(np.uint16)


def _tables(freqs: np.ndarray, lanes: int):
    f = np.asarray(freqs, dtype=np.uint64)
    if f.ndim == 1:
        f = np.broadcast_to(f, (lanes, f.shape[0]))
    if f.shape[0] != lanes:
        raise ValueError(f"freqs has {f.shape[0]} rows for {lanes} lanes")
    start = np.cumsum(f, axis=-1, dtype=np.uint64) - f
    return f, start


def encode(symbols: np.ndarray, freqs: np.ndarray) -> bytes:
    """The rANS code of ``symbols`` ((lanes, n) or (n,)) under ``freqs`` (see the module)."""
    sym = np.atleast_2d(np.asarray(symbols, dtype=np.int64))
    lanes, n = sym.shape
    f_tab, s_tab = _tables(freqs, lanes)
    if n and (sym.min() < 0 or sym.max() >= f_tab.shape[1]):
        raise ValueError(f"symbols must lie in [0, {f_tab.shape[1]}); got [{sym.min()}, {sym.max()}]")
    f_all = np.take_along_axis(f_tab, sym, axis=1)
    s_all = np.take_along_axis(s_tab, sym, axis=1)
    if n and not f_all.all():
        lane, pos = np.argwhere(f_all == 0)[0]
        raise ValueError(f"symbol {sym[lane, pos]} of lane {lane} has frequency 0 in its table")
    x = np.full(lanes, _LOW, dtype=np.uint64)
    chunks = []
    for t in range(n - 1, -1, -1):
        f = f_all[:, t]
        big = x >= (f << np.uint64(32 - PRECISION))
        chunks.append(x[big] & np.uint64(0xFFFF))
        x[big] >>= np.uint64(16)
        x = ((x // f) << np.uint64(PRECISION)) + (x % f) + s_all[:, t]
    words = np.concatenate(chunks[::-1]) if chunks else np.zeros(0, np.uint64)
    return x.astype("<u4").tobytes() + words.astype("<u2").tobytes()


def decode(data: bytes, freqs: np.ndarray, n: int, lanes: int | None = None) -> np.ndarray:
    """The symbols ``encode`` coded: (lanes, n), or (n,) for one lane when ``freqs`` is 1-D
    and ``lanes`` is not given. ``lanes`` defaults to the rows of ``freqs``."""
    f = np.asarray(freqs)
    one = f.ndim == 1 and lanes is None
    lanes = lanes if lanes is not None else (1 if f.ndim == 1 else f.shape[0])
    f_tab, s_tab = _tables(f, lanes)
    buf = memoryview(data)
    x = np.frombuffer(buf[: 4 * lanes], dtype="<u4").astype(np.uint64)
    words = np.frombuffer(buf[4 * lanes :], dtype="<u2").astype(np.uint64)
    alphabet = f_tab.shape[1]
    # Symbol lookup for all lanes in one search: each lane's cumulative ends, offset by
    # the lane's index times the total, form one increasing array.
    ends = (s_tab + f_tab) + (np.arange(lanes, dtype=np.uint64) * _TOTAL)[:, None]
    ends, base = ends.ravel(), np.arange(lanes, dtype=np.int64) * alphabet
    lane_off = np.arange(lanes, dtype=np.uint64) * _TOTAL
    rows = np.arange(lanes)
    out = np.empty((lanes, n), dtype=np.int64)
    mask, ptr = np.uint64(_TOTAL - 1), 0
    for t in range(n):
        slot = x & mask
        s = np.searchsorted(ends, slot + lane_off, side="right") - base
        f_s, s_s = f_tab[rows, s], s_tab[rows, s]
        x = f_s * (x >> np.uint64(PRECISION)) + slot - s_s
        low = x < _LOW
        k = int(low.sum())
        if k:
            if ptr + k > words.shape[0]:
                raise ValueError("the coded stream ends early: it is truncated or its tables differ")
            x[low] = (x[low] << np.uint64(16)) | words[ptr : ptr + k]
            ptr += k
        out[:, t] = s
    if ptr != words.shape[0] or (lanes and (x != _LOW).any()):
        raise ValueError("the coded stream does not decode to its start state: corrupt, or other tables")
    return out[0] if one else out


# -- what a cache stores: the stream and its tables ------------------------------------------
def _alphabets(alphabets, lanes: int) -> np.ndarray:
    a = np.asarray(alphabets, dtype=np.int64)
    return np.full(lanes, int(a), np.int64) if a.ndim == 0 else a


def pack(symbols: np.ndarray, alphabets, pooled: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Code ``symbols`` (lanes, n) with tables made from them: one per lane, or one
    ``pooled`` over every lane. ``alphabets``: one size, or one per lane (tables are kept
    trimmed to it). Returns (uint8 stream, uint16 flat table)."""
    sym = np.atleast_2d(np.asarray(symbols, dtype=np.int64))
    lanes = sym.shape[0]
    sizes = _alphabets(alphabets, lanes)
    width = int(sizes.max()) if lanes else 1
    counts = histogram(sym, width)
    if pooled:
        freqs = frequencies(counts.sum(axis=0))
        flat = freqs[: width]
    else:
        freqs = frequencies(counts)
        flat = np.concatenate([freqs[i, : sizes[i]] for i in range(lanes)]) if lanes else freqs.ravel()
    stream = np.frombuffer(encode(sym, freqs), dtype=np.uint8)
    return stream, flat.astype(np.uint16)


def unpack(stream: np.ndarray, table: np.ndarray, n: int, alphabets, lanes: int,
           pooled: bool = False) -> np.ndarray:
    """Inverse of ``pack``: the (lanes, n) symbols."""
    sizes = _alphabets(alphabets, lanes)
    table = np.asarray(table, dtype=np.uint16)
    if pooled:
        freqs = table
    else:
        if table.shape[0] != int(sizes.sum()):
            raise ValueError(f"the table holds {table.shape[0]} entries, expected {int(sizes.sum())}")
        width = int(sizes.max()) if lanes else 1
        freqs = np.zeros((lanes, width), np.uint16)
        starts = np.concatenate([[0], np.cumsum(sizes)])
        for i in range(lanes):
            freqs[i, : sizes[i]] = table[starts[i] : starts[i + 1]]
    return decode(np.asarray(stream, dtype=np.uint8).tobytes(), freqs, n, lanes=lanes)
