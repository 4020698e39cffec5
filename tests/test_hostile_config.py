"""Config assignments a hostile user tries: a refused one changes nothing."""

from __future__ import annotations

import warnings

import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx.cache.options import SnapKVOptions


def _values(config):
    return config.to_dict()


def test_a_refused_flat_assignment_changes_nothing():
    """Before: after ``config.snap_budget = 10`` raised, the field read 10."""
    config = KVCacheConfig(method="snapkv")
    before = _values(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ValueError, match=r"snap_budget must be at least .*got snap_budget=10"):
            config.snap_budget = 10
    assert config.snap_budget == 512 and _values(config) == before


def test_a_refused_method_switch_changes_nothing():
    """An h2o config holding a snapkv window the snapkv rules refuse (a flat value of a
    method not in force is only range-checked): switching to snapkv is refused whole."""
    config = KVCacheConfig(method="h2o")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config.snap_obs_window = 600  # in range; snapkv's budget rule is not in force
        before = _values(config)
        with pytest.raises(ValueError, match=r"snap_budget must be at least .*snap_obs_window=600"):
            config.method = "snapkv"
    assert config.method == "h2o" and _values(config) == before


def test_refused_options_change_nothing():
    config = KVCacheConfig(method="snapkv")
    before = _values(config)
    bad = SnapKVOptions(snap_budget=40)
    object.__setattr__(bad, "snap_obs_window", 64)  # past the options' own check
    with pytest.raises(ValueError, match=r"snap_budget must be at least .*snap_budget=40"):
        config.options = bad
    assert _values(config) == before
