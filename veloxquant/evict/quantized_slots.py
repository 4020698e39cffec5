"""Kept tokens held quantized: the storage of an eviction method composed with a quantizer.

``KVCacheConfig(method="snapkv", options=..., storage=KIVIOptions(...), kv_bits=4)``: the
eviction method decides which tokens stay, this store decides how each kept token is
held. It has ``SlotStore``'s interface, so the scorer base keeps, gathers, frees and
saves slots exactly as it does for full-precision slots.

While the prompt comes in, tokens are held in full precision: the method scores at the
prompt's end over the keys the model gave, so it keeps the same positions as without
storage. Once the prompt has been scored (``pack``) the kept tokens are quantized. The
newest tokens, those the method protects as recent (``recent``: never evicted), are also
held in full precision, in a ring written in place (KIVI's full-precision window of the
newest tokens, here the method's own recent window): decode attention reads them from the
ring and masks their packed copies. Without it 2-bit storage lost the reference model (KL
1.2 nats against the full cache; 0.024 with it, benchmarks/results/composition-quick.md).

Since attention never reads a ring token's packed copy, a decode step writes its token
into the ring and its slot's position and state only; the packed rows of those pending
tokens are written together (``settle``: one quantization of up to ``window`` rows)
before the ring would overwrite the oldest of them, and before anything reads, moves or
saves the packed rows. Rows are quantized independently, so the codes are those a
per-step quantization gives, bit for bit. A method that scores over the room's keys at
every step (``room_keys``: Keyformer's noisy score reads the packed copies too) quantizes
each token as it is written. H2O's mass takes attention's own weights instead
(``step_weights``).

Quantizer: KIVI's min-max group-affine arithmetic at ``kv_bits`` in groups of
``kivi_group_size`` channels *per token*, for keys as for values (``quant/token_rows.py``).
KIVI's own keys are per channel, in groups of consecutive tokens; a group of slots
shares nothing here, because a decode step that frees one slot writes the next token
into it, and per-channel groups would then have to be requantized around it. Per-token
rows make a slot one independent row of codes, scales and minima.

Held per kept token and KV head: ``D * bits / 8`` bytes of codes and two ``D / group``
scales/minima in the model's dtype, for keys and for values; then, as without storage,
the position (int32) and the method's per-token state (float32 each). Per layer and KV
head: the ring, ``recent`` rows of keys and values in the model's dtype.

Decode attention reads the packed rows as ``TokenRows`` does (the pure-MLX reads of
``kernels/decode.py``'s per-token parts: one ``quantized_matmul`` for ``q Kᵀ`` and one for
``p V`` on the CPU, a float32 dequantization of the kept rows on a GPU, where MLX's CUDA
back-end has no ``quantized_matmul`` for these shapes; the fused kernels read keys per
channel only), in one compiled pass with the ring under one softmax; scores that need
keys read them dequantized (a GPU's step dequantizes the keys once for both). On CUDA, where
no score reads the step's keys (Keyformer's), a step decodes every slot's rows in the model's
dtype, the ring's tokens' rows from the ring, and calls one fused attention (``_attend_rows``;
H2O's weights from one more product).
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..cache.buffers import row_indices, take_rows
from ..kernels import kivi_decode as kd
from ..quant.affine import _MIN_SCALE
from ..quant.groups import check_divides
from ..quant.packed import AffineLayout
from ..quant.token_rows import _mlx_has, compiled_quantizer, dequantize_rows, packs, quantize_rows
from . import slot_rows_kernel
from .store import SlotStore, consecutive_positions

PACKED = ("k_codes", "k_scales", "k_biases", "v_codes", "v_scales", "v_biases")
GROUP_FIELD = "kivi_group_size"


def storage_bits(config) -> tuple[int, int] | None:
    """(bits, group) of the config's storage for kept tokens; None without one."""
    if getattr(config, "storage", None) is None:
        return None
    return config.kv_bits, getattr(config.storage, GROUP_FIELD)


class QuantizedSlots:
    """``SlotStore``'s interface over slots whose keys and values are packed rows."""

    def __init__(self, names: tuple[str, ...], bits: int, group: int):
        self.names = names
        self.extra = tuple(n for n in names if n not in ("keys", "values"))
        self.bits, self.group = bits, group
        self.slots = SlotStore(names)
        self.quantized = False
        # The newest ``window`` tokens (those the method protects as recent: never evicted)
        # also in full precision, a ring written in place; their packed copies are masked.
        self.window, self.ring_next, self.ring_fill = 0, 0, 0
        self.k_ring: mx.array | None = None
        self.v_ring: mx.array | None = None
        # ``room_keys`` was asked (the method scores over the room's keys at decode steps),
        # and the keys ``attend_one`` dequantized for this step's ``room_keys``, with the
        # codes buffer they came from
        self._keys_read = False
        self._step_keys: tuple[mx.array, mx.array] | None = None
        # the newest slots whose packed rows are not written yet: their tokens are in the ring
        self.pending = 0
        # ``attend_one`` keeps its attention weights for ``step_weights`` (H2O's mass)
        self.keeps_weights = False
        self._step_weights: tuple | None = None

    # -- what the scorer base reads and writes -------------------------------------------
    @property
    def arrays(self):
        self.settle()
        return self.slots.arrays

    def grown(self, name: str):
        """The ``GrowingArray`` of one stored array (a method's token state: no pending
        row to write first)."""
        if name not in self.extra:
            self.settle()
        return self.slots.arrays[name]

    def buffers(self) -> list[mx.array]:
        """The slot arrays' buffers as the last step left them (pending rows unwritten):
        what a step wrote, for its output to depend on."""
        return self.slots.buffers()

    @property
    def free(self):
        return self.slots.free

    @free.setter
    def free(self, value):
        self.slots.free = value

    @property
    def rows(self) -> int:
        return self.slots.rows

    @property
    def kept(self) -> int:
        return self.slots.kept

    def view(self, name: str) -> mx.array | None:
        if name not in self.extra:
            self.settle()
        if not self.quantized or name not in ("keys", "values"):
            return self.slots.view(name)
        g = self.slots.arrays
        codes, scales, biases = (g[f"{name[0]}_{part}"] for part in ("codes", "scales", "biases"))
        if codes.view() is None:
            return None
        # one compiled pass over the buffers' room (retraced only when they grow), then the rows held
        rows = _dequantize_pass(self.group, self.bits)(codes.buffer, scales.buffer, biases.buffer)
        return rows if codes.length == codes.capacity else rows[:, :, : codes.length]

    def room_keys(self) -> mx.array | None:
        """The keys of every slot over the buffers' whole room, dequantized (rows past
        ``rows`` are spare room): what a compiled score over the room reads; None before
        the store is packed. After ``attend_one`` dequantized the same keys in float32 (a
        GPU, scales in float32: the same values), those."""
        if not self.quantized:
            return None
        g = self.slots.arrays
        codes, scales, biases = (g[f"k_{part}"] for part in ("codes", "scales", "biases"))
        if codes.buffer is None:
            return None
        self.settle()  # from now on each token is quantized as it is written (``_append_one``)
        self._keys_read = True
        step_keys, self._step_keys = self._step_keys, None  # held for this step only
        if step_keys is not None and step_keys[0] is codes.buffer and scales.buffer.dtype == mx.float32:
            return step_keys[1]
        return _dequantize_pass(self.group, self.bits)(codes.buffer, scales.buffer, biases.buffer)

    def step_weights(self):
        """The last ``attend_one``'s attention weights (with ``keeps_weights``), once; None
        otherwise: (weights over the slots' room (B, H, R, room), ring), ring None without
        one, else (weights over the ring (B, H, R, window), the slots' positions (B, H,
        room), the first position in the ring, the position at ring row 0 modulo
        ``window``, ``window``): a slot whose position p is in the ring reads row
        ``(p - base) % window`` there. One softmax over the packed rows and the ring's exact
        rows: the ring's tokens' packed copies weigh 0."""
        out, self._step_weights = self._step_weights, None
        return out

    def write(self, new: dict[str, mx.array], first_position: int | None = None) -> None:
        self._step_keys = self._step_weights = None  # a step's keys and weights are read within the step
        if "positions" not in new:
            keys = new["keys"]
            new = {**new, "positions": consecutive_positions(*keys.shape[:2], first_position, keys.shape[2])}
        if self.quantized:
            keys, values = new.pop("keys"), new.pop("values")
            if self._appends_one(keys):
                return self._append_one(keys, values, new)
            self.settle()
            if self.window:
                self._ring_write(keys, values)
            new = {**self._encode(keys, values), **new}
        self.slots.write(new)

    def _appends_one(self, keys: mx.array) -> bool:
        """A decode step's token appended into room the buffers already have (no free
        slot to fill, no growth): the steady state, one compiled pass (``_append_one``)."""
        if keys.shape[2] != 1 or self.slots.free is not None or self.slots.rows == 0:
            return False
        grown = list(self.slots.arrays.values())
        room = grown[0].capacity
        return grown[0].length < room and all(g.capacity == room and g.length == grown[0].length for g in grown)

    def _append_one(self, keys: mx.array, values: mx.array, new: dict[str, mx.array]) -> None:
        """``write`` of one token, the steady state: the token's keys and values quantized
        (one pass over both: rows are independent, so the codes are ``_encode``'s), its
        rows written at the end of every slot array and, with a window, into the ring."""
        d_k, d_v = keys.shape[-1], values.shape[-1]
        if d_k != d_v or keys.dtype != values.dtype:  # one pass needs one row shape
            new = {**self._encode(keys, values), **new}
            if self.window:
                self._ring_write(keys, values)
            return self.slots.write(new)
        self._encode_checks(d_k, d_v)
        deferred = self._defers()
        if deferred and self.pending == self.window:
            self.settle()  # the ring's slot this token takes holds the oldest pending token
        arrays = self.slots.arrays
        row = mx.array([arrays["k_codes"].length], mx.int32)
        rings = (self.k_ring, self.v_ring, mx.array([self.ring_next], mx.int32)) if self.window else ()
        written = self.extra if deferred else (*PACKED, *self.extra)
        step = _append_pass(self.bits, self.group, len(self.extra), bool(self.window), deferred)
        out = step(keys, values, row, _word_shifts(self.bits), *[arrays[n].buffer for n in written],
                   *[new[n] for n in self.extra], *rings)
        for name, buffer in zip(written, out):
            arrays[name].buffer = buffer
        for name in (*PACKED, *self.extra):
            arrays[name].length += 1
        self.pending += deferred
        if self.window:
            self.k_ring, self.v_ring = out[-2:]
            self.ring_next = (self.ring_next + 1) % self.window
            self.ring_fill = min(self.window, self.ring_fill + 1)

    def _defers(self) -> bool:
        """Whether a decode token's packed rows wait for ``settle``: its exact rows are in
        the ring, and no step reads the room's keys (Keyformer's noisy score reads the
        packed copies)."""
        return bool(self.window) and not self._keys_read

    def settle(self) -> None:
        """Write the packed rows of the pending tokens (the newest slots) from the ring,
        in one quantization."""
        n, self.pending = self.pending, 0
        if not n:
            return
        first = self.ring_next - n  # the ring's rows in token order, from the oldest pending
        index = mx.array([(first + i) % self.window for i in range(n)], mx.int32)
        arrays = self.slots.arrays
        row = mx.array([arrays["k_codes"].length - n], mx.int32)
        out = _settle_pass(self.bits, self.group)(self.k_ring, self.v_ring, index, row, _word_shifts(self.bits),
                                                  *[arrays[name].buffer for name in PACKED])
        for name, buffer in zip(PACKED, out):
            arrays[name].buffer = buffer

    def _ring_write(self, keys, values) -> None:
        """The newest rows into the ring, in place (order is free: attention needs none)."""
        w, i = self.window, self.ring_next
        keys, values = keys[:, :, -w:], values[:, :, -w:]
        n = keys.shape[2]
        first = min(n, w - i)  # up to the ring's end, the rest from its start
        self.k_ring[:, :, i : i + first] = keys[:, :, :first]
        self.v_ring[:, :, i : i + first] = values[:, :, :first]
        if n > first:
            self.k_ring[:, :, : n - first] = keys[:, :, first:]
            self.v_ring[:, :, : n - first] = values[:, :, first:]
        self.ring_next = (i + n) % w
        self.ring_fill = min(w, self.ring_fill + n)

    def set_limit(self, rows: int) -> None:
        self.slots.set_limit(rows)

    def update(self, name: str, values: mx.array) -> None:
        self.slots.update(name, values)

    def evict_one(self, slot: mx.array) -> None:
        self.settle()
        self.slots.evict_one(slot)

    def keep(self, slots: mx.array, spare: int = 0) -> None:
        self.settle()
        self.slots.keep(slots, spare)

    def truncate(self, rows: int) -> None:
        """Drop the newest slots (trim, while slots are in token order): the ring drops them too."""
        self.settle()
        dropped = self.slots.rows - rows
        self.slots.truncate(rows)
        if self.window and dropped > 0:
            self.ring_next = (self.ring_next - min(dropped, self.ring_fill)) % self.window
            self.ring_fill = max(0, self.ring_fill - dropped)

    def exact_history(self, tokens: int) -> bool:
        """Whether the newest ``tokens`` are all held as the model gave them."""
        return not self.quantized or tokens <= self.ring_fill

    @property
    def side_arrays(self) -> dict[str, mx.array | None]:
        """What is kept beside the slots (saved, counted in ``nbytes``)."""
        return {"k_ring": self.k_ring, "v_ring": self.v_ring}

    @property
    def meta(self) -> dict[str, int]:
        return {"ring_next": self.ring_next, "ring_fill": self.ring_fill}

    def restore_meta(self, meta) -> None:
        self.ring_next, self.ring_fill = int(meta["ring_next"]), int(meta["ring_fill"])

    def restore(self, arrays: dict[str, mx.array | None], free: mx.array | None) -> None:
        """A saved state names its arrays: packed rows (``k_codes`` ...) or, saved before
        the prompt ended, full-precision ``keys``/``values``."""
        self.quantized = "k_codes" in arrays
        self._step_keys, self.pending = None, 0
        self.k_ring, self.v_ring = arrays.get("k_ring"), arrays.get("v_ring")
        self.window = 0 if self.k_ring is None else self.k_ring.shape[2]
        self.slots = SlotStore((*PACKED, *self.extra) if self.quantized else self.names)
        self.slots.restore(arrays, free)

    def layout_problems(self, head_dims: tuple[int, int]):
        """(field, found, expected) for each packed array whose width contradicts the
        config and the model's head_dims (a saved state)."""
        if not self.quantized:
            return
        if self.window and not (0 <= self.ring_next < self.window and 0 <= self.ring_fill <= self.window):
            yield "ring_next, ring_fill", (self.ring_next, self.ring_fill), f"within the ring's {self.window} rows"
        for ring, d in ((self.k_ring, head_dims[0]), (self.v_ring, head_dims[1])):
            if ring is not None and ring.shape[2:] != (self.window, d):
                yield "ring rows x head_dim", ring.shape[2:], (self.window, d)
        for p, d in zip("kv", head_dims):
            for name, width in ((f"{p}_codes", d * self.bits // 32), (f"{p}_scales", d // self.group),
                                (f"{p}_biases", d // self.group)):
                x = self.slots.view(name)
                if x is not None and x.shape[3:] != (width,):
                    yield (f"{name} width", x.shape[3:], f"({width},) for head_dim {d} at "
                           f"kv_bits={self.bits}, kivi_group_size={self.group}")

    # -- quantization -----------------------------------------------------------------------
    def _encode_checks(self, d_k: int, d_v: int) -> None:
        check_divides(GROUP_FIELD, self.group, d_k, d_v)
        if not (packs(d_k, self.bits) and packs(d_v, self.bits)):
            raise ValueError(f"kv_bits={self.bits}: codes of head_dim {d_k} (values {d_v}) do not "
                             "fill whole 32-bit words; allowed: a head_dim that does")

    def _encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        self._encode_checks(keys.shape[-1], values.shape[-1])
        if keys.shape[2] == 1:  # a decode step: one compiled graph, the same codes
            encode = compiled_quantizer(self.group, self.bits)
        else:
            encode = lambda x: quantize_rows(x, self.group, self.bits)  # noqa: E731
        out = {}
        for p, x in (("k", keys), ("v", values)):
            out[f"{p}_codes"], out[f"{p}_scales"], out[f"{p}_biases"] = encode(x)
        return out

    def pack(self, window: int = 0) -> None:
        """The prompt has been scored: quantize the kept tokens (one batched step); every
        later token is quantized as it is written."""
        if self.quantized:
            return
        self.quantized = True
        old = self.slots
        self.slots = SlotStore((*PACKED, *self.extra))
        if old.view("keys") is None:
            return
        if window:
            positions = old.view("positions")
            w = min(window, positions.shape[2])
            newest = mx.argsort(positions, axis=-1)[..., -w:]
            k, v = old.view("keys"), old.view("values")
            b, h, _, dk = k.shape
            self.window, self.ring_fill, self.ring_next = window, w, w % window
            self.k_ring = mx.zeros((b, h, window, dk), k.dtype)
            self.v_ring = mx.zeros((b, h, window, v.shape[3]), v.dtype)
            self.k_ring[:, :, :w] = take_rows(k, newest)
            self.v_ring[:, :, :w] = take_rows(v, newest)
        limit = old.arrays["positions"].limit
        arrays = {**self._encode(old.view("keys"), old.view("values")),
                  # copies: a slice of the old buffers would keep all of them alive
                  **{n: mx.contiguous(old.view(n) + 0) for n in self.extra}}
        self.slots.restore(arrays, old.free)
        for grown in self.slots.arrays.values():
            grown.limit = limit

    # -- decode attention -------------------------------------------------------------------
    def _layout(self, p: str) -> AffineLayout:
        g = self.slots.arrays
        return AffineLayout(g[f"{p}_codes"].buffer, g[f"{p}_scales"].buffer, g[f"{p}_biases"].buffer,
                            self.rows, self.bits, self.group, "token")

    def attend_one(self, queries: mx.array, scale: float, offset: int = 0) -> mx.array:
        """One query token over every slot, read packed: (B, Hq, 1, D). One softmax over
        one run of rows: no partial states to merge (``kernels/decode.py``'s several-part
        path), which keeps the step's graph small. One compiled pass over the buffers'
        whole room (rows past the slot count masked, the counts passed as arrays): it
        retraces only when the buffers grow. Where it dequantizes the keys (a GPU) and the
        method read the room's keys at its last step (``room_keys``: Keyformer's noisy
        score), it keeps them for this step's ``room_keys``: the same values, dequantized
        once. With ``keeps_weights`` it keeps its weights for ``step_weights``."""
        g = self.slots.arrays
        n = self.ring_fill
        qmm = _mlx_has(self.bits, self.group) and kd._pure_path() == "qmm"
        keys_out = self._keys_read and not qmm
        if not keys_out and reads_rows_on_cuda():
            return self._attend_rows(queries, scale, offset)
        attend = _attend_pass(self.bits, self.group, float(scale), qmm, n > 0, n == self.window, keys_out,
                              self.keeps_weights)
        b, h, room = g["k_codes"].buffer.shape[:3]
        scores = (b, h, queries.shape[1] // h)
        rings = (self.k_ring, self.v_ring, mx.array(n, mx.int32), row_indices(self.window),
                 _zeros_view((*scores, self.window))) if n else ()
        out = attend(queries, *[g[name].buffer for name in PACKED], g["positions"].buffer,
                     mx.array(self.rows, mx.int32), mx.array(offset - n, mx.int32), row_indices(room),
                     _zeros_view((*scores, room)), *rings)
        if not (keys_out or self.keeps_weights):
            return out
        out = list(out)
        if keys_out:
            self._step_keys = (g["k_codes"].buffer, out.pop())
        if self.keeps_weights:
            # the next token, at ``offset``, goes to the ring's row ``ring_next``
            ring = (out[2], g["positions"].buffer, offset - n, offset - self.ring_next, self.window) if n else None
            self._step_weights = (out[1], ring)
        return out[0]

    def _attend_rows(self, queries: mx.array, scale: float, offset: int) -> mx.array:
        """On CUDA: every slot's rows decoded in the queries' dtype, the ring's tokens' rows
        taken from the ring (their packed copies may not be written yet), in one launch where
        ``slot_rows_kernel`` runs, and one fused attention over the slots held, with no mask:
        MLX's CUDA back-end fuses a one-row attention only without one, and the float32
        read's products are served by cuBLAS kernels that walk every token in a few blocks
        (``benchmarks/notes/cuda_dense_reads.md``).
        Each token is read once, as the float32 read reads it. (No gate on the queries, as
        the dense reads of ``cuda_dense_reads.md`` need: the chained-layer peak is the same
        with one, since the queries come first in the attention's inputs.) With
        ``keeps_weights`` the step's weights over the slots' room come from one more product
        of the queries and the decoded keys (the fused attention gives none); the ring's
        tokens are weighed at their slots."""
        g = self.slots.arrays
        packed = [g[name].buffer for name in PACKED]
        room, dtype = packed[0].shape[2], queries.dtype
        # a ring token at position p is in the ring's row (p - base) % window
        start, base = offset - self.ring_fill, offset - self.ring_next
        k_ring, v_ring = (self.k_ring, self.v_ring) if self.ring_fill else (None, None)
        backend = slot_rows_kernel.kernel_backend(dtype) if slot_rows_kernel.takes(
            packed, k_ring, v_ring, self.bits, dtype) else None
        if backend is not None:  # one launch; the room only where H2O's weights read it
            k, v = slot_rows_kernel.slot_rows(backend, packed, g["positions"].buffer, k_ring, v_ring,
                                              count=room if self.keeps_weights else self.rows, ring_start=start,
                                              base=base, bits=self.bits, group=self.group, dtype=dtype)
        else:
            rings = (g["positions"].buffer, mx.array(start, mx.int32), mx.array(base, mx.int32), k_ring,
                     v_ring) if self.ring_fill else ()
            k, v = _rows_pass(self.bits, self.group, dtype, bool(rings))(*packed, *rings)
        if self.keeps_weights:
            b, h = k.shape[:2]
            p = _weights_pass(float(scale))(queries, k, mx.array(self.rows, mx.int32), row_indices(room),
                                            _zeros_view((b, h, queries.shape[1] // h, room)))
            self._step_weights = (p, None)
        if self.rows < k.shape[2]:  # spare room past the slots held
            k, v = k[:, :, : self.rows], v[:, :, : self.rows]
        return mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale)


def reads_rows_on_cuda() -> bool:
    """Whether a step reads the decoded rows through one fused attention
    (``QuantizedSlots._attend_rows``): on CUDA (``benchmarks/read_ab.py`` turns it off)."""
    return kd.gpu_backend() == "cuda"


@functools.lru_cache(maxsize=None)
def _rows_pass(bits: int, group: int, dtype: mx.Dtype, ring: bool):
    """``QuantizedSlots._attend_rows``' decode: (the six packed buffers[, positions, ring
    start, the position at ring row 0, k_ring, v_ring]) -> every slot's keys and values in
    ``dtype`` over the buffers' room, a ring token's (position >= ring start) from the ring."""

    def rows(kc, ks, kb, vc, vs, vb, *rings):
        k, v = dequantize_rows(kc, ks, kb, group, bits, dtype), dequantize_rows(vc, vs, vb, group, bits, dtype)
        if not ring:
            return k, v
        positions, start, base, k_ring, v_ring = rings
        in_ring = (positions >= start)[..., None]
        index = ((positions - base) % k_ring.shape[2])[..., None]
        return (mx.where(in_ring, mx.take_along_axis(k_ring, index, axis=2).astype(dtype), k),
                mx.where(in_ring, mx.take_along_axis(v_ring, index, axis=2).astype(dtype), v))

    return mx.compile(rows)


@functools.lru_cache(maxsize=None)
def _weights_pass(scale: float):
    """One query token's attention weights (B, H, R, room) over keys (B, H, room, D) in
    float32, rows past ``rows`` weighing 0: ``_attend_rows``' weights for H2O's mass."""

    def weights(queries, keys, rows, slot_ids, zeros):
        b, hq, _, d = queries.shape
        h = keys.shape[1]
        q = queries.astype(mx.float32).reshape(b, h, hq // h, d)
        s = mx.addmm(mx.where(slot_ids < rows, zeros, -float("inf")), q, keys.astype(mx.float32).swapaxes(-1, -2),
                     alpha=scale)
        return mx.softmax(s, axis=-1, precise=True)

    return mx.compile(weights)


def _dequantize_pass(group: int, bits: int):
    return _dequantize_compiled(group, bits, mx.default_device() == mx.cpu and 32 % bits == 0)


@functools.lru_cache(maxsize=None)
def _dequantize_compiled(group: int, bits: int, unpacked_here: bool):
    """``dequantize_rows`` at (group, bits) as one compiled graph. On the CPU, where
    ``mx.dequantize`` expands into a graph of one shift per code in a word, the words are
    unpacked in one shift (``kivi_decode.unpacked_affine``: the same values, bit for bit)."""

    def dequantize(codes, scales, biases):
        if not unpacked_here:
            return dequantize_rows(codes, scales, biases, group, bits)
        return kd.unpacked_affine(codes, scales, biases, group, bits)

    return mx.compile(dequantize)


@functools.lru_cache(maxsize=16)
def _zeros_view(shape: tuple[int, ...]) -> mx.array:
    """float32 zeros of ``shape`` as a broadcast of one zero (four bytes held, however
    large the shape): the addend of a product whose epilogue adds a mask, built once per
    shape and evaluated with the step that first reads it (a leaf after that)."""
    return mx.broadcast_to(mx.zeros((), mx.float32), shape)


@functools.lru_cache(maxsize=8)
def _word_shifts(bits: int) -> mx.array:
    """The shift of each code in a uint32 word (``pack_codes``' order), built once per
    width: an input of the append pass, evaluated with the step that first reads it."""
    return mx.arange(32 // bits, dtype=mx.uint32) * bits


def _whole_words(bits: int, group: int) -> bool:
    """Whether a group's codes fill whole words (``_quantized_pair``'s layout)."""
    return 32 % bits == 0 and group % (32 // bits) == 0


def _quantized_pair(keys, values, group: int, bits: int, shifts):
    """``quantize_rows`` of tokens' keys and of their values (B, H, N, D) in one pass:
    (k codes, k scales, k minima, v codes, v scales, v minima), each (B, H, N, ...). The
    same codes, scales and minima bit for bit (``quantize_rows``' arithmetic; a min or max
    is exact in any order, and disjoint bit fields sum exactly), with fewer operations:
    the rows viewed as (group, word, code in word), so one elementwise pass computes the
    codes shifted into place and one sum packs them (no reshape between), and the scales
    and minima cut from one array."""
    x = mx.concatenate([keys, values], axis=2)
    b, h, n, d = x.shape
    per_word = 32 // bits
    levels = (1 << bits) - 1
    groups = x.reshape(b, h, n, d // group, group // per_word, per_word).astype(mx.float32)
    low = groups.min(axis=(-2, -1), keepdims=True)
    high = groups.max(axis=(-2, -1), keepdims=True)
    scale = mx.maximum((high - low) / levels, _MIN_SCALE).astype(x.dtype)
    low = low.astype(x.dtype)
    codes = mx.clip(mx.round((groups - low.astype(mx.float32)) / scale.astype(mx.float32)), 0, levels)
    words = (codes.astype(mx.uint32) << shifts).sum(axis=-1, keepdims=True).astype(mx.uint32)
    kc, vc = mx.split(words.reshape(b, h, n, d * bits // 32), 2, axis=2)
    ks, vs, km, vm = mx.split(mx.concatenate([scale, low], axis=2).reshape(b, h, 2 * n, d // group), 4, axis=2)
    return kc, ks, km, vc, vs, vm


def _packed_rows(keys, values, group: int, bits: int, shifts):
    """``quantize_rows`` of keys and of values (B, H, N, D): (k codes, k scales, k minima,
    v codes, v scales, v minima)."""
    if _whole_words(bits, group):
        return _quantized_pair(keys, values, group, bits, shifts)
    codes, scales, minima = quantize_rows(mx.concatenate([keys, values], axis=2), group, bits)
    (kc, vc), (ks, vs), (km, vm) = (mx.split(x, 2, axis=2) for x in (codes, scales, minima))
    return kc, ks, km, vc, vs, vm


@functools.lru_cache(maxsize=None)
def _settle_pass(bits: int, group: int):
    """``QuantizedSlots.settle``'s pass: (k_ring, v_ring, ring rows in token order, first
    slot, word shifts, the six packed buffers) -> the six buffers with those tokens' packed
    rows written from the first slot on."""

    def settle(k_ring, v_ring, index, row, shifts, *packed):
        rows = _packed_rows(mx.take(k_ring, index, axis=2), mx.take(v_ring, index, axis=2), group, bits, shifts)
        return [mx.slice_update(b, r, row, axes=(2,)) for b, r in zip(packed, rows)]

    return mx.compile(settle)


@functools.lru_cache(maxsize=None)
def _append_pass(bits: int, group: int, n_extra: int, ring: bool, deferred: bool = False):
    """``QuantizedSlots._append_one``'s pass: (keys, values, row, word shifts, the six packed
    buffers, the extra buffers, the extra rows[, k_ring, v_ring, ring row]) -> the new buffers;
    ``deferred``: without the packed buffers (their rows are written by ``settle``)."""
    n_packed = 0 if deferred else 6

    def step(keys, values, row, shifts, *rest):
        packed, rest = rest[:n_packed], rest[n_packed:]
        extra, extra_rows = rest[:n_extra], rest[n_extra : 2 * n_extra]
        rows = () if deferred else _packed_rows(keys, values, group, bits, shifts)
        out = [mx.slice_update(b, r, row, axes=(2,)) for b, r in zip((*packed, *extra), (*rows, *extra_rows))]
        if ring:
            k_ring, v_ring, ring_row = rest[2 * n_extra :]
            out += [mx.slice_update(k_ring, keys, ring_row, axes=(2,)),
                    mx.slice_update(v_ring, values, ring_row, axes=(2,))]
        return out

    return mx.compile(step)


@functools.lru_cache(maxsize=None)
def _attend_pass(bits: int, group: int, scale: float, qmm: bool, ring: bool, ring_full: bool, keys_out: bool,
                 weights_out: bool = False):
    """``QuantizedSlots.attend_one``'s pass: (queries, the six packed buffers, positions,
    rows, ring start, slot ids[, k_ring, v_ring, ring fill, ring ids]) -> the attention
    output (and, with ``keys_out``, the float32 keys it dequantized; with ``weights_out``,
    the weights over the packed rows and over the ring, or None without one). Rows past ``rows`` and
    the ring's tokens' packed copies (positions >= ring start) are masked. ``qmm``: the
    packed rows read by ``quantized_matmul`` (the CPU), else dequantized in float32 (a GPU).
    One softmax over the packed rows and the ring; the two products of ``p V`` in one
    ``addmm``."""

    def attend(queries, kc, ks, kb, vc, vs, vb, positions, rows, ring_start, slot_ids, zeros, *rings):
        b, hq, _, d = queries.shape
        h = kc.shape[1]
        q = queries.astype(mx.float32).reshape(b, h, hq // h, d)
        visible = slot_ids < rows
        if ring:
            visible = visible & (positions[:, :, None, :] < ring_start)
        keys = None
        if qmm:
            s = mx.quantized_matmul(q * scale, kc, ks, kb, transpose=True, group_size=group, bits=bits)
            s = mx.where(visible, s, -float("inf"))
        else:  # the scale and the mask in the product's epilogue: scale q Kᵀ + (0 or -inf)
            keys = dequantize_rows(kc, ks, kb, group, bits, mx.float32)
            s = mx.addmm(mx.where(visible, zeros, -float("inf")), q, keys.swapaxes(-1, -2), alpha=scale)
        if ring:
            k_ring, v_ring, fill, ring_ids, ring_zeros = rings
            hidden = ring_zeros if ring_full else mx.where(ring_ids < fill, ring_zeros, -float("inf"))
            r = mx.addmm(hidden, q, k_ring.astype(mx.float32).swapaxes(-1, -2), alpha=scale)
            p, p_ring = mx.split(mx.softmax(mx.concatenate([s, r], axis=-1), axis=-1, precise=True),
                                 [s.shape[-1]], axis=-1)
        else:
            p = mx.softmax(s, axis=-1, precise=True)
        if qmm:
            o = mx.quantized_matmul(p, vc, vs, vb, transpose=False, group_size=group, bits=bits)
        else:
            o = kd.token_mix(p, dequantize_rows(vc, vs, vb, group, bits, mx.float32))
        if ring:
            o = mx.addmm(o, p_ring, v_ring.astype(mx.float32))
        o = o.reshape(b, hq, 1, -1).astype(queries.dtype)
        extra = ((p, p_ring) if ring else (p,)) if weights_out else ()
        extra += (keys,) if keys_out else ()
        return (o, *extra) if extra else o

    return mx.compile(attend)


def slot_store(config, names: tuple[str, ...]):
    """The slots of an eviction cache: full precision, or quantized when the config has a
    storage for kept tokens."""
    spec = storage_bits(config)
    return SlotStore(names) if spec is None else QuantizedSlots(names, *spec)
