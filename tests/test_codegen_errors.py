"""Every class of spec error is caught, located (file:line:col) and explained, all at once."""

import textwrap

import pytest

from codegen.__main__ import main
from codegen.parse import SpecError, load_spec

VALID = """\
config:
  fields:
    - name: kv_bits
      type: int
      default: 2
      doc: "Bits."
      choices: [2, 4, 8]
methods:
  - key: full
    title: "Full cache."
    family: baseline
    status: faithful
  - key: foo
    class: FooOptions
    title: "Foo configuration."
    family: eviction
    status: adapted
    checks:
      - expr: "foo_budget >= foo_n_sink"
        message: "foo_budget must cover the sinks."
    fields:
      - name: foo_budget
        type: int
        default: 512
        doc: "Tokens kept."
        range: "[1, inf)"
      - name: foo_n_sink
        type: int
        default: 4
        doc: "Sink tokens."
        range: "[0, inf)"
      - name: foo_mode
        type: "Literal['a', 'b']"
        default: a
        doc: "Mode."
      - name: foo_frac
        type: float | None
        default: 0.5
        doc: "A fraction."
        range: "[0, 1]"
"""


def errors_for(tmp_path, text):
    path = tmp_path / "methods.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as info:
        load_spec(path, "spec/methods.yaml")
    return info.value.messages


def test_valid_spec_parses(tmp_path):
    path = tmp_path / "methods.yaml"
    path.write_text(VALID)
    spec = load_spec(path, "spec/methods.yaml")
    assert [m.key for m in spec.methods] == ["full", "foo"]
    assert [f.type.annotation for f in spec.methods[1].fields] == [
        "int",
        "int",
        "Literal['a', 'b']",
        "float | None",
    ]


@pytest.mark.parametrize(
    "old, new, expected",
    [
        (  # YAML syntax error
            'choices: [2, 4, 8]',
            'choices: [2, 4, 8',
            "spec/methods.yaml:8:8: YAML syntax error: while parsing a flow sequence",
        ),
        (  # unknown key, with a suggestion
            "        default: 512\n",
            "        defualt: 512\n",
            "spec/methods.yaml:24:9: methods[1].fields[0].defualt: unknown key 'defualt' "
            "(did you mean 'default'?)",
        ),
        (  # missing key
            '        doc: "Sink tokens."\n',
            "",
            "spec/methods.yaml:27:9: methods[1].fields[1]: missing key 'doc'",
        ),
        (  # unknown type
            "        type: int\n        default: 512",
            "        type: flaot\n        default: 512",
            "spec/methods.yaml:23:15: methods[1].fields[0].type: unknown type 'flaot' "
            "(did you mean 'float'?)",
        ),
        (  # default of the wrong type
            "default: 512",
            "default: lots",
            "spec/methods.yaml:24:18: methods[1].fields[0].default: default 'lots' is not a valid int",
        ),
        (  # default outside its range
            "default: 0.5",
            "default: 1.5",
            "spec/methods.yaml:38:18: methods[1].fields[3].default: default 1.5 is outside the range [0, 1]",
        ),
        (  # Literal default not among its choices
            "default: a\n",
            "default: c\n",
            "spec/methods.yaml:34:18: methods[1].fields[2].default: default 'c' is not among "
            "the Literal's choices ('a', 'b')",
        ),
        (  # choices default not among choices
            "default: 2\n",
            "default: 3\n",
            "spec/methods.yaml:5:16: config.fields[0].default: default 3 is not among the choices (2, 4, 8)",
        ),
        (  # a name that is not a Python identifier
            "name: foo_n_sink",
            "name: foo-n-sink",
            "spec/methods.yaml:27:15: methods[1].fields[1].name: field name 'foo-n-sink' is not a Python identifier",
        ),
        (  # a keyword is not a usable name either
            "class: FooOptions",
            "class: lambda",
            "spec/methods.yaml:14:12: methods[1].class: class name 'lambda' is not a Python identifier",
        ),
        (  # collision with the config's own fields
            "name: foo_frac",
            "name: kv_bits",
            "spec/methods.yaml:36:9: foo.fields.kv_bits: field name 'kv_bits' collides with "
            "the config's own fields",
        ),
        (  # collision with a built-in config attribute
            "name: foo_frac",
            "name: options",
            "field name 'options' collides with the config's own fields",
        ),
        (  # duplicate field within a method
            "name: foo_frac",
            "name: foo_budget",
            "spec/methods.yaml:36:9: foo.fields.foo_budget: duplicate field 'foo_budget' (defined at spec/methods.yaml:22:9)",
        ),
        (  # bad range syntax
            'range: "[0, 1]"',
            'range: "0 to 1"',
            "spec/methods.yaml:40:16: methods[1].fields[3].range: bad interval '0 to 1'",
        ),
        (  # unknown family
            "family: eviction",
            "family: evicton",
            "spec/methods.yaml:16:13: methods[1].family: unknown family 'evicton' (did you mean 'eviction'?)",
        ),
        (  # a check over an unknown name
            'expr: "foo_budget >= foo_n_sink"',
            'expr: "foo_budget >= foo_nsink"',
            "spec/methods.yaml:19:15: methods[1].checks[0].expr: unknown name 'foo_nsink' "
            "(did you mean 'foo_n_sink'?)",
        ),
        (  # a check the defaults violate
            'expr: "foo_budget >= foo_n_sink"',
            'expr: "foo_budget < foo_n_sink"',
            "is False for the defaults: foo_budget must cover the sinks.",
        ),
    ],
)
def test_error_is_located_and_explained(tmp_path, old, new, expected):
    assert old in VALID
    messages = errors_for(tmp_path, VALID.replace(old, new, 1))
    assert any(expected in m for m in messages), messages


def test_duplicate_method_key_and_class(tmp_path):
    dup = textwrap.indent(VALID.split("methods:\n", 1)[1].split("  - key: foo\n", 1)[1], "")
    text = VALID + "  - key: foo\n" + dup
    messages = errors_for(tmp_path, text)
    assert any("duplicate method key 'foo' (first defined at spec/methods.yaml:13:5)" in m for m in messages)
    assert any("duplicate class 'FooOptions'" in m for m in messages)
    assert any("field name 'foo_budget' collides with method 'foo'" in m for m in messages) or any(
        "duplicate field 'foo_budget'" in m for m in messages
    )


def test_field_collides_with_another_methods_field(tmp_path):
    text = VALID + textwrap.dedent(
        """\
          - key: bar
            class: BarOptions
            title: "Bar."
            family: eviction
            status: adapted
            fields:
              - name: foo_budget
                type: int
                default: 1
                doc: "x"
        """
    ).replace("\n", "\n  ").rstrip(" ").replace("- key: bar", "  - key: bar", 1)
    messages = errors_for(tmp_path, text)
    assert any(
        "bar.fields.foo_budget: field name 'foo_budget' collides with method 'foo' "
        "(defined at spec/methods.yaml:22:9)" in m
        for m in messages
    ), messages


def test_all_errors_reported_at_once_and_nothing_written(tmp_path, capsys):
    bad = (
        VALID.replace("type: int\n        default: 512", "type: flaot\n        default: 512")
        .replace("default: 0.5", "default: 1.5")
        .replace("family: eviction", "family: evicton")
    )
    spec = tmp_path / "methods.yaml"
    spec.write_text(bad)
    out = tmp_path / "out"
    assert main(["--spec", str(spec), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown type 'flaot'" in err and "outside the range" in err and "evicton" in err
    assert "3 errors in the spec; nothing written." in err
    assert not out.exists()


# -- sweep: and the bounds of int and float fields ------------------------------------
@pytest.mark.parametrize(
    "old, new, expected",
    [
        (  # a sweep value of the wrong type, and one outside the choices: each at its column
            "      choices: [2, 4, 8]\n",
            '      choices: [2, 4, 8]\n      sweep: [2, "x", 3]\n',
            [
                "spec/methods.yaml:8:18: config.fields[0].sweep[1]: sweep value 'x' is not a valid int",
                "spec/methods.yaml:8:23: config.fields[0].sweep[2]: sweep value 3 is not among the choices (2, 4, 8)",
            ],
        ),
        (  # out of range, past the int cap, repeated
            '        range: "[1, inf)"\n',
            '        range: "[1, inf)"\n        sweep: [8, 0, 4294967296, 8]\n',
            [
                "spec/methods.yaml:27:20: methods[1].fields[0].sweep[1]: sweep value 0 is outside the range [1, inf)",
                "spec/methods.yaml:27:23: methods[1].fields[0].sweep[2]: sweep value 4294967296 is beyond "
                "the int limit (at most 2**31 - 1)",
                "spec/methods.yaml:27:35: methods[1].fields[0].sweep[3]: sweep value 8 repeats an earlier value",
            ],
        ),
        (  # block style: the item's own line
            '        range: "[1, inf)"\n',
            '        range: "[1, inf)"\n        sweep:\n          - 64\n          - -1\n',
            ["spec/methods.yaml:29:13: methods[1].fields[0].sweep[1]: sweep value -1 is outside the range [1, inf)"],
        ),
        (  # not a list
            '        range: "[1, inf)"\n',
            '        range: "[1, inf)"\n        sweep: 5\n',
            ["spec/methods.yaml:27:16: methods[1].fields[0].sweep: expected a non-empty list of values, got int"],
        ),
        (  # a value that breaks the method's checks with the other fields at their defaults
            '        range: "[1, inf)"\n',
            '        range: "[1, inf)"\n        sweep: [2]\n',
            ["spec/methods.yaml:27:17: foo.fields.foo_budget.sweep[0]: sweep value 2 breaks a check of "
             "method 'foo' (its other fields at their defaults): foo_budget must cover the sinks."],
        ),
        (  # a config field's sweep is checked against the methods that read it
            "      choices: [2, 4, 8]\n",
            "      choices: [2, 4, 8]\n      used_by: [foo]\n      sweep: [2, 8]\n",
            None,
        ),
        (  # an int range cannot include an infinity
            '        range: "[1, inf)"\n',
            '        range: "[1, inf]"\n',
            ['spec/methods.yaml:26:16: methods[1].fields[0].range: [1, inf]: only a float range may '
             'include an infinity; write the bound open, e.g. "[1, inf)"'],
        ),
        (  # NaN is no float value a range admits
            "        default: 0.5\n",
            "        default: .nan\n",
            ["spec/methods.yaml:38:18: methods[1].fields[3].default: default nan is NaN, which no range admits"],
        ),
        (  # an int default past the cap of ints whose range is open above
            "        default: 4\n",
            "        default: 4294967296\n",
            ["spec/methods.yaml:29:18: methods[1].fields[1].default: default 4294967296 is beyond the int "
             "limit (at most 2**31 - 1)"],
        ),
    ],
)
def test_sweep_and_bounds_errors_are_located(tmp_path, old, new, expected):
    assert old in VALID
    text = VALID.replace(old, new, 1)
    if expected is None:  # kv_bits=2 and 8 pass foo's checks: make one fail
        text = text.replace('expr: "foo_budget >= foo_n_sink"', 'expr: "foo_budget >= foo_n_sink and kv_bits < 8"')
        expected = ["spec/methods.yaml:9:18: config.fields.kv_bits.sweep[1]: sweep value 8 breaks a check of "
                    "method 'foo' (its other fields at their defaults): foo_budget must cover the sinks."]
    messages = errors_for(tmp_path, text)
    assert messages == expected


def test_sweeps_reach_the_registry_and_floats_may_include_inf(tmp_path):
    from codegen.render import render_all

    text = (
        VALID.replace("      choices: [2, 4, 8]\n", "      choices: [2, 4, 8]\n      used_by: [foo]\n      sweep: [4, 8]\n", 1)
        .replace('        range: "[1, inf)"\n', '        range: "[1, inf)"\n        sweep: [64, 128]\n', 1)
        .replace('range: "[0, 1]"', 'range: "[0, inf]"')
    )
    path = tmp_path / "methods.yaml"
    path.write_text(text)
    spec = load_spec(path, "spec/methods.yaml")
    foo = spec.methods[1]
    assert foo.fields[0].sweep == (64, 128) and spec.config_fields[0].sweep == (4, 8)
    rendered = render_all(spec, names=("validators.py", "registry.py"))  # API.md needs snapkv
    namespace: dict = {}
    exec(compile(rendered["validators.py"], "validators.py", "exec"), namespace)  # noqa: S102
    assert namespace["field_problem"]("foo_frac", float("inf")) is None  # "[0, inf]" admits it
    assert namespace["field_problem"]("foo_budget", 2**31) == "is out of range"
    assert namespace["field_problem"]("foo_frac", float("nan")) == "is NaN, which no range admits"
    registry: dict = {"__name__": "registry"}
    exec(compile(rendered["registry.py"], "registry.py", "exec"), registry)  # noqa: S102
    # The method's own sweeps first, then the config field's (its used_by names foo).
    assert registry["METHODS"]["foo"].sweeps == (("foo_budget", (64, 128)), ("kv_bits", (4, 8)))
    assert registry["METHODS"]["full"].sweeps == ()
