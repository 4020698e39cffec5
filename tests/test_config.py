"""KVCacheConfig behaves as the reference page says, and rejects bad input clearly."""

import warnings

import pytest

import math

from veloxquant_mlx import (
    KVCacheConfig,
    UnimplementedMethodWarning,
    VeloxQuantDeprecationWarning,
    VeloxQuantWarning,
    make_prompt_cache,
    patch_model_kv_cache,
)
from veloxquant_mlx.cache.options import (
    H2OOptions,
    KIVIOptions,
    NestedKVOptions,
    QFiltersOptions,
    SnapKVOptions,
    StreamingLLMOptions,
    SVDqOptions,
)
from veloxquant_mlx.registry import METHODS


def test_options_populate_flat_fields_and_read_back():
    config = KVCacheConfig(method="h2o", options=H2OOptions(h2o_budget=1024))
    assert config.h2o_budget == 1024
    assert config.h2o_n_sink == 4
    assert config.options == H2OOptions(h2o_budget=1024)


def test_options_always_show_effective_values():
    config = KVCacheConfig(method="h2o", options=H2OOptions(h2o_budget=1024))
    with pytest.warns(VeloxQuantDeprecationWarning):
        config.h2o_n_sink = 8
    assert config.options == H2OOptions(h2o_budget=1024, h2o_n_sink=8)
    assert KVCacheConfig(method="kivi").options == KIVIOptions()
    assert KVCacheConfig().options is None  # `full` has no options


def test_flat_field_in_constructor_warns_at_the_callers_line():
    with pytest.warns(VeloxQuantDeprecationWarning) as record:
        config = KVCacheConfig(method="h2o", h2o_budget=2048)  # the line warned about
    assert config.h2o_budget == 2048
    (w,) = record.list
    assert w.filename == __file__
    assert "h2o_budget = 2048" not in str(w.message)
    assert "options=H2OOptions(h2o_budget=2048)" in str(w.message)
    assert issubclass(w.category, DeprecationWarning)


def test_flat_field_assignment_warns_at_the_callers_line():
    config = KVCacheConfig(method="h2o")
    with pytest.warns(VeloxQuantDeprecationWarning, match=r"options=H2OOptions\(h2o_budget=64\)") as record:
        config.h2o_budget = 64
    assert record.list[0].filename == __file__
    assert config.options.h2o_budget == 64


def test_explicit_flat_value_wins_over_options_default_only_fields_populated():
    with pytest.warns(VeloxQuantDeprecationWarning):
        config = KVCacheConfig(
            method="h2o", options=H2OOptions(h2o_budget=1024, h2o_n_sink=2), h2o_budget=300
        )
    assert config.h2o_budget == 300  # flat field was not at its default
    assert config.h2o_n_sink == 2  # flat field was at its default: options populate it


def test_no_warning_for_plain_use():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config = KVCacheConfig(method="snapkv", options=SnapKVOptions(snap_budget=256))
        config.options = SnapKVOptions(snap_budget=128)
        kivi = KVCacheConfig(method="kivi", kv_bits=4)  # snapkv reads no kv_bits: it would warn
        kivi.kv_bits = 2
    assert config.snap_budget == 128 and kivi.kv_bits == 2


def test_method_inferred_from_options():
    config = KVCacheConfig(options=KIVIOptions(kivi_group_size=64))
    assert config.method == "kivi" and config.kivi_group_size == 64


def test_unknown_method_did_you_mean():
    with pytest.raises(ValueError, match=r"method='snap_kv' is not a known method \(did you mean 'snapkv'\?\)"):
        KVCacheConfig(method="snap_kv")


def test_options_of_another_method_is_a_type_error():
    with pytest.raises(TypeError, match=r"options for method='h2o' must be H2OOptions, got KIVIOptions"):
        KVCacheConfig(method="h2o", options=KIVIOptions())
    config = KVCacheConfig(method="h2o")
    with pytest.raises(TypeError, match="must be H2OOptions"):
        config.options = SnapKVOptions()


@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: H2OOptions(h2o_budget=-1), r"h2o_budget=-1 is out of range; allowed: int, in \[1, inf\)"),
        (lambda: H2OOptions(h2o_budget="512"), r"h2o_budget='512' must be int, got str"),
        (lambda: H2OOptions(h2o_budget=True), r"h2o_budget=True must be int, got bool"),
        (lambda: KVCacheConfig(kv_bits=3.0), r"kv_bits=3.0 must be int, got float"),
        (lambda: KVCacheConfig(method="kivi", kv_bits=7), r"kv_bits=7 is out of range; allowed: int, one of 2, 4, 8"),
        (lambda: KIVIOptions(kivi_group_size=48), r"kivi_group_size=48 is out of range; allowed: int, one of 32, 64, 128"),
        (lambda: QFiltersOptions(qfilters_min_retention=1.5), r"qfilters_min_retention=1.5 is out of range; allowed: float \| None, None or in \[0, 1\]"),
        (lambda: QFiltersOptions(qfilters_on_low_retention="loud"), r"qfilters_on_low_retention='loud' must be Literal\['warn', 'raise', 'ignore'\]"),
        (lambda: SVDqOptions(svdq_bit_schedule=(8, -1)), r"svdq_bit_schedule=\(8, -1\) is out of range"),
        (lambda: SnapKVOptions(snap_budget=16), r"snap_budget must be at least snap_n_sink \+ snap_obs_window \+ 1.*snap_budget=16"),
        (lambda: KVCacheConfig(method="kivi", residual_window=100), r"residual_window must be a multiple of kivi_group_size.*residual_window=100, kivi_group_size=32"),
    ],
)
def test_bad_values_name_field_value_and_allowed(make, pattern):
    with pytest.raises(ValueError, match=pattern):
        make()


def test_bad_assignment_is_rejected_and_leaves_config_unchanged():
    config = KVCacheConfig(method="kivi")
    with pytest.raises(ValueError, match="kv_bits=1"):
        config.kv_bits = 1
    assert config.kv_bits == 2
    with pytest.raises(AttributeError, match=r"no field 'kv_bit' \(did you mean 'kv_bits'\?\)"):
        config.kv_bit = 4


@pytest.mark.filterwarnings("ignore::veloxquant_mlx.UnimplementedMethodWarning")
def test_to_dict_from_dict_round_trip():
    config = KVCacheConfig(method="snapkv", options=SnapKVOptions(snap_budget=300), kv_bits=4)
    data = config.to_dict()
    assert data["method"] == "snapkv" and data["options"]["snap_budget"] == 300
    assert data["kv_bits"] == 4
    assert KVCacheConfig.from_dict(data) == config
    assert KVCacheConfig.from_dict(KVCacheConfig().to_dict()) == KVCacheConfig()
    svdq = KVCacheConfig(method="svdq")
    assert KVCacheConfig.from_dict(svdq.to_dict()).svdq_bit_schedule == (8, 4, 2, 1, 1, 0, 0, 0)


def test_from_dict_accepts_legacy_flat_form_with_warning():
    with pytest.warns(VeloxQuantDeprecationWarning, match=r"options=H2OOptions\(h2o_budget=1024\)") as record:
        config = KVCacheConfig.from_dict({"method": "h2o", "h2o_budget": 1024})
    assert record.list[0].filename == __file__
    assert config.options == H2OOptions(h2o_budget=1024)


def test_from_dict_rejects_unknown_keys_with_suggestions():
    with pytest.raises(ValueError, match=r"unknown KVCacheConfig key 'h2o_budgett' \(did you mean 'h2o_budget'\?\)"):
        KVCacheConfig.from_dict({"method": "h2o", "h2o_budgett": 5})
    with pytest.raises(ValueError, match=r"'budget' is not a field of H2OOptions \(did you mean 'h2o_budget'\?\)"):
        KVCacheConfig.from_dict({"method": "h2o", "options": {"budget": 5}})


def test_flat_field_of_another_method_warns_that_it_has_no_effect():
    with pytest.warns(VeloxQuantDeprecationWarning, match="so it has no effect"):
        KVCacheConfig(method="kivi", h2o_budget=64)


# -- issue 25 item 4: values that cannot be represented are refused at construction ----
@pytest.mark.parametrize(
    "make, pattern",
    [
        (lambda: SnapKVOptions(snap_budget=10**30), r"snap_budget=10{30} is out of range; allowed: int, in \[1, inf\), at most 2\*\*31 - 1"),
        (lambda: StreamingLLMOptions(stream_window_size=2**31), r"stream_window_size=2147483648 is out of range.*at most 2\*\*31 - 1"),
        (lambda: H2OOptions(h2o_budget=10**30), r"h2o_budget=.* is out of range"),
        (lambda: KVCacheConfig(method="kivi", residual_window=2**40), r"residual_window=1099511627776 is out of range"),
        (lambda: SVDqOptions(svdq_bit_schedule=(8, 2**31)), r"svdq_bit_schedule=\(8, 2147483648\) is out of range"),
        (lambda: NestedKVOptions(nestedkv_beta=math.inf), r"nestedkv_beta=inf is out of range; allowed: float, in \[0, inf\)"),
        (lambda: NestedKVOptions(nestedkv_beta=-math.inf), r"nestedkv_beta=-inf is out of range"),
        (lambda: NestedKVOptions(nestedkv_beta=math.nan), r"nestedkv_beta=nan is NaN, which no range admits; allowed: float, in \[0, inf\)"),
        (lambda: QFiltersOptions(qfilters_min_retention=math.nan), r"qfilters_min_retention=nan is NaN"),
    ],
)
def test_unrepresentable_values_are_refused(make, pattern):
    with pytest.raises(ValueError, match=pattern) as info:
        make()
    assert "must be float, got float" not in str(info.value)


def test_the_int_cap_itself_and_large_finite_floats_are_accepted():
    assert StreamingLLMOptions(stream_window_size=2**31 - 1).stream_window_size == 2**31 - 1
    assert NestedKVOptions(nestedkv_beta=1e300).nestedkv_beta == 1e300


@pytest.mark.parametrize("data", [None, "kivi", 3, ["method", "kivi"]])
def test_from_dict_of_a_non_dict_says_what_is_expected(data):
    with pytest.raises(TypeError, match=r"expects a dict with 'method' and 'options' \(e\.g\. \{'method': 'kivi'"):
        KVCacheConfig.from_dict(data)


# -- issue 17 item 1: a method without an implementation -------------------------------
def test_config_of_an_unimplemented_method_warns_but_stays_a_config(unimplemented):
    with pytest.warns(UnimplementedMethodWarning, match=rf"method '{unimplemented}' has no implementation yet.*implemented: full, ") as record:
        config = KVCacheConfig(method=unimplemented)
    assert record.list[0].filename == __file__  # points at the caller
    assert issubclass(UnimplementedMethodWarning, VeloxQuantWarning) and issubclass(VeloxQuantWarning, UserWarning)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KVCacheConfig(method="snapkv")  # an implemented one is quiet
        with pytest.raises(UnimplementedMethodWarning):
            KVCacheConfig.from_dict(config.to_dict())


def test_building_caches_for_an_unimplemented_method_is_a_clear_error(unimplemented):
    from tiny_models import tiny_model

    with pytest.warns(UnimplementedMethodWarning):
        config = KVCacheConfig(method=unimplemented)
    model = tiny_model()
    title = METHODS[unimplemented].title.rstrip(".")
    for build in (make_prompt_cache, patch_model_kv_cache):
        with pytest.raises(NotImplementedError) as info:
            build(model, config)
        message = str(info.value)
        assert message.startswith(f"method '{unimplemented}' ({title}) has no implementation yet")
        assert ".)" not in message and "implemented methods: full, " in message


# -- issue 17 item 6: an unknown options key lists every field the method reads ---------
def test_unknown_options_key_lists_options_and_config_fields_the_method_reads():
    with pytest.raises(ValueError) as info:
        KVCacheConfig.from_dict({"method": "kivi", "options": {"snap_budget": 100}})
    assert str(info.value) == (
        "'snap_budget' is not a field of KIVIOptions; kivi reads kivi_group_size (KIVIOptions); "
        "kv_bits, residual_window, fused_attention (config fields)"
    )
    with pytest.raises(ValueError, match=r"'kv_bits' is one of KVCacheConfig's own fields, not a field of KIVIOptions"):
        KVCacheConfig.from_dict({"method": "kivi", "options": {"kv_bits": 4}})


def test_an_array_field_keeps_the_config_comparable_serialisable_and_read_by_the_cache(tmp_path):
    """a2ats's calibrated codebook and query metric are ``Any`` fields that take arrays:
    ``==`` on an array is elementwise (and raises against None), and JSON has no arrays, so
    the config keeps them as nested tuples; a saved prompt cache's config reads back equal,
    and the cache codes with the given codebook."""
    import json

    import mlx.core as mx
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    from tiny_models import prompt, tiny_model
    from veloxquant_mlx import make_prompt_cache
    from veloxquant_mlx.cache.options import A2ATSOptions

    codebook, metric = mx.random.normal((256, 4), key=mx.random.key(3)), 2 * mx.eye(4)
    config = KVCacheConfig(method="a2ats", options=A2ATSOptions(a2ats_codebook=codebook, a2ats_query_h=metric,
                                                                a2ats_sub_dim=4, a2ats_window=8))
    assert config == KVCacheConfig(method="a2ats", options=A2ATSOptions(
        a2ats_codebook=codebook, a2ats_query_h=metric, a2ats_sub_dim=4, a2ats_window=8))
    assert KVCacheConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert mx.array_equal(mx.array(config.options.a2ats_codebook), codebook)
    model = tiny_model("llama")
    cache = make_prompt_cache(model, config)
    model(prompt(40)[None], cache=cache)
    for t in prompt(8):
        model(t.reshape(1, 1), cache=cache)
    path = str(tmp_path / "a2ats.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert loaded[0].config == config
