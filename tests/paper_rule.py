"""Replays of a paper's eviction rule with the recent window its options give, no floor.

Keyformer, Q-Filters and L2Norm keep at least ``RECENT_FLOOR`` newest tokens whatever
their ``*_recent`` option says, and TOVA (no such option) as many (``recent_floor``); the
papers' rules have no such floor.
Tests that replay a rule step by step use this fixture to check the rule alone;
tests/test_default_recent_window.py checks the floor.
"""

import pytest

from veloxquant_mlx.methods.keyformer import KeyformerCache
from veloxquant_mlx.methods.knorm import L2NormCache
from veloxquant_mlx.methods.qfilters import QFiltersCache
from veloxquant_mlx.methods.tova import TOVACache


@pytest.fixture
def no_recent_floor(monkeypatch):
    for cls in (KeyformerCache, L2NormCache, QFiltersCache, TOVACache):
        monkeypatch.setattr(cls, "recent_floor", 0)


EVERY_STEP = ("H2OCache", "TOVACache", "L2NormCache", "KeyformerCache", "MorphKVCache", "CaMCache")


@pytest.fixture
def evict_every_step(monkeypatch):
    """The papers' schedule: a token leaves at every decode step (the caches evict
    ``EVICT_EVERY`` at once by default; tests/test_batched_eviction.py checks that)."""
    from dataclasses import replace

    from veloxquant_mlx.methods.cam import CaMCache
    from veloxquant_mlx.methods.h2o import H2OCache
    from veloxquant_mlx.methods.morphkv import MorphKVCache

    for cls in (H2OCache, TOVACache, L2NormCache, KeyformerCache, MorphKVCache, CaMCache):
        monkeypatch.setattr(cls, "schedule", replace(cls.schedule, decode_every=1))
