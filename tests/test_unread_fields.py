"""A config field the method does not read warns (``veloxquant generate --set`` refuses it)."""

from __future__ import annotations

import re
import warnings

import pytest

from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx._generated.deprecations import CONFIG_FIELD_USERS
from veloxquant_mlx.cache.config import describe_fields_read
from veloxquant_mlx.diagnostics import UnreadFieldWarning


@pytest.mark.parametrize("method, field, value", [
    ("kitty", "kv_bits", 4),
    ("kvquant", "residual_window", 64),
    ("skvq", "residual_window", 64),
    ("age_tiered", "residual_window", 64),
    ("snapkv", "kv_bits", 4),
    ("snapkv", "fused_attention", False),
])
def test_a_field_the_method_does_not_read_warns_naming_field_method_and_what_it_reads(method, field, value):
    assert method not in CONFIG_FIELD_USERS[field]
    want = (f"KVCacheConfig.{field}={value!r} has no effect: {method} does not read {field}; "
            f"{describe_fields_read(method)}")
    with pytest.warns(UnreadFieldWarning, match=f"^{re.escape(want)}$") as record:
        config = KVCacheConfig(method=method, **{field: value})
    assert record[0].filename == __file__  # points at the caller's line
    with pytest.warns(UnreadFieldWarning, match=f"^{re.escape(want)}$"):
        KVCacheConfig.from_dict({"method": method, field: value})
    with pytest.warns(UnreadFieldWarning, match=f"^{re.escape(want)}$"):
        setattr(config, field, value)


def test_fields_the_method_reads_and_defaults_do_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = KVCacheConfig(method="kivi", kv_bits=4, residual_window=64, fused_attention=False)
        config.kv_bits = 2
        KVCacheConfig(method="kitty", residual_window=64)
        KVCacheConfig(method="snapkv").to_dict()
        KVCacheConfig.from_dict(KVCacheConfig(method="snapkv").to_dict())
