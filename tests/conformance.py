"""What the conformance suite knows about each method: the one place it reads.

A method joins the suite by being implemented. Methods on the eviction base need no
entry: their settings come from their ``roles`` (a small budget to compress, a budget
beyond the context to keep everything). Any other method gives its settings here, and
a method that cannot meet a check says why here (``exempt``), never by skipping quietly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx._generated.deprecations import CONFIG_FIELDS
from veloxquant_mlx.cache.buffers import GrowingArray
from veloxquant_mlx.evict.base import ScoredEvictionCache
from veloxquant_mlx.registry import METHODS

PROMPT = 200  # tokens of the test prompts
BUDGET = 48  # what a compressing setting keeps (or its equivalent)
LOSSLESS = 4096  # a budget beyond every test context


@dataclass
class Profile:
    compressing: dict[str, Any]  # settings under which the test prompt is compressed
    lossless: dict[str, Any] | None  # settings that keep everything (None: there are none)
    lossless_tolerance: float = 0.0  # 0: bit-identical to mlx-lm's KVCache
    evicts: bool = False  # attention sees a subset of the tokens, in full precision
    bound_after_decode: bool = True  # stored_length <= budget (+ decode_slack) holds at decode too
    decode_slack: int = 0  # tokens over the budget between two batched decode-time evictions
    exempt: dict[str, str] = field(default_factory=dict)  # check -> why it cannot be met
    # Settings laid over ``compressing`` for the kept-positions reference (attention over
    # the cache == attention over the tokens it keeps, as they came): a merging method
    # changes kept values on purpose, so that check runs it with merging off.
    reference: dict[str, Any] = field(default_factory=dict)


PROFILES: dict[str, Profile] = {
    "kvzip": Profile(
        # The suite drives the model the way mlx-lm does, which cannot run KVzip's
        # reconstruction pass: a prompt over the budget gets the documented (warned)
        # fall-back, B tokens per head by the last prompt queries. The pass, its global
        # ranking and its padded per-head budgets are checked in tests/test_kvzip.py.
        compressing={"kvzip_budget": BUDGET},
        lossless={"kvzip_budget": LOSSLESS},
        evicts=True,
        bound_after_decode=False,  # prefill-only: decoded tokens are appended
    ),
    "nestedkv": Profile(
        # The shared budget, with a window small enough to fit it (nestedkv_budget must
        # cover nestedkv_n_sink + nestedkv_window): the default head-adaptive split, which
        # on the tiny models comes out even (48 a head), so the per-head storage bound
        # holds; uneven splits, padding and nbytes are checked in tests/test_nestedkv.py.
        compressing={"nestedkv_budget": BUDGET, "nestedkv_window": 16},
        lossless={"nestedkv_budget": LOSSLESS},
        evicts=True,
        bound_after_decode=False,  # prefill-only: decoded tokens are appended
    ),
    "full": Profile(compressing={}, lossless={}),
    "streaming_llm": Profile(
        compressing={"stream_n_sink": 4, "stream_window_size": BUDGET - 4},
        lossless={"stream_window_size": LOSSLESS},
        evicts=True,
        exempt={
            "per_layer_budgets": "one window for every layer (its own test sets them per layer)",
        },
    ),
    "kivi": Profile(
        compressing={"kv_bits": 4, "residual_window": 32},
        # A window beyond the context keeps every token in full precision; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"residual_window": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "turboquant": Profile(
        # 3-bit keys (2 bits of levels + the QJL sign) and values past a 32-token window:
        # the 200-token prompt codes 168 of its tokens, each decode step one more.
        compressing={"turboquant_window": 32},
        # A window beyond the context keeps every token in full precision; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"turboquant_window": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "age_tiered": Profile(
        # Tiers at 8/4/2 bits, all three used by the 200-token prompt: recent under 32
        # tokens, mid up to age 96, old beyond (blocks of 32 tokens).
        compressing={"age_recent_boundary": 32, "age_mid_boundary": 96, "age_bits_recent": 8,
                     "age_bits_mid": 4, "age_bits_old": 2, "age_group_size": 32},
        # 16-bit tiers keep the model's rows; decode attends through the pure-MLX path.
        lossless={"age_bits_recent": 16, "age_bits_mid": 16, "age_bits_old": 16},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, by age tier"},
    ),
    "kitty": Profile(
        # 32 sinks, blocks of 32 tokens with a quarter of the channels at 4 bits, the rest
        # and the values at 2 bits: the 200-token prompt quantizes most of its tokens.
        compressing={"residual_window": 32, "kitty_group_size": 32},
        # A block beyond the context keeps every token in full precision; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"residual_window": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "adakv": Profile(
        # Blocks of 32 tokens flush under the per-head allocation (2/3/4 bits, mean 2.5):
        # the 200-token prompt quantizes 192 of its tokens, decoding flushes again.
        compressing={"residual_window": 32},
        # A window beyond the context keeps every token in full precision; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"residual_window": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "skvq": Profile(
        # 4 sinks and a 32-token window around 2-bit keys and values (per token, reordered,
        # clipped): the 200-token prompt quantizes 164 of its tokens, each decode step one more.
        compressing={"skvq_window": 32, "skvq_n_sink": 4},
        # A window beyond the context keeps every token in full precision; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"skvq_window": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "gear": Profile(
        # 2-bit backbone, the energy rule, 1% outliers; decode chunks of 32 tokens: the
        # 200-token prompt is compressed as one chunk of 192 (8 tokens stay exact) and the
        # 8 decode steps compress a second chunk.
        compressing={"residual_window": 32},
        # The rank at its maximum (clipped to min(chunk, head_dim): the residual kept whole)
        # and the most outliers: every token comes back to float rounding (not bitwise).
        lossless={"gear_rank": LOSSLESS, "gear_sparse_fraction": 0.1},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, compressed"},
    ),
    "kvquant": Profile(
        # The defaults (3-bit codebooks, 1% outliers, groups of 32, 1 sink) with a refit
        # every 4 decode steps, so that saved, loaded and copied caches carry several
        # codebooks: the 200-token prompt quantizes 192 keys and 199 values.
        compressing={"kvquant_refit_interval": 4},
        # Sinks beyond the context keep every token in the model's dtype; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"kvquant_n_sink": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "rocketkv": Profile(
        # Stage 1 at c = 32 keeps floor(200 / 32^0.5) = 35 tokens, raised to its 4 sinks + 32
        # window tokens: 36 of the 200-token prompt (the floor is also the budget before a
        # prompt). At a decode step stage 2 attends only to the tokens of the pages it
        # chooses, which the reference check (attention over every stored slot) cannot
        # follow: one page holding every token makes the chosen pages all of them, its exact
        # path. tests/test_rocketkv.py checks the sparse path by brute force.
        compressing={"rocketkv_compression_ratio": 32.0, "rocketkv_page_size": LOSSLESS},
        # c = 1 keeps the whole prompt (C1 = L); one page: every step attends to all of it.
        lossless={"rocketkv_compression_ratio": 1.0, "rocketkv_page_size": LOSSLESS},
        evicts=True,
        bound_after_decode=False,  # stage 2 evicts nothing: the cache grows while decoding
    ),
    "zipcache": Profile(
        # Decode blocks of 4 tokens, so that the 8 decode steps re-compress twice: the
        # 200-token prompt is classified 20% at 4 bits, the rest at 2 bits.
        compressing={"residual_window": 4},
        # None: every prompt token is quantized at prefill (hi bits are at most 8).
        lossless=None,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "cam": Profile(
        # Merging on (the defaults: sim_weighted, the Bernoulli gate), so the save/load,
        # copy, trim and server checks run merged values through the cache's state.
        compressing={"cam_budget": BUDGET},
        lossless={"cam_budget": LOSSLESS},
        evicts=True,
        # An evicted token's value is added to kept ones: attention over the cache is not
        # attention over the kept tokens as they came, by design. With merging off it is
        # (the layout, sinks + newest, is the same); tests/test_cam.py checks the merge.
        reference={"cam_merge": "none"},
        decode_slack=31,  # EVICT_EVERY - 1 tokens over the budget between batched evictions
    ),
    "vecinfer": Profile(
        # Codebooks fitted from the prompt, small enough (64 key / 16 value centroids) that
        # the 200-token prompt (3,200 key sub-vectors) has more points than centroids: the
        # codes are lossy; a 32-token window, so most of the prompt is coded.
        compressing={"key_codebook_bits": 6, "value_codebook_bits": 4, "residual_length": 32},
        # A window beyond the context keeps every token in full precision; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"residual_length": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, coded"},
    ),
    "nsnquant": Profile(
        # Chunks of 32 tokens: 192 of the 200-token prompt are coded at 2 bits.
        compressing={"nsn_residual_length": 32},
        # A chunk beyond the context: every token stays in the full-precision tail.
        lossless={"nsn_residual_length": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, coded"},
    ),
    "amc": Profile(
        # The defaults with adaptive thresholds over an 8-token window: the 200-token
        # prompt is tiered 20/30/50 per head and chunk, decode tokens by the moving
        # thresholds, so the heads' tiers come out ragged.
        compressing={"amc_adaptive_thresholds": True, "amc_threshold_window": 8},
        # None: every token is quantized (High is 8-bit); amc_k_high=1 is uniform 8-bit.
        lossless=None,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, tiered"},
    ),
    "spectral": Profile(
        # kv_bits=2 (b_low 2, b_high 3), the card's d_eff (values clamped to 31 at head_dim
        # 32), QJL on: every token is coded as it comes, at prefill and decode.
        compressing={"kv_bits": 2},
        # None: every token is coded (no window, no full-precision setting).
        lossless=None,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, coded"},
    ),
    "a2ats": Profile(
        # Each decode step attends to 8 sinks, a 16-token window and the top 10% of the
        # rest per query head, picked through 6-bit codes fitted from the prompt.
        compressing={"a2ats_retrieval_fraction": 0.1, "a2ats_window": 16, "a2ats_codebook_bits": 6},
        # K covering every candidate: exact attention over every stored row.
        lossless={"a2ats_retrieval_fraction": 1.0},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every token is kept exactly; only attention is sparse"},
    ),
    "cachegen": Profile(
        # The defaults: 4-bit deltas (5 in the first layer group) from 8-bit anchors, groups
        # of 32: the 200-token prompt codes 192 tokens, the decode steps a group more.
        compressing={"cachegen_group_size": 32},
        # None: every whole group is quantized (8 bits at most).
        lossless=None,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "kvtc": Profile(
        # 4 sinks, a 32-token window, the middle (164 tokens of the prompt, then one more a
        # decode step) in a PCA basis fitted per layer at 128 bits a token (of 64 channels).
        compressing={"residual_window": 32, "kvtc_bit_budget": 128},
        # A window beyond the context keeps every token in full precision; decode attends
        # through the pure-MLX path (not SDPA), so equal to float rounding, not bitwise.
        lossless={"residual_window": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, transform-coded"},
    ),
    "svdq": Profile(
        # The default schedule (8, 4, 2, 1, 1, 0, 0, 0) over the per-head key basis holding
        # 95% of the singular-value mass: the prompt is held exactly until the first decode
        # step, then 192 of its keys are quantized latents (groups of 32), 16 wait exact.
        compressing={"svdq_group_size": 32},
        # Full rank and every group unquantized: K_hat = (K - mu) V Vᵀ + mu = K; decode
        # attends through the folded query (pure-MLX path), equal to float rounding.
        lossless={"svdq_rank": LOSSLESS, "svdq_bit_schedule": [16] * 8},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, as latents"},
    ),
    "palu": Profile(
        # One basis per KV head group of the tiny models' 2 KV heads (one head a group),
        # 4/2-bit latents of keys and values at the energy threshold 0.9.
        compressing={"palu_n_head_groups": 2},
        # Full rank, latents unquantized (16 bits), both heads sharing one basis: exact
        # reconstruction; decode folds the basis into query and mix, to float rounding.
        lossless={"palu_rank": LOSSLESS, "palu_hi_bit": 16, "palu_lo_bit": 16, "palu_n_head_groups": 1},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, as latents"},
    ),
    "anchorkv": Profile(
        # The 199 prompt tokens before the first decode step compressed then: 16 anchors
        # (4 window, 8 by score, 4 uniform), the other 183 on them, residuals for the
        # tokens of highest utility within 10% of the prompt's K+V bytes; decode tokens exact.
        compressing={"anchorkv_anchor_frac": 0.08, "anchorkv_window": 4, "anchorkv_theta": 0.1},
        # Every token an anchor: kept exactly; decode through the pure-MLX path.
        lossless={"anchorkv_anchor_frac": 1.0},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no token is dropped: the budget is bytes, not tokens"},
    ),
    "xkv": Profile(
        # The defaults (energy 0.95, 4-bit latent, pairs of layers): the 199-token prompt is
        # compressed by one joint SVD per pair at the first decode step.
        compressing={},
        # Full rank (capped at min(T, 2*n_kv*d)) and the latent in the model dtype: the
        # keys come back to float rounding (decode through the pure-MLX path).
        lossless={"xkv_rank": LOSSLESS, "xkv_latent_bits": 16},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, keys low-rank"},
    ),
    "xquant": Profile(
        # A 32-token window: layer 1 reuses layer 0's 2-bit codes for 192 of the prompt's tokens.
        compressing={"residual_window": 32},
        # A window beyond the context keeps every token in full precision.
        lossless={"residual_window": LOSSLESS},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, quantized"},
    ),
    "minicache": Profile(
        # The tiny models' two layers form the one pair (start 0); at a cosine threshold of
        # 0 about half of the (token, head) pairs of random weights merge, half are retained.
        compressing={"minicache_start_frac": 0.0, "minicache_retention_threshold": 0.0},
        # A threshold above 1 retains every pair: both layers read their own rows.
        lossless={"minicache_start_frac": 0.0, "minicache_retention_threshold": 2.0},
        lossless_tolerance=1e-5,
        exempt={"per_layer_budgets": "no budget: every layer keeps every token, merged in depth"},
    ),
}


# Caches whose memory differs from their nbytes in the conformance check (deleting the cache
# after a 512-token prompt, tiny llama, with MLX's allocator pool off so that each buffer is
# counted at its own size): an expected failure, strict, each with its ratio and cause; a
# fix removes its entry. (The ~19 entries this list held until 2026-12-02, 1.08-1.35x and
# varying between runs, were the allocator's pool, not the caches: it serves a request
# from a freed block up to min(2x, +2 pages) larger and counts the whole block.)
MEMORY_NOT_YET_NBYTES: dict[str, str] = {
    # By design: nsnquant's universal codebook is built once per process and settings
    # (an lru_cache shared by every cache that uses them), and each layer counts it, so
    # deleting one cache frees 16,384 bytes less than its nbytes.
    "nsnquant/float16": "nbytes count the process-wide codebook, which stays (freed 0.818x its nbytes)",
    "nsnquant/float32": "nbytes count the process-wide codebook, which stays (freed 0.846x its nbytes)",
}


# Eviction composed with quantized storage (issue 36), as pseudo-method keys
# "<eviction method>+kivi<bits>": the eviction method's profile, its kept tokens held by
# KIVI's group-affine quantizer at <bits> (tests/test_composition.py).
COMPOSED = ("snapkv+kivi4", "h2o+kivi2", "tova+kivi4")


def split_composed(method: str) -> tuple[str, dict[str, Any]]:
    """("snapkv", {"storage": {...}, "kv_bits": 4}) for "snapkv+kivi4"; (method, {}) else."""
    if "+" not in method:
        return method, {}
    base, storage = method.split("+")
    bits = int(storage.removeprefix("kivi"))
    return base, {"storage": {"method": "kivi", "options": {}}, "kv_bits": bits}


def profile(method: str) -> Profile:
    method = split_composed(method)[0]
    if method in PROFILES:
        return PROFILES[method]
    cls = METHODS[method].load_implementation()
    if issubclass(cls, ScoredEvictionCache):
        return Profile(
            compressing={cls.roles.budget: BUDGET},
            lossless={cls.roles.budget: LOSSLESS},
            evicts=True,
            bound_after_decode=bool(cls.schedule.decode_every),
            decode_slack=max(0, cls.schedule.decode_every - 1),
        )
    raise AssertionError(
        f"method {method!r} is implemented but tests/conformance.py has no profile for it: "
        "give its compressing and lossless settings there"
    )


def config(method: str, settings: dict[str, Any]) -> KVCacheConfig:
    method, composed = split_composed(method)
    settings = {**composed, **settings}
    own = {k: v for k, v in settings.items() if k in CONFIG_FIELDS or k == "storage"}
    options = {k: v for k, v in settings.items() if k not in own}
    return KVCacheConfig.from_dict({"method": method, "options": options, **own})


def arrays_held(obj, seen=None) -> int:
    """Bytes of every MLX array reachable from a cache's attributes (not its config or
    context): an independent count to hold ``nbytes`` against."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return 0
    seen.add(id(obj))
    if isinstance(obj, mx.array):
        return obj.nbytes
    if isinstance(obj, GrowingArray):
        return 0 if obj.buffer is None else arrays_held(obj.buffer, seen)
    if isinstance(obj, dict):
        return sum(arrays_held(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(arrays_held(v, seen) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, (type, KVCacheConfig)):
        return sum(arrays_held(v, seen) for k, v in vars(obj).items() if k not in ("context", "config"))
    return 0


def edit_saved_layer(path, layer, edit):
    """Change one layer's saved state: ``edit(meta: dict[str, str|int], arrays: dict)``."""
    arrays, metadata = mx.load(str(path), return_metadata=True)
    prefix = f"{layer}."
    meta = {}
    for key, value in arrays.items():
        if key.startswith(prefix + "meta."):
            meta[key[len(prefix + "meta."):]] = value
    decoded = {k: ("".join(chr(int(c)) for c in v.tolist()) if v.ndim == 1 and v.size > 1 else v.item())
               for k, v in meta.items() if v.size}
    own = {k[len(prefix + "arrays."):]: v for k, v in arrays.items() if k.startswith(prefix + "arrays.")}
    edit(decoded, own)
    for k, v in decoded.items():
        arrays[prefix + "meta." + k] = mx.array([ord(c) for c in v]) if isinstance(v, str) else mx.array(v)
    for k, v in own.items():
        arrays[prefix + "arrays." + k] = v
    mx.save_safetensors(str(path), arrays, metadata)
