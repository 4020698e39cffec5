"""cachegen: anchors and deltas, the depth schedule, the coded saved form and its sizes."""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from conformance import config
from tiny_models import prompt, tiny_model
from veloxquant_mlx import load_prompt_cache, make_prompt_cache, save_prompt_cache
from veloxquant_mlx.methods.cachegen.cache import _lanes, layer_bits
from veloxquant_mlx.quant import entropy
from veloxquant_mlx.methods.cachegen.delta import AnchoredCodec, AnchoredTokens, dequantize_symmetric
from feeding import stored_decode_attention

B, H, T, D, G = 1, 2, 256, 64, 32


def _walk(seed=0):
    """Smooth over tokens: a random walk per channel, on a per-channel offset."""
    mx.random.seed(seed)
    return mx.cumsum(mx.random.normal((B, H, T, D)) * 0.1, axis=2) + mx.random.normal((B, H, 1, D)) * 2


def _run(x, bits=4, delta=True):
    run = AnchoredTokens(AnchoredCodec(bits, G, delta), 256)
    run.append(x)
    return run


def _half_scales(run):
    """s / 2 of every element (B, H, T, D): a token's own scales, or its anchor group's."""
    scales = mx.repeat(run.scales.view().astype(mx.float32), G, axis=-1) / 2
    return mx.repeat(scales, G, axis=2) if run.codec.use_delta else scales


@pytest.mark.parametrize("delta", [False, True])
def test_every_element_is_within_half_its_scale(delta):
    """Without delta: |x - x_hat| <= s/2. With delta the same bound holds for every token
    of the group: deltas are taken against the reconstructed anchor, so the anchor's
    error does not add to the others' (taken against the raw anchor, it would)."""
    x = _walk()
    run = _run(x, delta=delta)
    err = mx.abs(run.dense() - x)
    if delta:  # the anchors: 8-bit, within half their own scale
        anchors = dequantize_symmetric(*[a for a in run.unpacked()[2:]], 8)
        a_err = mx.abs(anchors - x[:, :, ::G])
        a_half = mx.repeat(run.anchor_scales.view().astype(mx.float32), G, axis=-1) / 2
        assert bool(mx.all(a_err <= a_half * (1 + 1e-5)))
        err, half = err.reshape(B, H, T // G, G, D)[:, :, :, 1:], _half_scales(run).reshape(B, H, T // G, G, D)[:, :, :, 1:]
    else:
        half = _half_scales(run)
    assert bool(mx.all(err <= half * (1 + 1e-5) + 1e-7)), float((err - half).max())


def _symbol_bits(run, skip_anchor):
    """Empirical entropy of the run's symbols, one table per channel, bits a symbol."""
    codes = np.asarray(run.unpacked()[0])
    if skip_anchor:
        codes = codes.reshape(B, H, T // G, G, D)[:, :, :, 1:].reshape(B, H, -1, D)
    lanes = _lanes(codes)
    return entropy.entropy_bits(entropy.histogram(lanes, 2 ** run.codec.bits - 1)) / lanes.size


@pytest.mark.parametrize("bits", [2, 4])
def test_on_a_random_walk_delta_symbols_have_lower_entropy_than_plain_ones(bits):
    """The card's invariant: deltas within an anchor group, on the anchor's step, crowd
    around zero (measured here at 4 bits: 1.16 bits a symbol against 1.66 plain, mean
    error 0.17 against 0.19; at 2 bits every delta rounds to zero, error 0.30 against 1.25). Their step is the anchor's range at ``bits`` bits, so the error
    stays that of plain coding (at most 1.5x it: the range of one token against the
    larger of the anchor's and the group's deltas')."""
    x = _walk()
    plain, delta = _run(x, bits, delta=False), _run(x, bits, delta=True)
    assert _symbol_bits(delta, True) < 0.75 * _symbol_bits(plain, False)
    e_plain = float(mx.abs(plain.dense() - x).mean())
    e_delta = float(mx.abs(delta.dense() - x).mean())
    assert e_delta < 1.5 * e_plain


class _Opts:
    def __init__(self, bits=4, groups=3, resolved=None):
        self.cachegen_bits, self.cachegen_layer_groups, self.cachegen_resolved_bits = bits, groups, resolved


def test_the_depth_schedule_never_adds_bits_with_depth_and_the_override_wins():
    for n_layers in (1, 2, 3, 4, 12, 32):
        for groups in (1, 2, 3, 5):
            widths = [layer_bits(_Opts(4, groups), i, n_layers) for i in range(n_layers)]
            assert widths == sorted(widths, reverse=True) and set(widths) <= {4, 5}
            assert (widths[0] == 5) == (groups > 1)
    assert [layer_bits(_Opts(4, 3), i, 32) for i in (0, 10, 11, 31)] == [5, 5, 4, 4]  # 32 layers: 0-10 first
    assert [layer_bits(_Opts(8, 3), 0, 32)] == [8]  # capped
    assert {layer_bits(_Opts(4, 3, resolved=2), i, 32) for i in range(32)} == {2}
    model = tiny_model("llama", num_hidden_layers=3)
    caches = make_prompt_cache(model, config("cachegen", {"cachegen_bits": 3}))
    assert [c.resolved_bits for c in caches] == [4, 3, 3]


def _prefilled(settings, n=600, layers=2):
    model = tiny_model("llama", num_hidden_layers=layers)
    cache = make_prompt_cache(model, config("cachegen", settings))
    tokens = prompt(n)
    model(tokens[:-1][None], cache=cache)
    model(tokens[-1:][None], cache=cache)
    return model, cache, tokens


def test_resident_bytes_follow_the_memory_formula_and_the_tail_is_exact():
    """Per layer: codes at b bits, float16 delta scales and anchors (8-bit codes + scales)
    per group of G tokens, the fp32 tail (< G tokens): within the 256-token growth step."""
    model, cache, tokens = _prefilled({"cachegen_group_size": 32}, n=600)
    for c in cache:
        b, h, d, g = c.resolved_bits, 2, 32, 32
        n = c.store.keys.count
        assert n == 576 and c.store.k_buf.length == 24
        per_token = h * b * d / 8 + h * (d + 2 * d / g + 2 * d / g) / g
        tail = 24 * h * d * 4
        exact = 2 * (n * per_token + tail)
        assert exact <= c.nbytes <= exact + 2 * 256 * per_token + 2 * 8 * h * d * 4, (c.nbytes, exact)
    store = cache[0].make_store()  # the tail holds the rows it was given, as they came
    x = mx.random.normal((1, 2, 100, 32), key=mx.random.key(5))
    store.commit(x[:, :, :70], x[:, :, :70])
    for i in range(70, 100):
        store.commit(x[:, :, i : i + 1], x[:, :, i : i + 1])
    assert store.keys.count == 96 and mx.array_equal(store.k_buf.view(), x[:, :, 96:])


def test_the_saved_form_is_the_coded_streams_and_beats_the_fixed_length_size():
    """stored_nbytes: the rANS streams, within 1% + the final states of the entropy of the
    symbols, their tables, the scales, the anchors, the tail; below the fixed-length size
    (b bits a symbol) of the same content (card: Ĥ <= log2(levels))."""
    model, cache, _ = _prefilled({"cachegen_group_size": 32}, n=600)
    for c in cache:
        arrays = c.stored_arrays()
        for p, run in (("k", c.store.keys), ("v", c.store.values)):
            codes = np.asarray(run.unpacked()[0]).reshape(1, 2, -1, 32, 32)[:, :, :, 1:].reshape(1, 2, -1, 32)
            lanes = _lanes(codes)
            ideal = entropy.entropy_bits(entropy.histogram(lanes, 2 ** run.codec.bits - 1)) / 8
            stream = arrays[f"{p}_stream"].nbytes
            assert stream <= 1.01 * ideal + 6 * lanes.shape[0], (stream, ideal)
            assert stream < lanes.size * run.codec.bits / 8
        resident_codes = sum(a.nbytes for k, a in arrays.items() if k.endswith("stream"))
        assert c.stored_nbytes < c.nbytes
        assert resident_codes < sum(r.codes.nbytes + r.anchor_codes.nbytes for r in (c.store.keys, c.store.values))


def test_saved_and_loaded_holds_the_same_codes_and_is_smaller_than_kivi(tmp_path):
    """A loaded cache decodes the streams to the very codes saved. The file is smaller than
    kivi's at 4 bits (measured on the tiny random model: 103.5 kB vs 126.6 kB, 0.82x; its
    symbols carry ~3.6 bits of entropy; benchmarks/saved_size.py measures the reference
    model)."""
    model, cache, tokens = _prefilled({"cachegen_resolved_bits": 4}, n=640)  # whole groups: no tail
    path = str(tmp_path / "cachegen.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for a, b in zip(cache, loaded):
        for x, y in ((a.store.keys, b.store.keys), (a.store.values, b.store.values)):
            assert all(mx.array_equal(p, q) for p, q in zip(x.unpacked(), y.unpacked()))
        assert a.store.k_buf.view() is None and b.store.k_buf.view() is None
        assert (a.offset, a.stored_length, a.resolved_bits) == (b.offset, b.stored_length, b.resolved_bits)
    kivi = make_prompt_cache(model, config("kivi", {"kv_bits": 4, "residual_window": 0}))
    model(tokens[None], cache=kivi)
    kivi_path = str(tmp_path / "kivi.safetensors")
    save_prompt_cache(kivi_path, kivi)
    assert os.path.getsize(path) < 0.85 * os.path.getsize(kivi_path)


def test_decode_attends_over_the_reconstructed_history():
    model, cache, _ = _prefilled({"cachegen_group_size": 32}, n=300)
    c = cache[1]
    q = mx.random.normal((1, 4, 1, 32), key=mx.random.key(3))
    k, v = c.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=32**-0.5)
    assert mx.allclose(stored_decode_attention(c, q, 32**-0.5), ref, atol=1e-5, rtol=1e-5)


def test_without_token_locality_deltas_keep_their_bound_but_not_plain_precision():
    """The reference model's K/V have almost no token locality (benchmarks/notes/
    cachegen_delta.md): independent tokens stand in for it. A delta from the anchor then
    has twice a token's variance, so its step, the wider of the anchor's range and the
    group's deltas', is wider than a token's own: coded at equal bits it is coarser than
    plain coding (the loss use_delta shows there), while every element stays within half
    its group's step wherever it sits in the group (errors do not accumulate)."""
    mx.random.seed(3)
    x = mx.random.normal((B, H, T, D))
    plain, delta = _run(x, 4, delta=False), _run(x, 4, delta=True)
    err = mx.abs(delta.dense() - x).reshape(B, H, T // G, G, D)[:, :, :, 1:]
    half = _half_scales(delta).reshape(B, H, T // G, G, D)[:, :, :, 1:]
    assert bool(mx.all(err <= half * (1 + 1e-5) + 1e-7))
    e_plain = float(mx.abs(plain.dense() - x).mean())
    assert float(err.mean()) > 1.2 * e_plain  # steps sqrt(2) and more wider: 1.2 leaves room
