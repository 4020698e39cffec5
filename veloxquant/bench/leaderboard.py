"""``veloxquant bench --leaderboard``: RULER-style scores of each method at fixed
compression ratios of KV bytes, in the shape of kvpress's leaderboard.

A compression ratio is the fraction of the full cache's bytes a method removes, as
kvpress counts it (0.75: a quarter of the bytes kept). Each method reaches a ratio
through its main knob (the first field its spec sweeps, else its ``*_budget`` field):
the setting chosen is the one whose measured ``nbytes`` after prefilling a prompt of the
leaderboard's length (rounded down to whole steps of 256 rows, the full cache's
allocation unit) is nearest the target, found by bisection on the measurements
(never by a bytes formula: sinks, windows, group scales and codebooks all count). The
ratio each row reached is stated beside the one it aimed at.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .._generated.deprecations import CONFIG_FIELD_USERS
from .._generated.validators import RULES
from ..registry import METHODS
from .ruler import make_ruler_examples, ruler_score

RATIOS = (0.25, 0.5, 0.75, 0.875)
#: a measured setting within this fraction of the full cache's bytes of its target ends
#: the search early
TOLERANCE = 0.005
FLOAT_STEPS = 10
FULL_STEP = 256  # the full cache grows in steps of 256 rows, as mlx-lm's KVCache does


def main_field(method: str) -> str | None:
    """The knob that sets a method's bytes: its first swept field, else its budget."""
    info = METHODS[method]
    if info.sweeps:
        return info.sweeps[0][0]
    return next((f for f in info.fields if f.endswith("_budget")), None)


def byte_fields(method: str) -> list[str]:
    """The fields a ratio is searched through, in turn: the main field, then the method's
    other swept fields (spectral's effective dimension leaves its bytes unchanged; its
    ``kv_bits``, swept after it, sets them)."""
    first = main_field(method)
    rest = [name for name, _ in METHODS[method].sweeps if name != first]
    return [] if first is None else [first, *rest]


def config_for(key: str, setting: dict):
    """The config of ``key`` (a method, or METHOD+kiviBITS) with ``setting`` applied."""
    from ..cache.config import KVCacheConfig
    from ..cli_common import build_config
    from .cli import composed

    method, bits = composed(key)
    top = {k: v for k, v in setting.items() if k in CONFIG_FIELD_USERS}
    options = {k: v for k, v in setting.items() if k not in top}
    config = build_config(method, top, options)
    if bits is not None:
        config = KVCacheConfig.from_dict({**config.to_dict(), "kv_bits": bits,
                                          "storage": {"method": "kivi", "options": {}}})
    return config


#: a main field whose settings all hold bytes within this fraction of the full cache's of
#: one another trades something else, not bytes
FLAT = 0.05


def bytes_do_not_move(measured: dict, full: float) -> bool:
    """Every setting measured holds about the same bytes: the main field trades something
    else (a2ats's retrieval fraction trades attention reads; its buffers differ by an
    allocation step) and no ratio can be aimed at through it."""
    ok = [b for b in measured.values() if b is not None]
    return len(ok) >= 2 and max(ok) - min(ok) <= FLAT * full


def _nearest(measured: dict, target: float):
    ok = [(v, b) for v, b in measured.items() if b is not None]
    return min(ok, key=lambda vb: (abs(vb[1] - target), vb[0])) if ok else None


def search(measure: Callable[[Any], float | None], field_name: str, target: float,
           full: float, context: int, measured: dict, inside=()) -> tuple[Any, float] | None:
    """(value, bytes) of ``field_name`` whose measured bytes are nearest ``target``.

    ``measure(value)`` gives the bytes at that value (None where the value is refused);
    ``measured`` keeps every measurement, so a second target reuses the first's. Bytes
    are taken to move one way with the value, up or down: the ends say which. ``inside``:
    values that may run where the field's own range ends do not (another field bounds it:
    adakv's average bits lie between its lowest and highest widths)."""
    rule = RULES[field_name]
    close = lambda b: b is not None and abs(b - target) <= TOLERANCE * full  # noqa: E731

    def at(v):
        if v not in measured:
            measured[v] = measure(v)
        return measured[v]

    if rule.choices is not None:
        for v in rule.choices:
            at(v)
        return _nearest(measured, target)
    if rule.base not in ("int", "float"):
        return None
    is_int = rule.base == "int"
    lo = rule.low if rule.low is not None else (1 if is_int else 0.0)
    # a token budget past the prompt's length keeps everything: no need to look further
    hi = rule.high if rule.high is not None and rule.high < 1e6 else None
    if is_int:
        lo, hi = int(lo), int(min(hi if hi is not None else context, context))
    else:
        hi = hi if hi is not None else lo + 64.0
        nudge = 1e-3 * (hi - lo)
        lo, hi = lo + (0 if rule.low_closed else nudge), hi - (0 if rule.high_closed else nudge)
    b_lo, b_hi = at(lo), at(hi)
    if b_hi is None:
        # the top is refused (another field bounds this one): from a value that runs, the
        # largest that does
        good = next((v for v in inside if lo <= v <= hi and at(v) is not None), None)
        if good is None:
            return _nearest(measured, target)
        hi = _last_accepted(at, good, hi, is_int)
        b_hi = at(hi)
    if b_lo is None:
        # the smallest values are refused where they leave no room for the method's own
        # sinks and windows (snap_budget > n_sink + obs_window): start from the least
        # accepted one
        lo = _last_accepted(at, hi, lo, is_int)
        b_lo = at(lo)
    rising = b_hi >= b_lo
    steps = 0
    while (hi - lo > 1 if is_int else steps < FLOAT_STEPS):
        steps += 1
        mid = (lo + hi) // 2 if is_int else (lo + hi) / 2
        if is_int and steps % 2:
            # a budget's bytes are close to linear in it: every other step reads the value
            # off the line through the bracket's ends (each measurement is a prefill of
            # the whole prompt), the steps between halve the bracket whatever the shape
            guess = _interpolated(lo, hi, measured.get(lo), measured.get(hi), target)
            mid = mid if guess is None else min(max(guess, lo + 1), hi - 1)
        b = at(mid)
        if close(b):
            break
        if b is None or (b < target) == rising:
            lo = mid
        else:
            hi = mid
    return _nearest(measured, target)


def _last_accepted(at, good, bad, is_int: bool):
    """The accepted value nearest ``bad`` (refused) on the way from ``good`` (accepted),
    by bisection: refusals are validation, cheap."""
    for _ in range(64 if is_int else FLOAT_STEPS):
        if is_int and abs(good - bad) <= 1:
            break
        mid = (bad + good) // 2 if is_int else (bad + good) / 2
        if at(mid) is None:
            bad = mid
        else:
            good = mid
    return good


def _interpolated(lo: int, hi: int, b_lo, b_hi, target: float) -> int | None:
    """The integer where the line through (lo, b_lo) and (hi, b_hi) meets ``target``."""
    if b_lo is None or b_hi is None or b_lo == b_hi:
        return None
    return round(lo + (target - b_lo) / (b_hi - b_lo) * (hi - lo))


@dataclass
class Row:
    method: str
    target: float | None  # the compression ratio aimed at (None: the full cache)
    ratio: float  # the one reached: 1 - bytes / full bytes
    field: str | None
    value: Any
    bytes_per_token: float
    scores: dict = field(default_factory=dict)  # task -> percent
    average: float | None = None
    status: str = "ok"
    error: str | None = None


def score_examples(model, tokenizer, config, examples, tick=lambda: None, question_after: bool = False) -> dict:
    """Percent per task (RULER's score of each output, averaged) and the outputs;
    ``question_after``: kvpress's protocol (``harness.answer_question_after``)."""
    from .harness import MethodRun, answer, answer_question_after

    run = MethodRun("leaderboard", config)
    per_task: dict[str, list[float]] = {}
    outputs = []
    eos = getattr(tokenizer, "eos_token", None)
    for ex in examples:
        out = (answer_question_after if question_after else answer)(model, tokenizer, run, ex)
        if eos:  # what follows the model's end of text is no part of its answer
            out = out.split(eos, 1)[0]
        s = ruler_score(ex, out)
        per_task.setdefault(ex.task, []).append(s)
        outputs.append({"task": ex.task, "index": ex.index, "score": s, "output": out})
        tick()
    return {"scores": {t: 100.0 * sum(v) / len(v) for t, v in per_task.items()},
            "outputs": outputs}


def prefill_bytes(model, tokenizer, config, tokens) -> int:
    import mlx.core as mx

    from ..integrations.mlx_lm import make_prompt_cache
    from .runner import prefill

    cache = make_prompt_cache(model, config)
    prefill(model, cache, mx.array(tokens), tokenizer=tokenizer)
    return sum(c.nbytes for c in cache)


def make_examples(tokenizer, tasks, examples_per_task: int, context: int, seed: int) -> list:
    """The examples every method answers, sized in the model's tokens (a ValueError where
    a task does not fit ``context``)."""
    count = lambda s: len(tokenizer.encode(s))  # noqa: E731
    return [ex for t in tasks for ex in make_ruler_examples(t, examples_per_task, context,
                                                            seed, count)]


def run_leaderboard(model, tokenizer, methods: list[str], ratios, tasks, examples: list,
                    context: int, seed: int, progress=None, on_row=lambda rows: None,
                    score_full: bool = True, on_full=lambda full_bytes, tokens: None,
                    question_after: bool = False) -> dict:
    """Every method at every ratio; ``on_row`` gets the rows so far after each one.
    ``score_full=False``: the full cache's bytes are measured (every ratio is a fraction
    of them) but its examples are not answered; a part of a ``--jobs`` run, whose
    baseline another part scores. ``question_after``: each example answered by kvpress's
    protocol (the context compressed alone, then the question read with eviction
    stopped); the bytes are measured as without it, over a context of the leaderboard's
    length."""
    from .tasks import load_default_filler

    text = tokenizer.encode(load_default_filler())
    # the prompt the bytes are measured on: a whole number of the full cache's allocation
    # steps, as its nbytes counts capacity, and a partly filled step would make every
    # method look smaller beside it
    length = max(FULL_STEP, context // FULL_STEP * FULL_STEP)
    start = (seed * 7919) % max(1, len(text) - length)
    probe = text[start:start + length]
    full_config = config_for("full", {})
    full_bytes = prefill_bytes(model, tokenizer, full_config, probe)
    on_full(full_bytes, len(probe))  # a partial save then says what its ratios are of
    tick = progress.tick if progress else (lambda: None)
    rows: list[Row] = []
    scored: dict = {}

    def scored_run(key, setting, config):
        """``setting``: the value of the method's main field, or "FIELD=VALUE" of another
        (spectral's d_eff and kv_bits may share a value), None at the defaults."""
        if (key, setting) not in scored:
            scored[(key, setting)] = score_examples(model, tokenizer, config, examples, tick, question_after)
        return scored[(key, setting)]

    def add(row: Row, result: dict | None):
        if result is not None:
            row.scores = {t: result["scores"].get(t) for t in tasks}
            row.average = sum(row.scores.values()) / len(row.scores)
        rows.append(row)
        if progress:
            progress.finish({"label": label, "status": row.status, "error": row.error})
        on_row(rows)

    label = "full"
    if progress:
        progress.start(label)
    add(Row("full", None, 0.0, None, None, full_bytes / len(probe),
            status="ok" if score_full else "not scored"),
        scored_run("full", None, full_config) if score_full else None)
    for key in (m for m in methods if m != "full"):
        fields = byte_fields(key.partition("+")[0])
        sweeps = dict(METHODS[key.partition("+")[0]].sweeps)
        measured: dict = {name: {} for name in fields}  # per field: value -> bytes

        @functools.cache  # the method's bytes at its defaults: one prefill, whatever the ratios
        def default_bytes(key=key):
            return prefill_bytes(model, tokenizer, config_for(key, {}), probe)

        def measure(value, name, key=key):
            try:
                return prefill_bytes(model, tokenizer, config_for(key, {name: value}), probe)
            except Exception:  # noqa: BLE001 - a value the method refuses is not a candidate
                return None

        for target in ratios:
            label = f"{key} at ratio {target}"
            if progress:
                progress.start(label)
            name = fields[0] if fields else None
            try:
                ran = False  # some value of some field runs
                for candidate in fields:
                    found = search(functools.partial(measure, name=candidate), candidate,
                                   (1 - target) * full_bytes, full_bytes, context,
                                   measured[candidate], sweeps.get(candidate, ()))
                    ran = ran or found is not None
                    if found is not None and not bytes_do_not_move(measured[candidate], full_bytes):
                        (value, nbytes), name = found, candidate
                        break
                else:
                    if fields and not ran:
                        raise ValueError(f"no value of {fields[0]} runs")
                    # every field's settings hold about the same bytes: the nearest of equal
                    # bytes would be a field's lowest value, an arbitrary pick that may
                    # cripple the method: its defaults
                    value, nbytes = None, default_bytes()
                config = config_for(key, {} if value is None else {name: value})
                row = Row(key, target, 1 - nbytes / full_bytes, name, value, nbytes / len(probe))
                setting = value if value is None or name == fields[0] else f"{name}={value}"
                add(row, scored_run(key, setting, config))
            except Exception as exc:  # noqa: BLE001 - recorded in the table, the run goes on
                add(Row(key, target, math.nan, name, None, math.nan, status="failed",
                        error=f"{type(exc).__name__}: {exc}"), None)
    return {"rows": rows, "full_bytes": full_bytes, "probe_tokens": len(probe),
            "examples": len(examples), "outputs": {f"{k}|{v}": r["outputs"]
                                                   for (k, v), r in scored.items()}}


#: what every part of one leaderboard must share for its rows to stand in one table
SHARED = ("context", "tasks", "examples_per_task", "full_bytes", "probe_tokens", "seed", "question_after")


def merge(parts: list[dict]) -> tuple[dict, list[Row]]:
    """One leaderboard from parts that ran methods in separate processes (``--jobs``):
    the baseline row from the part that scored it, then each part's method rows in the
    parts' order. A ValueError names a part whose prompts or full cache differ."""
    if not parts:
        raise ValueError("no parts to merge")
    first = parts[0]
    for part in parts[1:]:
        for key in SHARED:
            if part.get(key) != first.get(key):
                raise ValueError(f"part {part.get('command')!r}: {key} is {part.get(key)!r}, "
                                 f"the first part's is {first.get(key)!r}")
    rows = [Row(**r) for part in parts for r in part["rows"]]
    full = [r for r in rows if r.method == "full" and r.status == "ok"]
    if not full:
        raise ValueError("no part scored the full cache (run one with --methods full)")
    merged = {k: v for k, v in first.items() if k not in ("rows", "outputs", "command")}
    merged["outputs"] = {k: v for part in parts for k, v in part.get("outputs", {}).items()}
    merged["partial"] = any(part.get("partial") for part in parts)
    return merged, [full[0]] + [r for r in rows if r.method != "full"]


def _pct(x) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1f}"


def markdown(rows: list[Row], tasks, title: str, command: str | None = None) -> str:
    head = ["method", "target ratio", "ratio", "setting", "bytes/tok", *tasks, "average"]
    lines = [f"# {title}", ""]
    if command:
        lines += ["```sh", command, "```", ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        setting = ("-" if r.field is None
                   else f"defaults ({r.field} does not change bytes)"
                   if r.value is None and r.status == "ok"
                   else f"{r.field}={r.value:g}" if isinstance(r.value, float)
                   else f"{r.field}={r.value}")
        cells = [r.method, "-" if r.target is None else f"{r.target:g}",
                 "-" if math.isnan(r.ratio) else f"{r.ratio:.3f}", setting,
                 _pct(r.bytes_per_token), *(_pct(r.scores.get(t)) for t in tasks),
                 _pct(r.average) if r.status == "ok" else r.status if r.error is None
                 else f"failed: {r.error}"]
        lines.append("| " + " | ".join(cells) + " |")
    targets = sorted({r.target for r in rows if r.target is not None})
    lines += ["", "Average score by target ratio (the ratio reached in brackets), as kvpress "
              "lays out its leaderboard:", "",
              "| method | " + " | ".join(f"{t:g}" for t in targets) + " |",
              "|" + "---|" * (len(targets) + 1)]
    full = next((r for r in rows if r.method == "full"), None)
    if full is not None:
        lines.append(f"| full | {' | '.join([_pct(full.average)] * len(targets))} |")
    for m in dict.fromkeys(r.method for r in rows if r.method != "full"):
        cells = []
        for t in targets:
            r = next((r for r in rows if r.method == m and r.target == t), None)
            cells.append("-" if r is None or r.status != "ok"
                         else f"{_pct(r.average)} ({r.ratio:.3f})")
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    lines += ["", "ratio: the compression ratio reached, 1 - (KV bytes after prefilling a "
              "prompt of the leaderboard's length, in whole 256-token steps) / (the full cache's); target ratio: the one "
              "aimed at; setting: the value that came nearest of the method's main field, or of "
              "its next swept field where the main one leaves the bytes unchanged (its defaults "
              "where none moves them); "
              "task columns and average: RULER scores in percent (all references found, "
              "or for qa any)."]
    return "\n".join(lines) + "\n"


def plot(path: Path, rows: list[Row], title: str) -> None:
    """Average score against compression ratio, one line per method, the full cache as a
    dashed line across (kvpress's leaderboard plot)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    full = next((r for r in rows if r.method == "full" and r.average is not None), None)
    if full is not None:
        ax.axhline(full.average, color="black", linestyle="--", linewidth=1,
                   label=f"full (no compression): {full.average:.1f}")
    methods = list(dict.fromkeys(r.method for r in rows if r.method != "full"))
    for m in methods:
        pts = sorted((r.ratio, r.average) for r in rows
                     if r.method == m and r.status == "ok" and r.average is not None)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=m)
    ax.set_xlabel("compression ratio (fraction of KV bytes removed)")
    ax.set_ylabel("average score (RULER-style tasks, %)")
    ax.set_xlim(0, 1)
    ax.set_ylim(-2, 102)
    ax.grid(alpha=0.3)
    ax.set_title(title, fontsize=9)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def write(out: Path, payload: dict, rows: list[Row], tasks, title: str, command: str) -> None:
    data = {**payload, "rows": [r.__dict__ for r in rows]}
    (out / "leaderboard.json").write_text(json.dumps(data, indent=1, default=str) + "\n")
    (out / "leaderboard.md").write_text(markdown(rows, tasks, title, command))
