"""Decode steps driven the way mlx-lm's ``generate_step`` runs them, for the CPU guards
of issue 30: a sync detector (host reads of array values from package code) and the
node count of one steady-state step's graph, per layer, built and counted as MLX's CUDA
back-end builds it."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

import veloxquant_mlx
from conformance import PROMPT, config, profile
from tiny_models import prompt, tiny_model
from veloxquant_mlx import make_prompt_cache
from veloxquant_mlx.cache.buffers import GrowingArray

PACKAGE_DIRS = tuple(  # as imported and resolved: a checkout may reach the package through a link
    str(path) + os.sep
    for p in (Path(veloxquant_mlx.__file__).parent, Path(veloxquant_mlx._generated.__file__).parent)
    for path in {p.absolute(), p.resolve()}
)
HOST_READS = ("item", "tolist", "__array__", "__bool__", "__int__", "__float__", "__index__")
WARMUP = 4


@dataclass(frozen=True)
class HostRead:
    call: str
    where: str  # file:line of the innermost package frame

    def __str__(self):
        return f"{self.call} at {self.where}"


def _package_frame():
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE_DIRS):
            root = Path(veloxquant_mlx.__file__).resolve().parents[1]
            return f"{Path(frame.f_code.co_filename).resolve().relative_to(root)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


@contextlib.contextmanager
def recording_host_reads():
    """Record every host read of an array's values made from package code."""
    reads: list[HostRead] = []
    patches = [(mx.array, name, getattr(mx.array, name)) for name in HOST_READS]
    patches += [(mx, "eval", mx.eval), (np, "array", np.array), (np, "asarray", np.asarray)]

    def wrap(name, original, only_arrays):
        def recorder(*args, **kwargs):
            if not only_arrays or any(isinstance(a, mx.array) for a in args):
                where = _package_frame()
                if where is not None:
                    reads.append(HostRead(name, where))
            return original(*args, **kwargs)

        return recorder

    try:
        for owner, name, original in patches:
            label = f"numpy.{name}" if owner is np else (f"mx.{name}" if owner is mx else name)
            setattr(owner, name, wrap(label, original, only_arrays=owner is np))
        yield reads
    finally:
        for owner, name, original in patches:
            setattr(owner, name, original)


def prefilled(method: str, arch: str = "llama", n_prompt: int = PROMPT, chunk: int = 64, layers: int | None = None,
              dtype=mx.float32):
    """A tiny model (``layers`` layers, if given; weights in ``dtype``) and its caches under
    the method's compressing settings, the prompt prefilled in chunks as ``generate_step``
    does it (evaluating the caches' state after each chunk); returns the model, the caches
    and the last prompt token."""
    extra = {} if layers is None else {"num_hidden_layers": layers}
    model = tiny_model(arch, dtype=dtype, **extra)
    cache = make_prompt_cache(model, config(method, profile(method).compressing))
    tokens = prompt(n_prompt)
    start = 0
    while n_prompt - start > 1:
        stop = min(start + chunk, n_prompt - 1)
        model(tokens[start:stop][None], cache=cache)
        mx.eval([c.state for c in cache])
        start = stop
    return model, cache, tokens[-1:]


def step(model, cache, token):
    """One decode step, built lazily: the next token (greedy) and its log-probabilities."""
    logits = model(token[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return mx.argmax(logprobs, axis=-1), logprobs.squeeze(0)


def decode_overlapped(model, cache, token, steps: int):
    """``steps`` decode steps as ``generate_step`` runs them: each builds the next step's
    graph and ``async_eval``s it before the host reads the previous token."""
    y, logprobs = step(model, cache, token)
    mx.async_eval(y, logprobs)
    for _ in range(steps):
        next_y, next_logprobs = step(model, cache, y)
        mx.async_eval(next_y, next_logprobs)
        y.item()
        y, logprobs = next_y, next_logprobs
    return y


def host_reads_while_decoding(method: str) -> list[HostRead]:
    """Host reads made from package code in 40 overlapped decode steps after the warm-up."""
    return decode_guards(method)[0]


# -- graph size ------------------------------------------------------------------------------
def cache_arrays(cache) -> list[mx.array]:
    """Every MLX array reachable from the caches' attributes (their context included:
    state shared across layers lives there), each once."""
    found, seen = [], set()

    def walk(obj):
        if id(obj) in seen or isinstance(obj, (str, bytes, int, float, bool, type(None), type)):
            return
        seen.add(id(obj))
        if isinstance(obj, mx.array):
            found.append(obj)
        elif isinstance(obj, GrowingArray):
            walk(obj.buffer)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v)
        elif isinstance(obj, (list, tuple, set)):
            for v in obj:
                walk(v)
        elif hasattr(obj, "__dict__") and not callable(obj):
            for k, v in vars(obj).items():
                if k != "config":
                    walk(v)
        elif hasattr(obj, "__slots__"):
            for k in obj.__slots__:
                walk(getattr(obj, k, None))

    walk(list(cache))
    return found


def graph_nodes(outputs, skip: frozenset = frozenset()) -> int:
    """Operations not yet evaluated in the graph of ``outputs`` (evaluated arrays are
    leaves), counted in ``mx.export_to_dot``'s output; operations named in ``skip`` (the
    primitives' names, "Reshape") are not counted."""
    return graph_shape(outputs, skip)[0]


def graph_shape(outputs, skip: frozenset = frozenset()) -> tuple[int, str]:
    """``graph_nodes`` and a digest of the graph's structure: its operations in
    ``mx.export_to_dot``'s order and its edges, shapes and values left out. Two steps with
    one digest launch the same kernels in the same order, so MLX's CUDA back-end meets the
    graphs it cached for the one again in the other (``benchmarks/notes/cuda_graphs.md``)."""
    outputs = [a for a in outputs if isinstance(a, mx.array)]
    if not outputs:
        return 0, ""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.dot")
        mx.export_to_dot(path, *outputs)
        text = open(path).read()
    labels = [label for label in re.findall(r'label ="?([A-Za-z_]+)"?, shape=rectangle', text) if label not in skip]
    names = {}  # node ids and array letters, numbered by first appearance
    edges = [tuple(names.setdefault(x, len(names)) for x in edge)
             for edge in re.findall(r'^"?(\w+)"? -> "?(\w+)"?$', text, flags=re.M)]
    return len(labels), hashlib.sha1(repr((labels, edges)).encode()).hexdigest()[:12]


_FUSED = ("rms_norm", "rope", "scaled_dot_product_attention")


@contextlib.contextmanager
def fused_ops_as_on_a_gpu():
    """Count MLX's fused operations as the one node each is on a GPU.

    On the CPU, ``mx.fast.rms_norm``, ``rope`` and ``scaled_dot_product_attention`` run as
    graphs of primitive operations: a Llama layer of the full cache is 135 nodes there and
    48 on the H200, so a cache's own operations weighed a third of what they weigh on
    CUDA. Here each is one node (attention a ``Depends`` of the queries on the keys and
    values, so that what made them stays in the graph). Attention with an array mask keeps MLX's
    decomposition, as MLX's CUDA back-end does (benchmarks/notes/decode_host_bound.md).
    The values computed meanwhile are wrong; only the graphs' sizes are read."""
    real = {name: getattr(mx.fast, name) for name in _FUSED}

    def attention(q, k, v, *args, **kwargs):
        if isinstance(kwargs.get("mask"), mx.array):
            return real["scaled_dot_product_attention"](q, k, v, *args, **kwargs)
        return mx.depends([q], [k, v])[0]

    try:
        mx.fast.rms_norm = lambda x, *args, **kwargs: mx.stop_gradient(x)
        mx.fast.rope = lambda x, *args, **kwargs: mx.stop_gradient(x)
        mx.fast.scaled_dot_product_attention = attention
        yield
    finally:
        for name, fn in real.items():
            setattr(mx.fast, name, fn)


_EVALUATED_ZEROS: dict = {}


def _one_node(outputs, inputs) -> list[mx.array]:
    """One graph node whose outputs have the given (shape, dtype)s and that depends on every
    array in ``inputs``: evaluated zeros (leaves) behind one ``Depends``."""
    zeros = []
    for shape, dtype in outputs:
        key = (tuple(shape), dtype)
        if key not in _EVALUATED_ZEROS:
            _EVALUATED_ZEROS[key] = mx.zeros(shape, dtype)
            mx.eval(_EVALUATED_ZEROS[key])
        zeros.append(_EVALUATED_ZEROS[key])
    return mx.depends(zeros, [a for a in inputs if isinstance(a, mx.array)])


class _LaunchNode:
    """What ``mx.fast.cuda_kernel`` returns, as a graph sees it: one node a launch."""

    def __call__(self, *, inputs, output_shapes, output_dtypes, **_):
        return _one_node(list(zip(output_shapes, output_dtypes)), inputs)


@contextlib.contextmanager
def cuda_kernels_as_launch_nodes():
    """The package's dispatchers believe they run on CUDA (``kivi_decode.gpu_backend``) and
    each ``mx.fast.cuda_kernel`` launch is one graph node (evaluated zeros behind a
    ``Depends`` on its inputs): the Python that checks layouts, plans the launch and builds
    it runs as on CUDA, on the CPU (also ``benchmarks/host_time.py``'s host timings)."""
    from veloxquant_mlx.evict import slot_rows_kernel as slots
    from veloxquant_mlx.kernels import codebook_rows as cr
    from veloxquant_mlx.methods.adakv import kernel as adakv
    from veloxquant_mlx.methods.kitty import kernel as kitty
    from veloxquant_mlx.kernels import kivi_decode as kd
    from veloxquant_mlx.lowrank import latent_rows_kernel as latent_rows
    from veloxquant_mlx.methods.nsnquant import kernel as nsn
    from veloxquant_mlx.methods.turboquant import kernel as turbo

    saved = (getattr(mx.fast, "cuda_kernel", None), kd.gpu_backend, kd.kernel_self_check, dict(kd._KERNELS),
             turbo._self_check_problem, dict(turbo._CHECKED), cr.kernel_checked, nsn.kernel_checked, adakv.kernel_checked,
             kitty.kernel_checked, slots.kernel_checked, latent_rows.kernel_checked)
    try:
        mx.fast.cuda_kernel = lambda **_: _LaunchNode()
        kd.gpu_backend = lambda: "cuda"
        kd.kernel_self_check = lambda *key: True  # a launch node has no values to check
        turbo._self_check_problem = lambda *args, **kwargs: None  # TurboQuant's own check, likewise
        cr.kernel_checked = lambda *key: True  # the codebook-rows kernel's, likewise
        nsn.kernel_checked = lambda *key: True  # nsnquant's code-rows kernel's, likewise
        adakv.kernel_checked = lambda *key: True  # AdaKV's plane-rows kernel's, likewise
        kitty.kernel_checked = lambda *key: True  # kitty's key-rows kernel's, likewise
        slots.kernel_checked = lambda *key: True  # packed slots' rows kernel's, likewise
        latent_rows.kernel_checked = lambda *key: True  # latent stores' rows kernel's, likewise
        kd._KERNELS.clear()
        kd._STEP_PLANS.clear()
        turbo._CHECKED.clear()
        yield
    finally:
        if saved[0] is not None:
            mx.fast.cuda_kernel = saved[0]
        kd.gpu_backend, kd.kernel_self_check = saved[1:3]
        kd._KERNELS.clear()
        kd._KERNELS.update(saved[3])
        kd._STEP_PLANS.clear()
        turbo._self_check_problem = saved[4]
        turbo._CHECKED.clear()
        turbo._CHECKED.update(saved[5])
        cr.kernel_checked, nsn.kernel_checked, adakv.kernel_checked, kitty.kernel_checked = saved[6:10]
        slots.kernel_checked, latent_rows.kernel_checked = saved[10:12]


def _clear_package_caches() -> None:
    """Empty every ``functools`` cache of the package's modules: compiled passes traced and
    kernels made on one side of :func:`steps_as_on_cuda` are not reused on the other (a
    trace made under it would take its CUDA paths outside it; one made before it would be
    counted with the CPU's)."""
    for name, module in list(sys.modules.items()):
        if name.startswith("veloxquant_mlx"):
            for value in list(vars(module).values()):
                if callable(getattr(value, "cache_clear", None)):
                    value.cache_clear()


@contextlib.contextmanager
def affine_ops_as_on_a_gpu():
    """Each ``mx.dequantize`` / ``mx.quantize`` is one node, as on a GPU (the CPU runs them as
    graphs of shifts, whose building also costs the host far more than one node's). The
    values are wrong (zeros); only graphs and their building are measured."""
    saved = (mx.dequantize, mx.quantize)

    def dequantize(w, scales, biases=None, group_size=64, bits=4, **_):
        return _one_node([((*w.shape[:-1], w.shape[-1] * 32 // bits), scales.dtype)], [w, scales, biases])[0]

    def quantize(w, group_size=64, bits=4, **_):
        lead, n = w.shape[:-1], w.shape[-1]
        return tuple(_one_node([((*lead, n * bits // 32), mx.uint32), ((*lead, n // group_size), w.dtype),
                                ((*lead, n // group_size), w.dtype)], [w]))

    try:
        mx.dequantize, mx.quantize = dequantize, quantize
        yield
    finally:
        mx.dequantize, mx.quantize = saved


@contextlib.contextmanager
def steps_as_on_cuda():
    """Build decode steps as they are built on MLX's CUDA back-end, for counting their graphs.

    Besides :func:`fused_ops_as_on_a_gpu`, :func:`cuda_kernels_as_launch_nodes` and
    :func:`affine_ops_as_on_a_gpu`: the package's code sees a GPU (``mx.default_device()``),
    so it takes the paths it takes there (the pure-MLX reading where ``quantized_matmul``
    would serve on the CPU). The arrays still live on the CPU and the values are wrong; only
    the graphs' sizes are read."""
    saved = mx.default_device
    gpu = mx.Device(mx.gpu)
    try:
        _clear_package_caches()
        mx.default_device = lambda: gpu
        with cuda_kernels_as_launch_nodes(), fused_ops_as_on_a_gpu(), affine_ops_as_on_a_gpu():
            yield
    finally:
        mx.default_device = saved
        _clear_package_caches()


@dataclass(frozen=True)
class StepGraph:
    method: str
    layers: int
    nodes: int  # median over the measured steps, the whole model, as MLX's CUDA back-end builds it
    largest: int  # the largest measured step (a flush or a refit, if one fell in)
    pending: tuple[int, ...]  # cache operations left unevaluated by generate_step's loop
    structures: tuple[str, ...] = ()  # each measured step's ``graph_shape`` digest, in order

    @property
    def per_layer(self) -> float:
        return self.nodes / self.layers

    @property
    def grows(self) -> bool:
        return all(b > a for a, b in zip(self.pending, self.pending[1:]))


def step_graph(method: str) -> StepGraph:
    return decode_guards(method)[1]


def per_layer_ratio(method: str, largest: bool = False) -> float:
    """A steady-state step's nodes per layer against the full cache's steady step (issue 30's
    measure); ``largest``: the largest of the measured steps (a flush, an eviction, a refit)
    instead. The model's nodes outside its layers (embedding, final norm, head, the step's
    log-probabilities) are taken out first: they are twice the full cache's step at L
    layers minus its step at 2L."""
    full = step_graph("full")
    outside = 2 * full.nodes - decode_guards("full", layers=2 * full.layers)[1].nodes
    graph = step_graph(method)
    return ((graph.largest if largest else graph.nodes) - outside) / (full.nodes - outside)


@functools.lru_cache(maxsize=None)
def decode_guards(method: str, steps: int = 40, apart: int = 10, arch: str = "llama", layers: int | None = None):
    """One prefill for both guards: the host reads of ``4 * apart`` overlapped decode steps
    (after ``WARMUP``), what they leave unevaluated in the caches every ``apart`` steps,
    then the graph of ``steps`` steps (more than the eviction base's 32 between evictions,
    so that periodic work falls in), each built from an evaluated state and
    counted under :func:`steps_as_on_cuda` (its outputs: the next token, its
    log-probabilities and every cache array it leaves unevaluated; the median is the
    step's size). ``layers``: the tiny model's layer count, if not its own."""
    model, cache, token = prefilled(method, arch, layers=layers)
    y = decode_overlapped(model, cache, token, WARMUP)
    pending = []
    with recording_host_reads() as reads:
        for block in range(4):
            y = decode_overlapped(model, cache, y, apart)
            y.item()
            if block:
                pending.append(graph_nodes(cache_arrays(cache)))
    counts, structures = [], []
    with steps_as_on_cuda():
        for _ in range(steps):
            mx.eval(y, cache_arrays(cache))
            y, logprobs = step(model, cache, y)
            n, digest = graph_shape([y, logprobs, *cache_arrays(cache)])
            counts.append(n)
            structures.append(digest)
        mx.eval(y, cache_arrays(cache))
    graph = StepGraph(method, len(model.layers), sorted(counts)[len(counts) // 2], max(counts), tuple(pending),
                      tuple(structures))
    return list(reads), graph
