"""The stacked batch layout (cache/stacked.py): sequences in the same state share one cache
of the method's class, fed their rows together, and each gets what it gets alone.

The conformance suite's batch test stops within a dozen decode steps; here the runs go on
long enough for the stores' periodic work (flushes of the full-precision window, refits,
promotions between tiers) to happen while sequences are stacked, and two of the four
prompts have the same length so that they share one cache from their first decode step.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import batching
from conformance import profile
from tiny_models import prompt
from veloxquant_mlx.cache import batch as batch_module
from veloxquant_mlx.cache.stacked import StackedLayout, _Group, _grouped
from veloxquant_mlx.registry import METHODS

STACKED = sorted(k for k, info in METHODS.items() if info.implemented
                 and StackedLayout.accepts(info.load_implementation()))
PROMPTS = (200, 200, 130, 200)  # the first two start decoding together; the last joins later
MAX_TOKENS = (70, 50, 60, 40)
# Settings that make distinct prompts of one length hold one structure, for methods whose
# fitted ranks otherwise follow each prompt (an energy threshold): see
# test_ranks_that_differ_keep_sequences_apart for those.
FIXED_LAYOUT = {"palu": {"palu_rank": 24}}


@pytest.fixture(scope="module")
def kvtc_calibration(tmp_path_factory):
    """A calibration file for kvtc on the row-wise model (its compressing settings), fitted
    on a text of its own: every sequence codes with the file's codecs, so that distinct
    prompts share one cache (fitted on each prompt, their codecs differ: groups of one)."""
    path = batching.rowwise_calibration(tmp_path_factory.mktemp("kvtc"), "kvtc", profile("kvtc").compressing)
    return {"calibration_file": path}


def _settings(method, request):
    """The compressing settings, with those that fix the method's layout across prompts."""
    fixed = request.getfixturevalue("kvtc_calibration") if method == "kvtc" else FIXED_LAYOUT.get(method, {})
    return {**profile(method).compressing, **fixed}


def test_the_stores_that_stack():
    """Which methods take the layout (a change here is a decision: say why in the class)."""
    assert STACKED == ["a2ats", "adakv", "age_tiered", "amc", "anchorkv", "cachegen", "gear", "kitty", "kvquant",
                       "kvtc", "kvzip", "nsnquant", "palu", "rocketkv", "skvq", "spectral", "svdq", "turboquant",
                       "vecinfer", "xkv", "xquant", "zipcache"]
    for key in STACKED:
        assert batch_module.batch_mode(METHODS[key].load_implementation()) == batch_module.PACKED


@pytest.mark.parametrize("method", STACKED)
def test_stacked_batch_equals_each_sequence_alone(method, request):
    """Through mlx-lm's BatchGenerator on the row-wise model: the two sequences of 200
    tokens decode as one group of two for 50 steps, the others join and leave; tokens are
    equal to each sequence's alone, log-probabilities and every extracted cache equal to
    float rounding. On MLX's own BLAS they are bit-identical; OpenBLAS (CI) sums a matrix
    product of two rows in another order than one row's (gear's refits), as
    tests/test_conformance.py notes for the fitted methods. A group that mixed its rows
    would be off by far more (1.4 in a log-probability, seen while building this)."""
    model, make = batching.rowwise_setup(method, _settings(method, request))
    prompts = [prompt(n, seed=i + 3).tolist() for i, n in enumerate(PROMPTS)]
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, MAX_TOKENS)]
    sizes = set()

    def check(gen):
        batching.memory_check(gen)
        sizes.update(tuple(c.packed.group_sizes) for c in batching.batch_caches(gen) if c.packed is not None)

    got = batching.run_batched(model, prompts, MAX_TOKENS, check=check)
    assert (2,) in sizes, sizes  # the equal prompts shared one cache
    batching.assert_batch_equals_alone(got, alone)


def _decoded(method, lengths, steps=3):
    """Layer 0 of each prompt's cache on the row-wise model, after its prompt and ``steps``
    decode steps."""
    model, make = batching.rowwise_setup(method, profile(method).compressing)
    caches = []
    for i, n in enumerate(lengths):
        tokens, _, cache = batching.run_alone(model, make, prompt(n, seed=i + 3).tolist(), steps)
        caches.append(cache[0])
    return caches


def test_groups_join_by_state_and_split_on_filter():
    """Equal states join (in the order of their rows), a different one stays apart; taking a
    group's rows back gives each member's arrays bit for bit, and a group that loses a
    member keeps the others' rows."""
    singles = _decoded("gear", (200, 130, 200))
    before = [batching.state_arrays(c) for c in singles]
    groups = _grouped([_Group.of(s, i) for i, s in enumerate(singles)])
    assert [g.rows for g in groups] == [[0, 2], [1]]
    pair = groups[0]
    for j, row in enumerate(pair.rows):
        alone = pair.take([j], [0]).cache
        for name, x in batching.state_arrays(alone).items():
            assert mx.array_equal(x, before[row][name]), name
    last = pair.take([1], [0]).cache
    assert last.kv_shape[0] == 1 and pair.cache.kv_shape[0] == 2


def test_a_table_kept_once_must_be_equal_to_join():
    """An array without the batch first is kept once for the group; members whose copies
    differ are not joined (each keeps its own cache)."""
    a, b = _decoded("gear", (200, 200))
    ga, gb = _Group.of(a, 0), _Group.of(b, 1)
    table = mx.arange(6.0).reshape(3, 2)  # no batch axis: kept once
    ga.cache.table, gb.cache.table = table, table + 0
    ga.shared = gb.shared = frozenset({("table",)})
    joined = _Group.join([ga, gb])
    assert len(joined) == 1 and joined[0].cache.table is table
    gb.cache.table = table + 1
    assert [g.rows for g in _Group.join([ga, gb])] == [[0], [1]]


def test_callbacks_follow_their_cache():
    """A store's callback into its cache (a bound method) is bound to the group's cache when
    joined, and to the sequence's own cache when taken back or extracted."""
    a, b = _decoded("gear", (200, 200))
    a.store.callback, b.store.callback = a.size, b.size
    offset = b.offset
    layout = StackedLayout.pack([a, b])
    (group,) = layout.groups
    assert group.cache.store.callback.__self__ is group.cache
    assert group.take([1], [0]).cache.store.callback.__self__ is not group.cache
    one = layout.extract(1)
    assert one.store.callback.__self__ is one and one.offset == offset == layout.offsets[1]


def test_cross_layer_groups_share_one_context_at_every_layer():
    """xquant's reuse layers read their anchor's codes through the context: once a batch of
    two sequences of one length packs, each layer's group cache has a context whose
    ``layers`` are the group's caches at every layer (the same context object), and the
    plan made when the first layer packed is used up by the last (at the second step: the
    first ends the prompts)."""
    from decode_steps import prefilled
    from veloxquant_mlx.cache import stacked

    model, cache, token = prefilled("xquant")
    seqs = [[batch_module.copy_single(c, "merge") for c in cache] for _ in range(2)]
    batch = [c.merge([s[i] for s in seqs]) for i, c in enumerate(cache)]
    y = mx.concatenate([token, token])
    for _ in range(2):  # the first step ends the prompts, each sequence alone (stack_ready)
        y = mx.argmax(model(y[:, None], cache=batch)[:, -1], axis=-1)
        mx.eval(y)
    groups = [b.packed.groups for b in batch]
    assert all(len(g) == 1 and g[0].rows == [0, 1] for g in groups)
    context = groups[0][0].cache.context
    assert all(g[0].cache.context is context for g in groups)
    assert [context.layers[i] for i in range(len(batch))] == [g[0].cache for g in groups]
    assert not stacked._PLANS


def test_a_sequence_joining_in_the_same_state_joins_the_group():
    """``extend`` with a layout whose sequence is in the same state as one already there
    joins the two into one group; each is given back with its own arrays."""
    a, b = _decoded("gear", (200, 200))
    before = [batching.state_arrays(c) for c in (a, b)]
    layout, other = StackedLayout.pack([a]), StackedLayout.pack([b])
    layout.extend(other)
    assert layout.group_sizes == [2] and layout.offsets[0] == layout.offsets[1]
    for i in range(2):
        for name, x in batching.state_arrays(layout.extract(i)).items():
            assert mx.array_equal(x, before[i][name]), name


def test_ranks_that_differ_keep_sequences_apart():
    """palu at its energy threshold fits each prompt's rank: the two prompts of one length
    get different ranks here, so their caches' shapes differ and each decodes as a group
    of its own, still exactly as alone (a join would have had to pad one's latents)."""
    method = "palu"
    a, b = _decoded(method, (200, 200))
    assert (a.store.keys.tokens.rank, a.store.values.tokens.rank) != (b.store.keys.tokens.rank, b.store.values.tokens.rank)
    model, make = batching.rowwise_setup(method, profile(method).compressing)
    prompts = [prompt(n, seed=i + 3).tolist() for i, n in enumerate(PROMPTS)]
    alone = [batching.run_alone(model, make, t, m) for t, m in zip(prompts, MAX_TOKENS)]
    sizes = set()

    def check(gen):
        sizes.update(tuple(c.packed.group_sizes) for c in batching.batch_caches(gen) if c.packed is not None)

    got = batching.run_batched(model, prompts, MAX_TOKENS, check=check)
    assert sizes and all(set(s) == {1} for s in sizes), sizes
    for (tokens, logprobs, cache), (a_tokens, a_logprobs, a_cache) in zip(got, alone):
        assert tokens == a_tokens
        for x, y in zip(logprobs, a_logprobs):
            assert mx.array_equal(x, y)
        batching.assert_same_cache(cache, a_cache, exact=True)


@pytest.mark.parametrize("method", STACKED)
def test_short_prompts_whose_fit_comes_while_decoding_batch_as_alone(method, request):
    """Prompts shorter than a fit's rows (svdq's and palu's bases fit once head_dim tokens
    are held) or whose end brings the fit (xKV's SVD at the first decode step): a fit made
    in a group gave every member the largest of their ranks (a log-probability off by 2-4
    before ``stack_ready``). Two pairs of equal lengths, one pair below the tiny model's 32
    channels, the second pair joining the first after one step."""
    model, make = batching.rowwise_setup(method, _settings(method, request))
    prompts = [prompt(n, seed=i + 3).tolist() for i, n in enumerate((20, 20, 40, 40))]
    alone = [batching.run_alone(model, make, t, 60) for t in prompts]
    got = batching.run_batched(model, prompts, (60,) * 4, join_at=1)
    factors = LOW_RANK_FACTORS.get(method, ())
    batching.assert_batch_equals_alone(got, alone, by_shape=[f"{p}_lr_{x}" for p in factors for x in "ab"])
    for (_, _, cache), (_, _, a_cache) in zip(got, alone):
        for b, a in zip(cache, a_cache):
            mine, theirs = batching.state_arrays(b), batching.state_arrays(a)
            for p in factors:
                assert mx.allclose(_low_rank_product(mine, p), _low_rank_product(theirs, p), atol=1e-5)


# gear's low-rank factors A (tokens x rank) and B (channels x rank) a chunk: a fit of a
# group's rows rounds its Gram products otherwise than a row's alone, and where the short
# prompts' singular values nearly meet, that turns the rank's basis (A and B differ by up
# to 2.4 while A Bᵀ agrees to 1.5e-6). The product is what a cache keeps.
LOW_RANK_FACTORS = {"gear": ("k", "v")}


def _low_rank_product(arrays, prefix):
    a, b, chunk = arrays[f"{prefix}_lr_a"], arrays[f"{prefix}_lr_b"], arrays[f"{prefix}_lr_chunk"]
    return (b[:, :, chunk] @ a[..., None]).squeeze(-1)  # (B, H, T, channels)


@pytest.mark.parametrize("method, rank", [("svdq", {"svdq_rank": 8}), ("palu", {"palu_rank": 24})])
def test_a_fit_done_alone_joins_its_state_at_the_next_step(method, rank):
    """Two prompts of 20 tokens, under the bases' 32 rows, at one fixed rank: each is a
    group of its own until its fit, made alone, then the two share one cache; and a third
    sequence joining the packed batch before its fit neither unpacks it nor joins a group.
    Each sequence gets what it gets alone."""
    model, make = batching.rowwise_setup(method, {**profile(method).compressing, **rank})
    prompts = [prompt(n, seed=i + 3).tolist() for i, n in enumerate((20, 20, 20))]
    alone = [batching.run_alone(model, make, t, 60) for t in prompts]
    sizes, packed, unpacked = [], set(), []

    def check(gen):
        caches = batching.batch_caches(gen)
        sizes.append({tuple(c.packed.group_sizes) for c in caches if c.packed is not None})
        unpacked.extend(id(c) for c in caches if c.packed is None and id(c) in packed)
        packed.update(id(c) for c in caches if c.packed is not None)

    got = batching.run_batched(model, prompts, (60,) * 3, join_at=20, check=check)
    assert {(1, 1)} in sizes and {(2,)} in sizes, sizes
    assert sizes.index({(1, 1)}) < sizes.index({(2,)})
    assert not unpacked  # the joining sequence did not unpack the batch
    assert {(2, 1)} in sizes[20:], sizes[20:]  # it came in as a group of its own
    batching.assert_batch_equals_alone(got, alone)



def test_calibrated_kvtc_sequences_join_once_their_codecs_are_in_place(kvtc_calibration):
    """Two kvtc prompts of 20 tokens, inside the window: no codec until 32 rows leave it
    (about step 48), so each is a group of its own; then both hold the file's codec and
    share one cache, whose codec and its field layout (tables shaped (1, 1, k)) are kept
    once, not stacked as if they had a row a sequence. Each gets what it gets alone."""
    model, make = batching.rowwise_setup("kvtc", {**profile("kvtc").compressing, **kvtc_calibration})
    prompts = [prompt(20, seed=i + 3).tolist() for i in range(2)]
    alone = [batching.run_alone(model, make, t, 100) for t in prompts]
    sizes = []

    def check(gen):
        sizes.append({tuple(c.packed.group_sizes) for c in batching.batch_caches(gen) if c.packed is not None})

    got = batching.run_batched(model, prompts, (100, 100), join_at=200, check=check)
    assert sizes[0] == {(1, 1)} and {(2,)} in sizes, sizes
    batching.assert_batch_equals_alone(got, alone)
