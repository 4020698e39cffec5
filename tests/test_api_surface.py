"""Snapshots of the public surface generated from the spec.

syrupy's default serializer sorts dict keys, so everything order-sensitive is
snapshotted as a list or a string.
"""

import dataclasses
import inspect

import pytest

import veloxquant_mlx
from veloxquant_mlx import KVCacheConfig
from veloxquant_mlx._generated import deprecations
from veloxquant_mlx.cache import options
from veloxquant_mlx.registry import METHODS


BEYOND_CONTRACT = ("TurboQuantOptions",)


def test_options_all(snapshot):
    assert list(options.__all__) == snapshot


@pytest.mark.parametrize("name", options.__all__)
def test_options_class_signature(name, snapshot):
    cls = getattr(options, name)
    fields = [f"{f.name}: {inspect.formatannotation(f.type)}" for f in dataclasses.fields(cls)]
    assert {"signature": f"{name}{inspect.signature(cls)}", "fields": fields} == snapshot


def test_deprecation_map(snapshot):
    assert [f"{k} -> {m}: {c}" for k, (m, c) in deprecations.FLAT_FIELDS.items()] == snapshot


def test_config_fields(snapshot):
    assert [f.name for f in dataclasses.fields(KVCacheConfig)] == snapshot


def test_top_level_all(snapshot):
    assert list(veloxquant_mlx.__all__) == snapshot


def test_registry_keys_and_status(snapshot):
    rows = [f"{k}: {m.options_class_name} {m.family} {m.status}" for k, m in METHODS.items()]
    assert rows == snapshot


def test_reference_contract_counts():
    # The reference page's 37 classes hold 200 fields; `full` is our baseline without options.
    # Families beyond the contract add their own classes and fields (TurboQuant: issue 35).
    contract = [n for n in options.__all__ if n not in BEYOND_CONTRACT]
    assert len(contract) == 37 and set(BEYOND_CONTRACT) <= set(options.__all__)
    assert sum(len(dataclasses.fields(getattr(options, n))) for n in contract) == 200
    beyond = sum(len(dataclasses.fields(getattr(options, n))) for n in BEYOND_CONTRACT)
    assert len(deprecations.FLAT_FIELDS) == 200 + beyond
    assert METHODS["full"].options_class is None


def test_docstrings_start_with_title_and_document_every_field():
    for name in options.__all__:
        cls = getattr(options, name)
        info = METHODS[next(k for k, m in METHODS.items() if m.options_class_name == name)]
        assert cls.__doc__.startswith(info.title)
        for f in dataclasses.fields(cls):
            assert f"\n    {f.name} : " in cls.__doc__, (name, f.name)
