"""The decode step of an eviction method whose kept tokens are held quantized
(``evict/quantized_slots.py``, issue 30): the token's keys and values quantized in one
pass laid out as (group, word, code) give ``quantize_rows``' codes, scales and minima bit
for bit; the attention over the packed rows and the ring (one softmax, the scale and the
masks in the products' epilogues, the ring's ``p V`` added in an ``addmm``) gives, over 40
decode steps that cross evictions and growths, what attention over the held history gives
(the dequantized rows, the ring's tokens as the model gave them), to float32
reassociation, on the CPU's path and a GPU's; and H2O's accumulated mass, which reads the
keys a GPU's step dequantized for attention, stays bit for bit what it was."""

import mlx.core as mx
import pytest

from conformance import config, split_composed
from feeding import feed, run_prompt, synthetic_kvq
from veloxquant_mlx.evict import quantized_slots as qs
from veloxquant_mlx.kernels import kivi_decode as kd
from veloxquant_mlx.quant.token_rows import dequantize_rows, quantize_rows
from veloxquant_mlx.registry import METHODS

EPS = float(mx.finfo(mx.float32).eps)
BUDGET, HEAD_DIM, STEPS = 40, 64, 40
COMPOSED = ("tova+kivi4", "snapkv+kivi4", "h2o+kivi2")
OTHER_WIDTHS = ("tova+kivi2", "snapkv+kivi8", "h2o+kivi4")  # the other widths kv_bits allows


def composed_cache(method: str, group: int = 32):
    base, composed = split_composed(method)
    cls = METHODS[base].load_implementation()
    cache = cls(config(method, {cls.roles.budget: BUDGET, "storage": {
        "method": "kivi", "options": {"kivi_group_size": group}}}))
    return cache, composed["kv_bits"], group


def held(cache, k, v, group, bits):
    """What the step attends over: every slot's row dequantized in float32, but the newest
    ``ring_fill`` tokens as the model gave them (B, H, rows, D) each."""
    store = cache.store
    packed = {p: [store.view(f"{p}_{n}") for n in ("codes", "scales", "biases")] for p in "kv"}
    keys, values = (dequantize_rows(*packed[p], group, bits, mx.float32) for p in "kv")
    positions = store.view("positions")
    in_ring = (positions >= cache.offset - store.ring_fill)[..., None]
    index = mx.maximum(positions, 0)[..., None]
    exact_k, exact_v = (mx.take_along_axis(x.astype(mx.float32), index, axis=2) for x in (k, v))
    return mx.where(in_ring, exact_k, keys), mx.where(in_ring, exact_v, values)


def reassociation_bound(q, k_hat, v_hat, scale):
    """What float32 reassociation may move one output by, from the operands: each score is a
    sum of D products (moved by at most D eps times the sum of their magnitudes), which moves
    every softmax weight by a relative 2 max|delta s| at most; the mix is a sum of T products
    (moved by T eps max|v| at most). Twice that, for the rounding of the steps around them
    (the scale applied before or after the product, the ring's ``p V`` added in the
    product's epilogue)."""
    b, hq, _, d = q.shape
    h = k_hat.shape[1]
    qg = (q.reshape(b, h, hq // h, d) * scale).astype(mx.float32)
    magnitude = mx.abs(qg) @ mx.abs(k_hat).swapaxes(-1, -2)
    ds = d * EPS * float(magnitude.max())
    vmax, t = float(mx.abs(v_hat).max()), k_hat.shape[2]
    return 2 * vmax * (2 * ds + t * EPS)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_one_pass_quantizer_is_quantize_rows_bit_for_bit(bits, group, dtype):
    b, h, d = 2, 3, 128
    k = mx.random.normal((b, h, 1, d), key=mx.random.key(bits + group)) * (1 + 20 * (mx.arange(d) % 7 == 0))
    v = mx.random.normal((b, h, 1, d), key=mx.random.key(bits + group + 1))
    v = mx.where(mx.arange(d) < group, 0.25, v)  # a constant group: the smallest scale, codes 0
    k, v = k.astype(dtype), v.astype(dtype)
    shifts = qs._word_shifts(bits)
    want = (*quantize_rows(k, group, bits), *quantize_rows(v, group, bits))
    compiled = mx.compile(lambda k, v, s: qs._quantized_pair(k, v, group, bits, s))  # as the append pass runs it
    for got in (qs._quantized_pair(k, v, group, bits, shifts), compiled(k, v, shifts)):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert mx.array_equal(g, w)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])  # 3: codes straddle words, ``quantize_rows``' own pass
def test_the_append_pass_writes_quantize_rows_codes_at_the_row(bits):
    b, h, d, room, row, group = 1, 2, 64, 8, 5, 32
    k = mx.random.normal((b, h, 1, d), key=mx.random.key(1))
    v = mx.random.normal((b, h, 1, d), key=mx.random.key(2))
    want = (*quantize_rows(k, group, bits), *quantize_rows(v, group, bits))
    buffers = [mx.zeros((b, h, room, x.shape[-1]), x.dtype) for x in want]
    position = mx.full((b, h, 1), 7, mx.int32)
    out = qs._append_pass(bits, group, 1, False)(k, v, mx.array([row], mx.int32), qs._word_shifts(bits),
                                                 *buffers, mx.zeros((b, h, room), mx.int32), position)
    for got, w in zip(out, want):
        assert mx.array_equal(got[:, :, row : row + 1], w)
        assert not mx.any(got[:, :, :row]).item() and not mx.any(got[:, :, row + 1 :]).item()
    assert mx.array_equal(out[-1][:, :, row : row + 1], position)


def _steps(method, pure_path, monkeypatch, n_prompt, batch=1):
    """The composed cache after a prompt of ``n_prompt`` tokens, then STEPS decode steps:
    yields (cache, the step's query, its output, the rows it attended over) after each
    step, the rows (``held``) taken between the write and the attention (an eviction
    follows attention)."""
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    cache, bits, group = composed_cache(method)
    k, v, q = synthetic_kvq(n_prompt + STEPS, 2, 2, HEAD_DIM, batch=batch)
    run_prompt(cache, k, v, q, n_prompt)
    for t in range(n_prompt, n_prompt + STEPS):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        rows = held(cache, k, v, group, bits)
        mx.eval(rows)
        out = cache.attend(q[:, :, t : t + 1], keys, values, scale=HEAD_DIM**-0.5, mask=None)
        yield cache, q[:, :, t : t + 1], out, rows


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])  # the CPU's path, a GPU's
@pytest.mark.parametrize("method", COMPOSED + OTHER_WIDTHS)
@pytest.mark.parametrize("n_prompt, batch", [(150, 1), (150, 2), (6, 1)], ids=["long", "batch2", "short"])
def test_forty_decode_steps_match_attention_over_the_held_history(method, pure_path, n_prompt, batch,
                                                                  monkeypatch):
    scale = HEAD_DIM**-0.5
    appended, rows_seen, capacities, spare, ring_fills = 0, [], set(), 0, set()
    real_append = qs.QuantizedSlots._append_one

    def counting(self, *args):
        nonlocal appended
        appended += 1
        return real_append(self, *args)

    monkeypatch.setattr(qs.QuantizedSlots, "_append_one", counting)
    for cache, q, out, (keys, values) in _steps(method, pure_path, monkeypatch, n_prompt, batch):
        store = cache.store
        want = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)
        err, bound = float(mx.abs(out - want).max()), reassociation_bound(q, keys, values, scale)
        assert err <= bound, (len(rows_seen), err, bound)
        rows_seen.append(store.rows)
        capacity = store.arrays["k_codes"].capacity
        capacities.add(capacity)
        spare = max(spare, capacity - keys.shape[2])
        ring_fills.add((store.ring_fill, store.window))
    # most steps took the steady path; the steps crossed an eviction (the rows fell) or a
    # growth (the room changed) and read buffers with room past the count
    assert appended >= STEPS * 3 // 4
    fell = any(b < a for a, b in zip(rows_seen, rows_seen[1:]))
    assert fell or len(capacities) > 1
    assert spare > 0
    if n_prompt < BUDGET // 4:  # the ring filled during the steps: read part-full, then full
        assert any(f < w for f, w in ring_fills) and any(f == w for f, w in ring_fills)


def _unshared(store):
    """``store`` as it read Keyformer's keys before: ``attend_one`` keeps no keys for ``room_keys``
    (which then dequantizes them itself, in the scales' dtype)."""
    attend_one = store.attend_one

    def attend(*args, **kwargs):
        out = attend_one(*args, **kwargs)
        store._step_keys = None
        return out

    store.attend_one = attend


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16], ids=["float32", "float16"])
def test_keyformer_score_is_bit_for_bit_with_the_keys_attention_dequantized(pure_path, dtype, monkeypatch):
    """Keyformer's noisy score reads every slot's keys at each step: on a GPU's path it
    reads those attention dequantized, to the same score bit for bit."""
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    scale = HEAD_DIM**-0.5
    shared, bits, _ = composed_cache("keyformer+kivi2")
    alone, _, _ = composed_cache("keyformer+kivi2")
    k, v, q = (x.astype(dtype) for x in synthetic_kvq(150 + STEPS, 2, 2, HEAD_DIM, seed=7))
    for cache in (shared, alone):
        run_prompt(cache, k, v, q, 150)
    _unshared(alone.store)
    reused, rows = 0, []
    real_room_keys = qs.QuantizedSlots.room_keys

    def room_keys(self):
        nonlocal reused
        kept = self._step_keys
        keys = real_room_keys(self)
        reused += kept is not None and keys is kept[1]
        return keys

    monkeypatch.setattr(qs.QuantizedSlots, "room_keys", room_keys)
    for t in range(150, 150 + STEPS):
        outs = [feed(c, k, v, q, t, t + 1) for c in (shared, alone)]
        assert mx.array_equal(outs[0], outs[1])
        assert mx.array_equal(shared.store.view("score"), alone.store.view("score"))
        assert mx.array_equal(shared.store.view("positions"), alone.store.view("positions"))
        rows.append(shared.store.rows)
        assert shared.store._step_keys is None  # no keys held past the step
    assert any(b < a for a, b in zip(rows, rows[1:]))  # an eviction among the steps
    # a GPU's path with float32 scales reads the keys attention dequantized, at every step
    # but the first (which tells the store that the method reads them) ...
    if pure_path == "reference" and dtype == mx.float32:
        assert reused >= STEPS - 3
    else:  # ... the CPU reads them by quantized_matmul, float16 scales round otherwise
        assert reused == 0


def _attention_weights(q, keys, scale):
    """Attention's weights of one query token (B, Hq, 1, D) over rows (B, H, rows, D),
    averaged over the query rows of each KV head: (B, H, rows), float32."""
    b, hq, _, d = q.shape
    h = keys.shape[1]
    qg = q.astype(mx.float32).reshape(b, h, hq // h, d)
    return mx.softmax(scale * qg @ keys.swapaxes(-1, -2), axis=-1, precise=True).mean(axis=2)


@pytest.mark.parametrize("pure_path, dtype", [("qmm", mx.float32), ("qmm", mx.float16), ("reference", mx.float32),
                                              ("reference", mx.float16), ("cuda", mx.float32),
                                              ("cuda-kernel", mx.float32)],
                         ids=["qmm-float32", "qmm-float16", "reference-float32", "reference-float16", "cuda",
                              "cuda-kernel"])
@pytest.mark.parametrize("decay", [1.0, 0.9])
def test_h2o_adds_the_weight_attention_gave_each_kept_token(pure_path, dtype, decay, monkeypatch):
    """Over packed slots, a step's mass is attention's own weights (one softmax over the
    packed rows and the ring's exact rows), not a second softmax over packed copies: each
    slot gains what attention over the held history gave its token, to float32
    reassociation, the ring's tokens included (their packed copies weigh nothing). On
    CUDA (float32 here: the decoded rows in the model's dtype are the float32 read's) the
    weights come from the decoded rows, the ring's tokens at their slots."""
    # the float32 read's paths on any device (a CUDA device's own read is the "cuda" cases)
    cuda = pure_path.startswith("cuda")
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda" if cuda else None)
    monkeypatch.setattr(kd, "_pure_path", lambda: "reference" if cuda else pure_path)
    launches = through_the_kernel(monkeypatch) if pure_path == "cuda-kernel" else None
    scale = HEAD_DIM**-0.5
    base, composed = split_composed("h2o+kivi2")
    cls = METHODS[base].load_implementation()
    cache = cls(config("h2o+kivi2", {"h2o_budget": BUDGET, "h2o_decay": decay, "storage": {
        "method": "kivi", "options": {"kivi_group_size": 32}}}))
    bits, group = composed["kv_bits"], 32
    k, v, q = (x.astype(dtype) for x in synthetic_kvq(150 + STEPS, 2, 2, HEAD_DIM, seed=7))
    run_prompt(cache, k, v, q, 150)
    compared, ring_gains = 0, []
    for t in range(150, 150 + STEPS):
        before, rows = cache.store.view("mass"), cache.store.rows
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        hk, _ = held(cache, k, v, group, bits)
        new = _attention_weights(q[:, :, t : t + 1], hk, scale)
        positions = cache.store.view("positions")
        cache.attend(q[:, :, t : t + 1], keys, values, scale=scale, mask=None)
        if cache.store.rows < rows + 1:  # this step evicted: the slots moved
            continue
        old = mx.concatenate([before * decay, mx.zeros((*before.shape[:2], 1))], axis=2)  # the new token's: 0
        got, want = cache.store.view("mass"), old + new
        # each weight from scores moved by float32 reassociation: relative 2 ds at most
        qg = (q[:, :, t : t + 1].astype(mx.float32) * scale).reshape(1, 2, 2, HEAD_DIM)
        ds = HEAD_DIM * EPS * float((mx.abs(qg) @ mx.abs(hk).swapaxes(-1, -2)).max())
        assert mx.all(mx.abs(got - want) <= 4 * ds * new + 4 * EPS * mx.abs(want)).item(), t
        ring_gains.append(float(mx.where(positions >= cache.offset - cache.store.ring_fill, new, 0).sum()))
        compared += 1
    assert compared >= STEPS - 4 and min(ring_gains) > 0.05  # most steps; the ring's tokens drew weight
    if launches is not None:  # the kernel wrote the buffers' whole room: the weights are over it
        assert len(launches) == STEPS and all(n == room for n, room in launches)


@pytest.mark.parametrize("method", COMPOSED)
def test_a_packed_decode_step_returns_its_own_rows_and_attention_with_sinks_reads_the_store(method):
    """At a steady decode step ``update_and_fetch`` returns the token's own rows (the packed
    read does not take them: no dequantized views built for nothing). Attention with sinks
    (the fused attention over every held row) then reads the store's rows itself: it equals
    MLX's fused attention with those sinks over the rows the store holds dequantized, to the
    rounding of the same call."""
    cache, bits, group = composed_cache(method)
    k, v, q = synthetic_kvq(150 + 4, 2, 2, HEAD_DIM)
    run_prompt(cache, k, v, q, 150)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    for t in range(150, 154):
        keys, values = cache.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert keys.shape[2] == values.shape[2] == 1
        rows = [cache.store.view("keys"), cache.store.view("values")]
        out = cache.attend(q[:, :, t : t + 1], keys, values, scale=HEAD_DIM**-0.5, mask=None, sinks=sinks)
        want = mx.fast.scaled_dot_product_attention(q[:, :, t : t + 1], *rows, scale=HEAD_DIM**-0.5,
                                                    sinks=sinks)
        assert rows[0].shape[2] > BUDGET
        assert mx.allclose(out, want, rtol=0, atol=1e-6).item()


@pytest.mark.parametrize("pure_path", ["qmm", "reference"])
@pytest.mark.parametrize("method", ("tova+kivi4", "snapkv+kivi4", "tova+kivi2", "snapkv+kivi8"))
@pytest.mark.parametrize("n_prompt, batch", [(150, 1), (150, 2), (6, 1)], ids=["long", "batch2", "short"])
def test_tokens_packed_a_window_at_a_time_decode_as_tokens_packed_each_step(method, pure_path, n_prompt, batch,
                                                                            monkeypatch):
    """A decode token's packed rows written later, with the ring's other pending tokens
    (``settle``), give every step's output and every saved array bit for bit what packing
    each token as it comes gives; a state saved with tokens pending restores to the same."""
    monkeypatch.setattr(kd, "_pure_path", lambda: pure_path)
    (later, _, _), (each, _, _) = composed_cache(method), composed_cache(method)
    steps = 60
    k, v, q = synthetic_kvq(n_prompt + steps, 2, 2, HEAD_DIM, batch=batch)
    for cache in (later, each):
        run_prompt(cache, k, v, q, n_prompt)
    each.store._defers = lambda: False
    pending, middle = [], n_prompt + steps // 2
    for t in range(n_prompt, n_prompt + steps):
        if t == middle:  # saved with tokens pending: the copy goes on from the file's arrays
            assert later.store.pending > 0
            later = type(later).from_state(later.state)
        out_later, out_each = feed(later, k, v, q, t, t + 1), feed(each, k, v, q, t, t + 1)
        pending.append(later.store.pending)
        assert each.store.pending == 0 and mx.array_equal(out_later, out_each), t
    # tova's ring (10 tokens at this budget) filled with pending tokens and wrapped round;
    # snapkv's (32) was settled first by its buffers' growth
    window = later.store.window
    assert max(pending) == window if method.startswith("tova") else max(pending) > window // 2
    saved, want = later.state, each.state
    assert later.store.pending == 0 and saved["meta"] == want["meta"]
    for name, a in want["arrays"].items():
        assert (a is None and saved["arrays"][name] is None) or mx.array_equal(saved["arrays"][name], a), name


def through_the_kernel(monkeypatch):
    """The store's CUDA read as it runs where the slot-rows kernel passed its check, the
    kernel replaced by what it computes through MLX's ops (``slot_rows_kernel.reference_rows``:
    its emulated CUDA source is held to that in ``test_slot_rows_kernel.py``), a stand-in
    that checks what the store passes it; the calls made, appended as they are."""
    from veloxquant_mlx.evict import slot_rows_kernel as sk

    calls = []

    def slot_rows(backend, packed, *args, **kw):
        assert backend == "cuda" and kw["count"] <= packed[0].shape[2]
        calls.append((kw["count"], packed[0].shape[2]))  # the rows written, the buffers' room
        return sk.reference_rows(packed, *args, **kw)

    monkeypatch.setattr(sk, "kernel_backend", lambda dtype: "cuda")
    monkeypatch.setattr(sk, "slot_rows", slot_rows)
    return calls


@pytest.mark.parametrize("kernel", [False, True], ids=["mlx-pass", "kernel"])
@pytest.mark.parametrize("method", ("tova+kivi4", "snapkv+kivi4", "tova+kivi2", "snapkv+kivi8"))
@pytest.mark.parametrize("n_prompt, batch", [(150, 1), (150, 2), (6, 1)], ids=["long", "batch2", "short"])
def test_on_cuda_a_step_reads_the_decoded_rows_in_one_fused_attention(method, n_prompt, batch, kernel,
                                                                      monkeypatch):
    """On CUDA a step decodes every slot's rows in the queries' dtype, takes the ring's
    tokens from the ring (their packed rows pending or written), and calls one fused
    attention over the slots held, unmasked: over 60 steps with growths, room past the
    slots and the ring wrapping with tokens pending, what the float32 read gives, to float32
    reassociation; through MLX's ops, or the slot-rows kernel (its contract) asked for the
    slots held."""
    from sdpa_calls import one_row, recorded

    monkeypatch.setattr(kd, "_pure_path", lambda: "reference")
    steps, scale = 60, HEAD_DIM**-0.5
    k, v, q = synthetic_kvq(n_prompt + steps, 2, 2, HEAD_DIM, batch=batch)
    (read, bits, group), (cuda, _, _) = composed_cache(method), composed_cache(method)
    want, bounds = [], []
    run_prompt(read, k, v, q, n_prompt)
    for t in range(n_prompt, n_prompt + steps):
        want.append(feed(read, k, v, q, t, t + 1))
        # the rows it read: its output is bit for bit that of packing each token (above)
        bounds.append(reassociation_bound(q[:, :, t : t + 1], *held(read, k, v, group, bits), scale))
    run_prompt(cuda, k, v, q, n_prompt)
    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    launches = through_the_kernel(monkeypatch) if kernel else None
    fused, pending, rows, spare = recorded(monkeypatch), [], [], 0
    for t in range(n_prompt, n_prompt + steps):
        before = len(fused)
        keys, values = cuda.update_and_fetch(k[:, :, t : t + 1], v[:, :, t : t + 1])
        pending.append(cuda.store.pending)
        rows.append(cuda.store.rows)
        spare = max(spare, cuda.store.slots.arrays["k_codes"].capacity - rows[-1])  # no settle
        out = cuda.attend(q[:, :, t : t + 1], keys, values, scale=scale, mask=None)
        assert one_row(fused[before:]) == fused[before:] and [c.keys for c in fused[before:]] == [rows[-1]]
        err = float(mx.abs(out - want[t - n_prompt]).max())
        assert err <= bounds[t - n_prompt], (t, err, bounds[t - n_prompt])
    assert max(pending) > 0 and spare > 0  # tokens pending; room past the slots
    assert launches is None or [n for n, _ in launches] == rows  # one launch a step, for the slots held


def test_on_cuda_the_read_decodes_a_layers_rows_only_once_its_queries_exist(monkeypatch):
    """A layer's rows are not decoded ahead of its attention beside the other layers': from
    4 to 8 chained layers the step's peak grows by less than half of one layer's decoded
    rows (measured: 18.06 MiB at 4 and at 8; 14.0 at 1)."""
    from chained_layers import layer_rows, peak_growth

    from veloxquant_mlx import KVCacheConfig
    from veloxquant_mlx.cache.options import KIVIOptions, SnapKVOptions
    from veloxquant_mlx.methods.snapkv import SnapKVCache

    make = lambda: SnapKVCache(KVCacheConfig(method="snapkv", options=SnapKVOptions(snap_budget=2048),  # noqa: E731
                                             storage=KIVIOptions(), kv_bits=4), None, 0)
    assert peak_growth(make, 4, 8, monkeypatch) < layer_rows() / 2
