"""Fits' eigenproblems split over several CPU streams (``lowrank/cpu_streams.py``): the same
results as one stream, each part on a stream of its own, OpenBLAS at one thread a call while
several run, and its count restored after."""

import veloxquant_mlx  # noqa: F401  (first: it binds MLX's CPU back-end to OpenBLAS)

import mlx.core as mx
import pytest

from veloxquant_mlx import _blas
from veloxquant_mlx.lowrank import cpu_streams
from veloxquant_mlx.lowrank.cpu_streams import cpu_eigh, on_fit_streams, set_fit_streams
from veloxquant_mlx.lowrank.factors import gram_basis, gram_leading


@pytest.fixture(autouse=True)
def default_streams():
    set_fit_streams(1)
    yield
    set_fit_streams(1)
    cpu_streams._streams = None  # the next user picks the default rule again


def one_stream_one_thread():
    """One stream, with OpenBLAS at the one thread a call that several streams run at: the
    split's reference (OpenBLAS's thread count alone moves the rounding of an eigenvector,
    and can flip its sign)."""
    set_fit_streams(1)
    return _blas.set_threads(1)


def _grams(lead, n, seed=0):
    x = mx.random.normal((*lead, 3 * n, n), key=mx.random.key(seed))
    return x.swapaxes(-1, -2) @ x


def test_split_batch_equals_one_stream():
    grams = _grams((2, 5), 24)
    threads = one_stream_one_thread()
    w1, v1 = cpu_eigh(grams)
    _blas.set_threads(threads or 1)
    set_fit_streams(3)
    w3, v3 = cpu_eigh(grams)
    assert w3.shape == (2, 5, 24) and v3.shape == (2, 5, 24, 24)
    # each matrix is decomposed alone either way, by the same LAPACK routine
    assert mx.array_equal(w1, w3) and mx.array_equal(v1, v3)


def test_each_part_runs_on_its_own_stream(monkeypatch):
    seen = []
    eigh = mx.linalg.eigh

    def recording(a, stream=None):
        seen.append((a.shape[0], mx.default_stream(mx.cpu)))
        return eigh(a, stream=stream)

    monkeypatch.setattr(mx.linalg, "eigh", recording)
    streams = set_fit_streams(4)
    cpu_eigh(_grams((7,), 8))
    # 7 matrices over 4 streams: parts of 1, 2, 2, 2, one a stream, in order
    assert [n for n, _ in seen] == [1, 2, 2, 2]
    assert [s for _, s in seen] == streams and len(set(map(str, streams))) == 4
    seen.clear()
    cpu_eigh(_grams((2,), 8))  # fewer matrices than streams: one each
    assert [n for n, _ in seen] == [1, 1]


def test_one_matrix_stays_whole():
    set_fit_streams(4)
    g = _grams((), 16)
    w, v = cpu_eigh(g)
    assert w.shape == (16,) and v.shape == (16, 16)
    assert mx.allclose((v * w) @ v.T, g, rtol=1e-4, atol=1e-3 * float(w.max()))


def test_gram_leading_and_basis_split_equal_one_stream():
    x = mx.random.normal((3, 2, 200, 64), key=mx.random.key(1))
    gram = x.swapaxes(-1, -2) @ x
    threads = one_stream_one_thread()
    one = gram_leading(gram, 4) + gram_basis(x)
    _blas.set_threads(threads or 1)
    set_fit_streams(2)
    two = gram_leading(gram, 4) + gram_basis(x)
    for a, b in zip(one, two):
        assert a.shape == b.shape and mx.array_equal(a, b)


def test_openblas_shares_the_cores_while_split_then_restored(monkeypatch):
    before = _blas.set_threads(2)
    if before is None:
        pytest.skip("no OpenBLAS in this process to set threads on")
    try:
        monkeypatch.setattr(cpu_streams.os, "cpu_count", lambda: 16)
        set_fit_streams(8)
        assert _blas.set_threads(2) == 2  # 16 cores over 8 streams: 2 threads a call
        set_fit_streams(3)
        assert _blas.set_threads(5) == 5  # 16 // 3
        monkeypatch.setattr(cpu_streams.os, "cpu_count", lambda: 2)
        set_fit_streams(3)
        assert _blas.set_threads(1) == 1  # never below one
        set_fit_streams(1)
        assert _blas.set_threads(2) == 2  # one stream again: OpenBLAS's own count back
    finally:
        _blas.set_threads(before)


@pytest.mark.parametrize("raw", ["0", "-1", "two"])
def test_environment_count_must_be_whole_and_positive(monkeypatch, raw):
    monkeypatch.setenv(cpu_streams.ENV, raw)
    with pytest.raises(ValueError, match=rf"VQ_FIT_STREAMS='{raw}'.*whole number >= 1"):
        set_fit_streams(None)


def test_environment_count_used(monkeypatch):
    monkeypatch.setenv(cpu_streams.ENV, "3")
    assert len(set_fit_streams(None)) == 3


def test_default_is_one_stream_on_the_cpu(monkeypatch):
    monkeypatch.delenv(cpu_streams.ENV, raising=False)
    if mx.default_device() != mx.cpu:
        pytest.skip("the default device is a GPU")
    assert set_fit_streams(None) == [mx.cpu]


def test_on_fit_streams_keeps_batch_of_non_square_inputs():
    x = mx.random.normal((5, 6, 4), key=mx.random.key(2))
    set_fit_streams(2)
    out = on_fit_streams(lambda a: (a.sum(axis=-1), a @ a.swapaxes(-1, -2)), x)
    assert mx.array_equal(out[0], x.sum(axis=-1))
    assert mx.allclose(out[1], x @ x.swapaxes(-1, -2))


@pytest.mark.parametrize("method", ["palu", "svdq"])
def test_a_latent_method_stores_the_same_with_its_fits_split(method):
    """A prompt, decode tokens past a refit (the tokens double), through one stream and three:
    the same bases and the same reconstruction, to the bit."""
    from test_palu import palu
    from test_svdq import kv, prompt_then_decode, svdq

    keys, values = kv(300, h=4, d=32)
    make = {"palu": lambda: palu(palu_n_head_groups=2), "svdq": svdq}[method]
    out = []
    threads = one_stream_one_thread()
    for streams in (1, 3):
        if streams > 1:
            _blas.set_threads(threads or 1)
            set_fit_streams(streams)
        cache = make()
        prompt_then_decode(cache, keys[:, :, :290], values[:, :, :290], 140)
        store = cache.store
        assert len(store.keys.runs) >= 2  # the refit ran
        runs = [run for part in (store.keys, store.values) if part is not None for run in part.runs]
        out.append([run.basis for run in runs] + list(cache.dequantized(mx.float32)))
    assert all(a.shape == b.shape and mx.array_equal(a, b) for a, b in zip(*out))


def test_single_matrices_take_the_streams_in_turn(monkeypatch):
    """Fits started one after another before any is read (kvtc's keys and values) run side
    by side: each single matrix goes to the next stream."""
    seen = []
    eigh = mx.linalg.eigh

    def recording(a, stream=None):
        seen.append(mx.default_stream(mx.cpu))
        return eigh(a, stream=stream)

    monkeypatch.setattr(mx.linalg, "eigh", recording)
    streams = set_fit_streams(3)
    for _ in range(4):
        cpu_eigh(_grams((), 8))
    assert len(set(map(str, seen))) == 3 and all(a != b for a, b in zip(seen, seen[1:]))
    assert all(s in streams for s in seen)


def test_streams_are_made_once_and_reused():
    four = set_fit_streams(4)
    set_fit_streams(1)
    two = set_fit_streams(2)
    assert two == four[:2] and set_fit_streams(4) == four


@pytest.mark.parametrize("cores, expected", [(16, 8), (64, cpu_streams.MAX_STREAMS), (2, 1), (1, 1)])
def test_default_on_a_gpu_is_half_the_cores_at_most_eight(monkeypatch, cores, expected):
    monkeypatch.delenv(cpu_streams.ENV, raising=False)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    monkeypatch.setattr(cpu_streams.os, "cpu_count", lambda: cores)
    assert cpu_streams._default_count() == expected
