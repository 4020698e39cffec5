"""TurboQuant (issue 35): the Lloyd-Max levels of a rotated unit vector's coordinate, the
paper's distortion bound at each bit width, unbiased inner products with the QJL sketch,
the rotation orthogonal and reproducible from its seed, the window exact, the sliding
flush rule, and a decode step against attention over the decoded rows."""

import math

import mlx.core as mx
import numpy as np
import pytest

from feeding import feed_chunks, stored_decode_attention
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import TurboQuantOptions
from veloxquant_mlx.methods.turboquant import TurboQuantCache
from veloxquant_mlx.methods.turboquant import levels as lv
from veloxquant_mlx.methods.turboquant.cache import FLUSH_TOKENS
from veloxquant_mlx.methods.turboquant.codec import QJL_SCALE, TurboCodec
from veloxquant_mlx.quant import hadamard

U32 = 2.0 ** -24  # float32's unit roundoff
U16 = 2.0 ** -11  # float16's (the stored norms)


def turboquant(**options):
    return TurboQuantCache(KVCacheConfig(method="turboquant", options=TurboQuantOptions(**options)), None, 0)


def unit_density_moments(lo, hi, d, n=1 << 16):
    """P(lo < X <= hi) and E[X; lo < X <= hi] for one coordinate X of a uniform unit vector
    in R^d, f(x) ∝ (1 - x²)^k, k = (d - 3) / 2: the mass by a midpoint rule over each cell
    (error O(h²), far below the bound tested), the first moment in closed form,
    ∫ x (1 - x²)^k = -(1 - x²)^(k+1) / (2 (k+1)); and f, normalised."""
    k = (d - 3) / 2
    cells = lambda a, b: a + (b - a) / n * (np.arange(n) + 0.5)  # noqa: E731
    raw = np.array([((1 - cells(a, b) ** 2) ** k).sum() * (b - a) / n for a, b in zip(lo, hi)])
    norm = raw.sum()  # the cells cover [-1, 1]
    g = lambda t: (1 - np.minimum(t * t, 1.0)) ** (k + 1)  # noqa: E731
    moment = (g(np.asarray(lo)) - g(np.asarray(hi))) / (2 * (k + 1)) / norm
    return raw / norm, moment, lambda t: (1 - t * t) ** k / norm


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 5])
def test_levels_satisfy_the_lloyd_max_conditions(bits, d):
    """Each level is the density's mean over its cell (cells cut midway between levels),
    to what levels.py's grid resolves: a boundary placed to within half a grid step h
    moves a cell's mean by at most (h/2) f(t) |t - c| / P(cell) per boundary t."""
    c = np.array(lv.sphere_levels(bits, d))
    assert np.all(np.diff(c) > 0) and np.allclose(c, -c[::-1], atol=1e-12)  # sorted, symmetric
    cuts = np.concatenate([[-1.0], (c[1:] + c[:-1]) / 2, [1.0]])
    mass, moment, f = unit_density_moments(cuts[:-1], cuts[1:], d)
    h = 2 * min(1.0, lv.RANGE_SIGMAS / math.sqrt(d)) / lv.GRID
    inner = lambda t, j: 0.0 if abs(t) >= 1 else (h / 2) * f(t) * abs(t - c[j])  # noqa: E731
    slack = np.array([(inner(cuts[j], j) + inner(cuts[j + 1], j)) / mass[j] for j in range(len(c))])
    slack += lv.TOLERANCE / math.sqrt(d) * 10  # Lloyd's stopping rule (moves shrink geometrically)
    assert np.all(np.abs(moment / mass - c) <= slack), (moment / mass - c, slack)


@pytest.mark.parametrize("bits,paper", [(1, 0.36), (2, 0.117), (3, 0.03), (4, 0.009)])
def test_unit_vector_distortion_is_the_papers(bits, paper):
    """d C(b) (the mean squared error of a unit vector: d coordinates, each C(b)) is under
    the paper's bound sqrt(3) pi / 2 * 4^-b and, at d = 128, the paper's rounded figures."""
    d = 128
    cost = d * lv.distortion(lv.sphere_levels(bits, d), d)
    assert cost <= math.sqrt(3) * math.pi / 2 * 4.0 ** -bits
    assert abs(cost - paper) <= 0.5 * 10 ** math.floor(math.log10(paper)) * (1 + (bits == 3) * 8)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_mse_distortion_of_coded_vectors_within_the_paper_bound(bits):
    """Uniform random directions (Gaussian rows): after any fixed rotation each coordinate
    has exactly the density the levels were made for, so the mean of ‖x - x̃‖² / ‖x‖² over
    N rows estimates d C(b); it must agree within 5 standard errors (plus the float16 norm's
    relative rounding, at most 2 U16 sqrt(D) + U16²) and stay under the paper's bound."""
    d, n = 128, 4096
    x = mx.random.normal((1, 1, n, d), key=mx.random.key(bits))
    codec = TurboCodec(bits, False, seed=7)
    words, norms = codec.encode(x)
    x_hat = codec.decode(words, norms, d)
    err = (mx.sum(mx.square(x - x_hat), axis=-1) / mx.sum(x * x, axis=-1)).reshape(-1)
    err = np.array(err)
    expected = d * lv.distortion(lv.sphere_levels(bits, d), d)
    tol = 5 * err.std() / math.sqrt(n) + 2 * U16 * math.sqrt(expected) + U16 ** 2
    assert abs(err.mean() - expected) <= tol, (err.mean(), expected, tol)
    assert err.mean() <= math.sqrt(3) * math.pi / 2 * 4.0 ** -bits


def test_qjl_inner_products_are_unbiased_and_mse_alone_is_not():
    """Over draws of the rotation and the sketch (seeds), the mean of q . x̃ - q . x is 0 for
    TurboQuant_prod: each draw's error has mean (γ16/γ - 1) q . r (float16's γ, at most
    U16 ‖q‖ γ) and variance at most π / (2d) ‖q‖² γ² (the paper's Lemma 4), so the mean over
    N draws is within 5 sqrt(Σ var) / N + U16 ‖q‖ mean γ of 0. TurboQuant_mse at 1 bit shrinks
    inner products (by about 2/π, the paper's example of its bias)."""
    d, pairs, draws = 128, 8, 300
    x = mx.random.normal((1, 1, pairs, d), key=mx.random.key(1))
    q = mx.random.normal((1, 1, pairs, d), key=mx.random.key(2))
    exact = mx.sum(q * x, axis=-1)
    err, var, bias = [], 0.0, 0.0
    for seed in range(draws):
        codec = TurboCodec(2, True, seed=1000 + seed)
        words, norms = codec.encode(x)
        est = mx.sum(q * codec.decode(words, norms, d), axis=-1)
        gamma = norms[..., 1, 0, 0].astype(mx.float32)
        qn = mx.linalg.norm(q, axis=-1)
        err.append(est - exact)
        var = var + math.pi / (2 * d) * mx.square(qn * gamma)
        bias = bias + U16 * qn * gamma
    mean = mx.mean(mx.stack(err), axis=0)
    tol = 5 * mx.sqrt(var) / draws + bias / draws
    assert mx.all(mx.abs(mean) <= tol).item(), (mean, tol)

    # MSE alone: x . x̃ = ‖x‖² d c E|X| ≈ (2/π) ‖x‖² at 1 bit (c = E|X|, the level), a
    # shrinkage far outside the band above (its spread over rows is a few 1/sqrt(d))
    codec = TurboCodec(1, False, seed=1000)
    words, norms = codec.encode(x)
    ratio = mx.sum(x * codec.decode(words, norms, d), axis=-1) / mx.sum(x * x, axis=-1)
    assert mx.all(mx.abs(ratio - 2 / math.pi) < 4 / math.sqrt(d)).item(), ratio
    assert mx.all(mx.abs(ratio - 1) > 0.3).item()


@pytest.mark.parametrize("d", [128, 48])  # 48 = 12 * 4: planes of 2 words, 16 bits unused
def test_the_score_of_a_packed_row_is_q_dot_its_decoded_row(d):
    """The read folds the rotation and the sketch into the query: q M [ŷ, γ sign]ᵀ equals
    q . x̃ (x̃ = [ŷ, γ sign] Mᵀ) to float32 rounding of two d-term products; and x̃ is the
    codec's own: ‖x - x̃‖ well under ‖x‖."""
    x = mx.random.normal((1, 2, 40, d), key=mx.random.key(3))
    q = mx.random.normal((1, 2, 3, d), key=mx.random.key(4))
    run = TurboCodec(3, True, seed=5).tokens()
    run.append(x)
    s = run.layout(None).scores(q)
    ref = q @ run.decode(mx.float32).swapaxes(-1, -2)
    bound = 4 * d * U32 * mx.linalg.norm(q, axis=-1)[..., None] * mx.linalg.norm(x, axis=-1)[:, :, None, :] * 2
    assert mx.all(mx.abs(s - ref) <= bound).item()
    rel = mx.linalg.norm(run.decode(mx.float32) - x, axis=-1) / mx.linalg.norm(x, axis=-1)
    assert mx.all(rel < 0.7).item()  # 2 bits + the sketch: ‖r‖ ~ sqrt(0.117), its estimate adds ~ sqrt(π/2 - 1)
    assert QJL_SCALE == math.sqrt(math.pi / 2)


def test_rotation_is_orthogonal_and_reproducible_from_its_seed():
    """R Rᵀ = I to float32 rounding ((d + 5) u: d products of entries ±1/sqrt(d) rounded
    once each, summed); the same seed gives the same R and the same codes after the caches
    are cleared; another seed, other signs."""
    d = 128
    r = hadamard.matrix(11, d)
    err = mx.abs(r @ r.T - mx.eye(d)).max().item()
    assert err <= (d + 5) * U32
    assert mx.allclose(hadamard.rotate(mx.eye(d), 11), r, atol=0, rtol=0)
    x = mx.random.normal((1, 2, 33, d), key=mx.random.key(8))
    codes = TurboCodec(3, True, seed=11).encode(x)
    hadamard.matrix.cache_clear()
    hadamard.signs.cache_clear()
    assert mx.array_equal(hadamard.matrix(11, d), r)
    again = TurboCodec(3, True, seed=11).encode(x)
    assert all(mx.array_equal(a, b) for a, b in zip(codes, again))
    assert not mx.array_equal(hadamard.signs(12, d), hadamard.signs(11, d))


def _kv(t, d=64, h=2, seed=0):
    rng = np.random.default_rng(seed)
    return (mx.array(rng.normal(size=(1, h, t, d)), mx.float32),
            mx.array(rng.normal(size=(1, h, t, d)), mx.float32))


@pytest.mark.parametrize("window", [0, 16])
def test_window_tokens_are_exact_and_blocks_flush_past_it(window):
    """The newest tokens stay exact: W after a prompt, W..W+31 while decoding, a block of
    32 coded at once when W + 32 are held; everything older is coded."""
    keys, values = _kv(100 + 70)
    cache = turboquant(turboquant_window=window)
    feed_chunks(cache, keys[:, :, :100], values[:, :, :100], 100)
    store = cache.store
    assert store.keys.count == store.values.count == 100 - window
    for t in range(100, 170):
        feed_chunks(cache, keys[:, :, t:t + 1], values[:, :, t:t + 1], 1)
        exact = window + (t + 1 - 100) % FLUSH_TOKENS
        assert store.keys.count == store.values.count == t + 1 - exact
        if exact:
            assert mx.array_equal(store.k_res, keys[:, :, t + 1 - exact:t + 1])
            assert mx.array_equal(store.v_res, values[:, :, t + 1 - exact:t + 1])
        assert list(store.problems(cache.offset)) == []


def test_a_decode_step_equals_attention_over_the_decoded_rows():
    """The pure-MLX read (rotated query, packed rows, exact window) against SDPA over the
    decoded history: equal to float32 rounding."""
    keys, values = _kv(150, d=64)
    cache = turboquant(turboquant_window=8)
    feed_chunks(cache, keys[:, :, :140], values[:, :, :140], 70)
    for t in range(140, 150):
        feed_chunks(cache, keys[:, :, t:t + 1], values[:, :, t:t + 1], 1)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(9))
    out = stored_decode_attention(cache, q, 64 ** -0.5)
    k_hat, v_hat = cache.dequantized(mx.float32)
    ref = mx.fast.scaled_dot_product_attention(q, k_hat, v_hat, scale=64 ** -0.5)
    assert mx.allclose(out, ref, atol=1e-5, rtol=1e-5).item()


def test_qjl_needs_two_key_bits_and_head_dims_must_rotate():
    with pytest.raises(ValueError, match="turboquant_key_bits must be at least 2"):
        KVCacheConfig(method="turboquant", options=TurboQuantOptions(turboquant_key_bits=1))
    cache = turboquant()
    k = mx.zeros((1, 1, 4, 40))
    with pytest.raises(ValueError, match="head_dim=40"):
        cache.update_and_fetch(k, k)


def test_memory_per_token_is_the_papers_bits_plus_norms():
    """Per token and KV head, d = 64: keys 3 bits a coordinate and two float16 norms,
    values 3 bits and one norm: 64*3/8 + 4 and 64*3/8 + 2 bytes."""
    keys, values = _kv(256 + 1)
    cache = turboquant()
    feed_chunks(cache, keys, values, 257)
    s = cache.store
    per_token = (s.keys.words.buffer.nbytes + s.keys.norms.buffer.nbytes
                 + s.values.words.buffer.nbytes + s.values.norms.buffer.nbytes) / (s.keys.words.capacity * 2)
    assert per_token == 64 * 3 / 8 + 4 + 64 * 3 / 8 + 2


# -- the fused decode kernel: its CUDA source emulated on the CPU ------------------------------
def emulate_turbo_kernel(args: dict, workdir) -> tuple[np.ndarray, np.ndarray]:
    """One launch of the CUDA source (``kernel.launch_args``) as C++ threads on the CPU:
    (o_part, ml_part) as the kernel writes them."""
    from test_kernel_kivi_decode import emulate_launch
    from veloxquant_mlx.kernels import kivi_decode as kd
    from veloxquant_mlx.methods.turboquant import kernel as tk

    dts = {mx.float32: "float32", mx.float16: "float16", mx.uint32: "uint32", mx.int32: "int32"}
    ins = [(n, dts[a.dtype], a) for n, a in zip(tk.INPUT_NAMES, args["inputs"])]
    (o_shape, ml_shape) = args["output_shapes"]
    out = emulate_launch(tk.CUDA_SOURCE, ins, [("o_part", "float32", math.prod(o_shape)), ("ml_part", "float32", math.prod(ml_shape))],
                         args["template"], (args["grid"][0] // tk.NT, args["grid"][1]), tk.NT, workdir, header=kd.CUDA_HEADER)
    return out["o_part"].reshape(o_shape), out["ml_part"].reshape(ml_shape)


@pytest.mark.parametrize("key_bits,qjl,value_bits,gqa,n", [
    (3, True, 3, 2, 100),   # 4 splits of 25 tokens: warps of 6 or 7 tokens, spare rows past the count
    (2, True, 2, 4, 37),    # one level plane and the sign; a last split of 1 token
    (3, False, 4, 1, 70),   # TurboQuant_mse keys, 4-bit values, no GQA
])
def test_the_kernels_cuda_source_matches_its_pure_mlx_reference(tmp_path, key_bits, qjl, value_bits, gqa, n):
    """The fused kernel's partials, turned back and merged, against the pure-MLX read of the
    same packed rows: equal to float32 rounding (a different summation order: each score a
    sum of 2d products, each output a sum over n tokens), 1e-5 relative."""
    from test_kernel_kivi_decode import skip_without_emulation
    from veloxquant_mlx.kernels.decode import merge_partials_mlx
    from veloxquant_mlx.methods.turboquant import kernel as tk
    from veloxquant_mlx.methods.turboquant.codec import TurboScores, _matrices

    skip_without_emulation()
    d, h = 64, 2
    kc, vc = TurboCodec(key_bits, qjl, seed=3), TurboCodec(value_bits, False, seed=3)
    k_run, v_run = kc.tokens(), vc.tokens()
    keys, values = _kv(n, d=d, h=h, seed=n)
    k_run.append(keys)
    v_run.append(values)
    k_read, v_read = TurboScores(k_run, n), TurboScores(v_run, n)
    q = mx.random.normal((1, h * gqa, 1, d), key=mx.random.key(n))
    scale = d ** -0.5
    args = tk.launch_args(k_read, v_read, tk.turned_query(q, k_read, scale))
    o, ml = emulate_turbo_kernel(args, str(tmp_path))
    assert np.isfinite(o).all() and np.isfinite(ml).all()
    out = merge_partials_mlx(mx.array(o) @ _matrices(vc, d)[1], mx.array(ml), q.shape, mx.float32)
    ro, rml = tk.turbo_partials_reference(q, k_read, v_read, scale)
    ref = merge_partials_mlx(ro, rml, q.shape, mx.float32)
    assert mx.allclose(out, ref, rtol=1e-5, atol=1e-5).item(), mx.abs(out - ref).max()


def test_the_metal_twin_is_untested_on_hardware():
    from veloxquant_mlx.methods.turboquant import kernel as tk

    if not (hasattr(mx, "metal") and mx.metal.is_available()):
        pytest.skip("SKIPPED LOUDLY: no Metal device: the Metal twin of the TurboQuant kernel "
                    "has never been compiled or run")
    keys, values = _kv(100, d=64)
    k_run, v_run = TurboCodec(3, True, 0).tokens(), TurboCodec(3, False, 0).tokens()
    k_run.append(keys)
    v_run.append(values)
    from veloxquant_mlx.methods.turboquant.codec import TurboScores

    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(0))
    assert tk.kernel_partials("metal", q, TurboScores(k_run, 100), TurboScores(v_run, 100), 0.125) is not None


def test_decode_reads_through_the_kernel_once_it_passes_its_check_else_the_pure_path(monkeypatch):
    """No GPU here: the backend answers "cuda", the kernel's launch is a stand-in (the
    reference's partials: the read must equal the pure path's), then one that fails to
    build (a warning, and the pure path's answer)."""
    from veloxquant_mlx.kernels import kivi_decode as kd
    from veloxquant_mlx.kernels.decode import merge_partials_mlx
    from veloxquant_mlx.methods.turboquant import kernel as tk

    keys, values = _kv(120, d=64)
    cache = turboquant(turboquant_window=8)
    feed_chunks(cache, keys, values, 120)
    q = mx.random.normal((1, 4, 1, 64), key=mx.random.key(5))
    pure = stored_decode_attention(cache, q, 0.125)

    launches = []

    def stand_in(backend, queries, k, v, scale):
        launches.append(backend)
        return tk.turbo_partials_reference(queries, k, v, scale)

    monkeypatch.setattr(kd, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(kd, "merge_partials", lambda b, o, ml, shape, dt, init=None: merge_partials_mlx(o, ml, shape, dt))
    monkeypatch.setattr(tk, "launch_partials", stand_in)
    monkeypatch.setattr(tk, "_CHECKED", {})
    out = stored_decode_attention(cache, q, 0.125)
    assert launches == ["cuda", "cuda"]  # the self-check, then the read
    assert mx.allclose(out, pure, rtol=1e-5, atol=1e-6).item()

    def broken(*_):
        raise RuntimeError("nvrtc: error: identifier 'half2' is undefined")

    monkeypatch.setattr(tk, "launch_partials", broken)
    monkeypatch.setattr(tk, "_CHECKED", {})
    with pytest.warns(RuntimeWarning, match="failed its self-check.*RuntimeError: nvrtc"):
        out = stored_decode_attention(cache, q, 0.125)
    assert mx.array_equal(out, pure)
