"""Issue 30's CPU guards, for every implemented method: a steady-state decode step, run
the way mlx-lm's generate_step runs it, reads no array value on the host (a sync), and
its graph is no bigger than 1.3x the full cache's."""

from __future__ import annotations

import pytest

from conformance import COMPOSED
from decode_steps import host_reads_while_decoding, step_graph
from veloxquant_mlx.registry import implemented_methods

# Methods whose decode step still reads values on the host, and why (strict: a fixed
# method fails here until its entry goes).
KNOWN_SYNCS = {
}


def _expect(method, known):
    if method in known:
        return pytest.param(method, marks=pytest.mark.xfail(strict=True, reason=known[method]))
    return method


@pytest.mark.parametrize("method", [_expect(m, KNOWN_SYNCS) for m in (*implemented_methods(), *COMPOSED)])
def test_a_decode_step_reads_no_array_value_on_the_host(method):
    reads = host_reads_while_decoding(method)
    distinct = sorted({str(r) for r in reads})
    assert not reads, f"{method}: {len(reads)} host reads in 40 decode steps: " + "; ".join(distinct)


# The step's graph as a ratio to the full cache's (tiny llama, whole model: see
# benchmarks/notes/decode_graph.md), remeasured on 2026-12-03 after the compiled-pass cuts of that day (minicache, h2o+kivi2: later that day).
OVER_GRAPH_BOUND = {
    "amc": 3.85,
    "spectral": 2.94,  # encode and read compiled (3.61 before); still: the per-token encode (binary-search gathers) and the QJL read
    # a compiled read and merge (retained tables read unmasked: 1.46 -> 1.43); still: the
    # pair's SLERP for keys and values (17 nodes each), the retained pairs' cumsum/scatter
    # writes (4 scatters) and the second layer's table reads (gather + scatter per table)
    "minicache": 1.43,
    # composed (issue 36): h2o's every step also dequantizes the kept keys for its
    # accumulated attention (one compiled pass over the room now, 1.43 -> 1.37; still: the
    # dequantization and the float32 score matmul/softmax/mean a layer, which the mass needs
    # bit for bit; snapkv+kivi4 and tova+kivi4 are under the bound: 1.21)
    "h2o+kivi2": 1.37,
}
GRAPH_BOUND = 1.3

# Cache state that generate_step's loop never evaluates (it is not in the logits' graph),
# so its lazy graph lengthens step after step: the arrays, as found.
GROWING_LAZY_STATE = {
}


@pytest.mark.parametrize("method", [
    _expect(m, {k: f"a decode step's graph is {r:.2f}x the full cache's" for k, r in OVER_GRAPH_BOUND.items()})
    for m in (*implemented_methods(), *COMPOSED)])
def test_a_decode_steps_graph_is_at_most_1_3x_the_full_caches(method):
    full, graph = step_graph("full"), step_graph(method)
    ratio = graph.nodes / full.nodes
    assert ratio <= GRAPH_BOUND, (
        f"{method}: a decode step's graph has {graph.nodes} nodes, {ratio:.2f}x the full cache's "
        f"{full.nodes} ({(graph.nodes - full.nodes) / graph.layers:+.0f} a layer)")


@pytest.mark.parametrize("method", [_expect(m, GROWING_LAZY_STATE) for m in (*implemented_methods(), *COMPOSED)])
def test_cache_state_left_unevaluated_does_not_grow_step_after_step(method):
    pending = step_graph(method).pending
    assert not step_graph(method).grows, (
        f"{method}: cache operations left unevaluated by generate_step's loop after 10, 20, 30 "
        f"steps: {pending}")
