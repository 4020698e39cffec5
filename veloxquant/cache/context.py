"""The state one prompt cache's layers share (built by the cache factory, one per prompt).

Sharded models. mlx-lm splits a model across processes (``mlx.core.distributed``) two
ways, and each process builds its own prompt cache:

- pipeline (``model.model.pipeline(group)``): each rank runs a contiguous run of layers,
  the last rank the first layers, rank 0 the last ones. A rank's caches are its own
  layers only; ``ShardLayout`` says which global layers each rank holds. Caches are
  numbered by global layer index (``cache.layer``), so a layer's place in per-layer
  schedules, groups and saved files is the same as in one process.
- tensor (``model.shard(group)``): every rank runs every layer with its share of the KV
  heads; a cache sees only its rank's heads (it learns the count from its first update).

What crosses ranks, and how: nothing flows between caches during a forward pass (a
collective inside one stage's layers would wait on a stage that waits on it). Layer
groups that share arrays (xkv, xquant, minicache, chunkkv's reuse) must lie on one rank:
a layout that splits one is refused when the cache is built, naming the layers and the
split that would keep them together. Quantities fixed once per prompt from every layer
(SqueezeAttention's similarity, KVzip's global ranking) are combined across pipeline
ranks with ``mx.distributed.all_sum`` (each rank contributes its layers' entries, zeros
elsewhere, so the sum is exact); rankings over heads combine the tensor ranks' heads with
``all_gather``. Schedules that depend only on a layer's index (PyramidKV) need no
exchange: every rank computes them over the global layer list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from .config import KVCacheConfig


@dataclass(frozen=True)
class ShardLayout:
    """Where this process's layers sit in a model sharded by mlx-lm (one process: trivial).

    ``stages[r]`` is the (start, end) of the global layers pipeline rank ``r`` runs.
    """

    stages: tuple[tuple[int, int], ...] = ()
    pipeline_rank: int = 0
    pipeline_group: Any = None  # the mx.distributed group of the pipeline (None: one stage)
    tensor_group: Any = None  # the group the heads are split over (None: all heads here)

    def __deepcopy__(self, memo):
        # Copies of a prompt cache (mlx-lm's server, batching) run on the same processes:
        # they share the layout, and a distributed group cannot be copied.
        return self

    @property
    def first_layer(self) -> int:
        """The global index of this rank's first layer."""
        return self.stages[self.pipeline_rank][0] if self.stages else 0

    @property
    def pipelined(self) -> bool:
        return self.pipeline_group is not None and len(self.stages) > 1

    def stage_of(self, layer: int) -> int:
        """The pipeline rank that runs global layer ``layer``."""
        for rank, (start, end) in enumerate(self.stages):
            if start <= layer < end:
                return rank
        return 0

    def describe(self) -> str:
        return ", ".join(f"rank {r}: layers {s}-{e - 1}" for r, (s, e) in enumerate(self.stages))


@dataclass
class ModelContext:
    """State shared by the layers of one prompt cache (one per ``make_prompt_cache``).

    Methods that coordinate across layers (per-layer budgets, layers sharing or merging
    their caches) keep that state here, never in globals. Layer indices are global (the
    model's, on every rank of a sharded model; see the module doc).
    """

    config: KVCacheConfig
    n_layers: int
    compressed_layers: tuple[int, ...]
    shared: dict[str, Any] = field(default_factory=dict)
    layer_budgets: dict[int, int] = field(default_factory=dict)  # per-layer token budgets
    model_args: Any = None  # the model's ModelArgs (rope_theta, head counts, ...) when known
    # The prompt cache's layers, by global layer index (the model's own caches included;
    # None for a layer another pipeline rank runs): how a layer reaches its neighbours'
    # caches (cross-layer methods, cache/cross_layer.py).
    layers: list = field(default_factory=list)
    shard: ShardLayout = field(default_factory=ShardLayout)

    @property
    def local_compressed_layers(self) -> tuple[int, ...]:
        """The compressed layers this process holds."""
        if not self.shard.pipelined:
            return self.compressed_layers
        start, end = self.shard.stages[self.shard.pipeline_rank]
        return tuple(i for i in self.compressed_layers if start <= i < end)

    def require_one_stage(self, layers, what: str) -> None:
        """Refuse a pipeline layout that puts ``layers`` (which share arrays) on several ranks."""
        if not self.shard.pipelined or len({self.shard.stage_of(i) for i in layers}) <= 1:
            return
        stages = self.shard.stages
        raise ValueError(
            f"method {self.config.method!r}: {what} layers {list(layers)} together, but the "
            f"pipeline puts them on different ranks ({self.shard.describe()}); allowed: "
            "layouts that keep each group on one rank: pass split= (layers per rank, rank 0 "
            "first, rank 0 running the last layers) to model.model.pipeline(group, split) "
            f"so that no group crosses a boundary (now split={[e - s for s, e in stages]})"
        )

    def sum_over_stages(self, x: mx.array) -> mx.array:
        """``x`` summed over the pipeline ranks (each holds its layers' entries, zeros
        elsewhere): what one process holding every layer would have."""
        if not self.shard.pipelined:
            return x
        return mx.distributed.all_sum(x, group=self.shard.pipeline_group)

    def gather_heads(self, x: mx.array, axis: int = 1) -> mx.array:
        """``x`` (heads on ``axis``) with every tensor rank's heads, in the model's order."""
        group = self.shard.tensor_group
        if group is None or group.size() == 1:
            return x
        gathered = mx.distributed.all_gather(mx.expand_dims(x, 0), group=group)
        return mx.concatenate(mx.split(gathered, group.size(), axis=0), axis=axis + 1)[0]

    def heads_of_this_rank(self, x: mx.array, n_local: int, axis: int = 1) -> mx.array:
        """This tensor rank's share of ``x``, whose ``axis`` holds every rank's heads."""
        group = self.shard.tensor_group
        if group is None or group.size() == 1:
            return x
        start = group.rank() * n_local
        index = [slice(None)] * x.ndim
        index[axis] = slice(start, start + n_local)
        return x[tuple(index)]

    # -- quantities over every layer (and head) of the model --------------------------------
    def over_all_layers(self, per_layer: dict[int, mx.array]) -> dict[int, mx.array]:
        """Each compressed layer's array (same shape on every layer), wherever it is held:
        ``per_layer`` has this rank's layers; the others come from the other pipeline ranks."""
        if not self.shard.pipelined:
            return dict(per_layer)
        local = self.local_compressed_layers
        if not local:
            raise ValueError(f"method {self.config.method!r}: pipeline rank "
                             f"{self.shard.pipeline_rank} holds no compressed layer; allowed: "
                             "layouts that give every rank one")
        like = per_layer[local[0]]
        stacked = mx.stack([per_layer[i] if i in per_layer else mx.zeros_like(like)
                            for i in self.compressed_layers])
        stacked = self.sum_over_stages(stacked)
        return {i: stacked[n] for n, i in enumerate(self.compressed_layers)}

    def select_over_model(self, scores: dict[int, mx.array], total: int, select) -> dict[int, mx.array]:
        """A selection over every layer and head at once, from this rank's part of it.

        ``scores``: this rank's layers, (B, heads here, T) each; ``total``: what they may
        keep; ``select(scores, total)`` takes every layer's scores (global layer order, every
        head) and the model's total, and returns a mask per layer. Returns this rank's masks,
        equal to what one process holding the whole model would choose."""
        sharded = self.shard.pipelined or (self.shard.tensor_group is not None
                                           and self.shard.tensor_group.size() > 1)
        if not sharded:
            masks = select([scores[i] for i in scores], total)
            return dict(zip(scores, masks))
        n_local = next(iter(scores.values())).shape[1]
        full = {i: self.gather_heads(s) for i, s in scores.items()}
        counts = mx.array([total], mx.int32)
        if self.shard.tensor_group is not None:
            counts = mx.distributed.all_sum(counts, group=self.shard.tensor_group)
        # Once per prompt, before generation: the model's total is a host number.
        total = int(self.sum_over_stages(counts).item())
        everything = self.over_all_layers(full)
        masks = dict(zip(everything, select(list(everything.values()), total)))
        return {i: self.heads_of_this_rank(masks[i], n_local) for i in scores}
