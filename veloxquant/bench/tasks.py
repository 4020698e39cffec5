"""Synthetic long-context retrieval tasks in the style of RULER.

Each task hides one or more facts at chosen depths of a long prompt and asks
for one of them at the end, so that answering needs tokens thousands of
positions back. Every example is deterministic for a given seed.

Tasks (``TASKS``):

``niah_single``
    One needle "The special magic number for <key> is: <7 digits>." hidden in
    natural text; the prompt ends with the question and the start of the
    answer sentence, the answer is the number.
``niah_multikey``
    Like ``niah_single`` with several needles of the same form and different
    keys (distractors at random depths); one key is asked for.
``kv_lookup``
    A long JSON-like list of ``"xxxx-xxxx": "xxxx-xxxx"`` pairs (random hex);
    the value of one key is asked for. The pairs are the whole haystack.
``variable_tracking``
    Assignment statements hidden in natural text: ``VAR ABCDE = 12345.`` and
    chains ``VAR FGHIJ = VAR ABCDE.``; the question asks for the value of the
    last variable of a chain and the answer spells out the chain back to the
    number (``VAR KLMNO = VAR FGHIJ = VAR ABCDE = 12345``), so every hop is a
    lookup far back in the context. Distractor chains hold other numbers.
    (RULER asks instead for all variables holding a value; resolving a
    variable's value is the same chain-following in the other direction.)

The haystack filler is natural English text: by default the held-out book of
the reference model's corpus, shipped next to the model
(``veloxquant/assets/reference_model/heldout_kjv_acts.txt``, King James
Version, public domain). Pass ``filler=`` to use other text.

Lengths are counted in tokens of the reference model's byte-level tokenizer
(one token per UTF-8 byte plus ``<bos>``) unless ``count_tokens`` is given, in
which case the filler is sized so that the prompt fits the request under that
counter.

Basic use::

    from veloxquant_mlx.bench.tasks import TASKS, make_examples, score
    for ex in make_examples("niah_single", n=10, context_tokens=4096, seed=0):
        out = generate(ex.prompt, max_tokens=ex.max_new_tokens)
        ok = score(ex, out)

This module uses the standard library only (the PyTorch training script
loads it by file path).
"""

from __future__ import annotations

import bisect
import random
import re
import string
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

__all__ = [
    "TASKS",
    "DEFAULT_DEPTHS",
    "EVAL_SEED",
    "Example",
    "make_examples",
    "make_example",
    "build_parts",
    "score",
    "byte_tokens",
    "load_default_filler",
    "HELDOUT_TEXT_PATH",
]

TASKS = ("niah_single", "niah_multikey", "kv_lookup", "variable_tracking")

#: Needle depths used when ``depths`` is not given: 0.05, 0.15, ..., 0.95.
DEFAULT_DEPTHS = tuple(round(0.05 + 0.1 * i, 2) for i in range(10))

#: The seed used by the repository's evaluation (benchmarks/reference_model.py).
#: Training draws from a separate stream (``build_parts`` with the training
#: script's own random generators), never from ``make_examples``.
EVAL_SEED = 1234

HELDOUT_TEXT_PATH = (
    Path(__file__).resolve().parent.parent
    / "assets"
    / "reference_model"
    / "heldout_kjv_acts.txt"
)

# Task parameters used by make_examples (evaluation defaults).
NIAH_MULTIKEY_KEYS = 4
VT_HOPS = 4
VT_CHAINS = 2

_ADJECTIVES = (
    "amber",
    "ancient",
    "bitter",
    "bold",
    "brave",
    "bright",
    "broken",
    "calm",
    "clever",
    "cold",
    "crimson",
    "curious",
    "dark",
    "distant",
    "dusty",
    "eager",
    "early",
    "empty",
    "fierce",
    "frozen",
    "gentle",
    "golden",
    "grand",
    "green",
    "hidden",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "lazy",
    "little",
    "lively",
    "lonely",
    "lucky",
    "misty",
    "noble",
    "old",
    "pale",
    "patient",
    "proud",
    "quick",
    "quiet",
    "rapid",
    "rare",
    "restless",
    "rough",
    "rusty",
    "silent",
    "silver",
    "sleepy",
    "small",
    "smooth",
    "solemn",
    "steady",
    "stormy",
    "sturdy",
    "sudden",
    "swift",
    "tall",
    "tender",
    "tiny",
    "velvet",
    "wild",
    "wise",
)
_NOUNS = (
    "anchor",
    "apple",
    "arrow",
    "badger",
    "banner",
    "beacon",
    "bell",
    "bridge",
    "candle",
    "canyon",
    "castle",
    "cedar",
    "cloud",
    "comet",
    "compass",
    "crane",
    "crystal",
    "desert",
    "dragon",
    "engine",
    "falcon",
    "feather",
    "forest",
    "fountain",
    "garden",
    "glacier",
    "hammer",
    "harbor",
    "hawk",
    "island",
    "kettle",
    "lantern",
    "lemon",
    "lighthouse",
    "magnet",
    "maple",
    "meadow",
    "mirror",
    "monkey",
    "needle",
    "orchard",
    "otter",
    "palace",
    "pepper",
    "pigeon",
    "planet",
    "pocket",
    "prism",
    "quarry",
    "rabbit",
    "river",
    "rocket",
    "saddle",
    "shadow",
    "spider",
    "squirrel",
    "summit",
    "teapot",
    "thunder",
    "tiger",
    "tulip",
    "violin",
    "walrus",
    "willow",
)

_HEX = "0123456789abcdef"


@dataclass(frozen=True)
class Example:
    """One evaluation prompt and its expected answer."""

    task: str
    prompt: str  # everything the model is given (without <bos>)
    answer: str  # the expected continuation
    context_tokens: int  # requested prompt length in tokens
    n_tokens: int  # actual prompt length in tokens (<bos> included)
    depth: (
        float  # requested depth of the target fact (0 = start of the haystack, 1 = end)
    )
    seed: int
    index: int
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def max_new_tokens(self) -> int:
        """Enough tokens to spell out the answer with the byte tokenizer, plus slack."""
        return len(self.answer.encode("utf-8")) + 4


def byte_tokens(text: str) -> int:
    """Tokens of ``text`` under the reference model's tokenizer (<bos> included)."""
    return len(text.encode("utf-8")) + 1


def score(example, output: str) -> bool:
    """True when ``output`` (the generated continuation) starts with the answer.

    Leading whitespace is ignored; the answer must not run on into further
    letters or digits ("1234567" is wrong for "123456").
    """
    answer = example.answer if isinstance(example, Example) else str(example)
    out = output.lstrip()
    if not out.startswith(answer):
        return False
    rest = out[len(answer) :]
    return not (rest and rest[0].isalnum())


_FILLER_CACHE: dict[str, str] = {}


def load_default_filler() -> str:
    """The shipped held-out natural text (King James Version, book of Acts)."""
    key = str(HELDOUT_TEXT_PATH)
    if key not in _FILLER_CACHE:
        _FILLER_CACHE[key] = HELDOUT_TEXT_PATH.read_text(encoding="utf-8")
    return _FILLER_CACHE[key]


# ---------------------------------------------------------------------------
# Plans: what a task hides and asks, before the haystack is sized.


@dataclass
class _Plan:
    preamble: str
    needles: list  # [(depth, text)], text inserted at a boundary of the haystack
    qa: list  # [(question, answer)]; the last answer is what an Example asks for
    haystack: Callable[[int], str]  # byte budget -> haystack text of at most that size
    boundaries: str  # "sentence" or "line"
    target: int  # index in needles of the asked fact (for metadata)


def _key(rng: random.Random, used: set) -> str:
    while True:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in used:
            used.add(k)
            return k


def _text_haystack(rng: random.Random, corpus: str) -> Callable[[int], str]:
    """A slice of ``corpus`` starting at a sentence start, cut at a word end."""
    start = rng.randrange(len(corpus))
    m = re.compile(r"[.;:?!]\s+|\n").search(corpus, start)
    start = m.end() if m else 0

    def make(budget: int) -> str:
        if budget <= 0:
            return ""
        text = corpus[start : start + budget + 64]
        while len(text.encode("utf-8")) < budget + 1:  # wrap around a short corpus
            text += "\n" + corpus[: budget + 64]
        cut = text.encode("utf-8")[:budget].decode("utf-8", "ignore")
        sp = max(cut.rfind(" "), cut.rfind("\n"))
        return cut[:sp] if sp > 0 else cut

    return make


def _kv_line(k: str, v: str) -> str:
    return f'"{k}": "{v}",\n'


def _hex8(rng: random.Random) -> str:
    s = "".join(rng.choice(_HEX) for _ in range(8))
    return s[:4] + "-" + s[4:]


def _kv_haystack(seed: int) -> Callable[[int], str]:
    def make(budget: int) -> str:
        r = random.Random(seed)
        out, size = [], 0
        while True:
            line = _kv_line(_hex8(r), _hex8(r))
            if size + len(line) > budget:
                return "".join(out)
            out.append(line)
            size += len(line)

    return make


def _var_name(rng: random.Random, used: set) -> str:
    while True:
        v = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if v not in used:
            used.add(v)
            return v


def _plan(
    task: str,
    rng: random.Random,
    depth: Optional[float],
    corpus: str,
    n_queries: int = 1,
    opts: Optional[dict] = None,
) -> _Plan:
    opts = opts or {}
    d0 = rng.random() if depth is None else float(depth)

    if task in ("niah_single", "niah_multikey"):
        n_keys = (
            1 if task == "niah_single" else int(opts.get("n_keys", NIAH_MULTIKEY_KEYS))
        )
        n_keys = max(n_keys, n_queries)
        used: set = set()
        facts = [
            (_key(rng, used), str(rng.randrange(1_000_000, 10_000_000)))
            for _ in range(n_keys)
        ]
        depths = [d0] + [rng.random() for _ in range(n_keys - 1)]
        needles = [
            (d, f"The special magic number for {k} is: {v}. ")
            for d, (k, v) in zip(depths, facts)
        ]
        asked = list(range(n_keys))
        asked = [0] + rng.sample(asked[1:], n_queries - 1) if n_queries > 1 else [0]
        asked = asked[1:] + asked[:1]  # the target (depth d0) is asked last
        qa = [
            (
                f"Question: What is the special magic number for {facts[i][0]}?\n"
                f"Answer: The special magic number for {facts[i][0]} is: ",
                facts[i][1],
            )
            for i in asked
        ]
        preamble = "Memorize the special magic numbers hidden in this text.\n\n"
        return _Plan(preamble, needles, qa, _text_haystack(rng, corpus), "sentence", 0)

    if task == "kv_lookup":
        n_asked = max(1, n_queries)
        pairs = [(_hex8(rng), _hex8(rng)) for _ in range(n_asked)]
        depths = [d0] + [rng.random() for _ in range(n_asked - 1)]
        needles = [(d, _kv_line(k, v)) for d, (k, v) in zip(depths, pairs)]
        order = list(range(1, n_asked)) + [0]
        qa = [
            (
                f'Question: What is the value of key "{pairs[i][0]}"?\nAnswer: "{pairs[i][0]}": "',
                pairs[i][1],
            )
            for i in order
        ]
        preamble = "Memorize the key-value pairs of this JSON object.\n{\n"
        plan = _Plan(
            preamble, needles, qa, _kv_haystack(rng.getrandbits(64)), "line", 0
        )
        return plan

    if task == "variable_tracking":
        hops = int(opts.get("hops", VT_HOPS))
        n_chains = max(int(opts.get("chains", VT_CHAINS)), 1)
        used: set = set()
        values: set = set()
        chains = []
        for _ in range(n_chains):
            while True:
                val = str(rng.randrange(10_000, 100_000))
                if val not in values:
                    values.add(val)
                    break
            chains.append(([_var_name(rng, used) for _ in range(hops + 1)], val))
        needles = []
        for c, (names, val) in enumerate(chains):
            for i, name in enumerate(names):
                d = d0 if (c == 0 and i == 0) else rng.random()
                rhs = val if i == 0 else f"VAR {names[i - 1]}"
                needles.append((d, f"VAR {name} = {rhs}. "))
        # Questions: the last variable of chain 0 is asked last; training asks
        # more (other chains, or other variables along a chain).
        asks = [(0, hops)]
        for _ in range(n_queries - 1):
            asks.insert(0, (rng.randrange(n_chains), rng.randrange(hops + 1)))
        qa = []
        for c, i in asks:
            names, val = chains[c]
            steps = [f"VAR {names[j]}" for j in range(i - 1, -1, -1)] + [val]
            qa.append(
                (
                    f"Question: What is the value of VAR {names[i]}?\n"
                    f"Answer: VAR {names[i]} = ",
                    " = ".join(steps),
                )
            )
        preamble = "Track the variable assignments hidden in this text.\n\n"
        return _Plan(preamble, needles, qa, _text_haystack(rng, corpus), "sentence", 0)

    raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")


_SENTENCE_END = re.compile(r"(?<=[.;:?!]) |\n")


def _boundaries(text: str, kind: str) -> list:
    if kind == "line":
        b = [m.end() for m in re.finditer("\n", text)]
    else:
        b = [m.end() for m in _SENTENCE_END.finditer(text)]
    return [0] + b + ([len(text)] if not b or b[-1] != len(text) else [])


def _assemble(plan: _Plan, budget_bytes: int, answers_in_budget: bool):
    """Render the plan with a haystack of the given byte budget.

    Returns (parts, info): parts is a list of (text, is_answer); info holds the
    character offsets of the needles.
    """
    fixed = len(plan.preamble.encode()) + sum(len(t.encode()) for _, t in plan.needles)
    fixed += sum(len(q.encode()) + 2 for q, _ in plan.qa)  # "\n\n" before each question
    if plan.boundaries == "line":
        fixed += 2  # closing "\n}"
    if answers_in_budget:
        fixed += sum(len(a.encode()) for _, a in plan.qa)
    else:
        fixed += sum(len(a.encode()) for _, a in plan.qa[:-1])
    hay = plan.haystack(max(budget_bytes - fixed, 0))
    bounds = _boundaries(hay, plan.boundaries)
    # Place each needle at the boundary nearest to its depth.
    placed = []
    for idx, (d, text) in enumerate(plan.needles):
        pos = min(max(d, 0.0), 1.0) * len(hay)
        j = bisect.bisect_left(bounds, pos)
        cands = [bounds[k] for k in (j - 1, j) if 0 <= k < len(bounds)]
        at = min(cands, key=lambda b: (abs(b - pos), b))
        placed.append((at, idx, text))
    placed.sort()
    pieces, offsets, last = [], {}, 0
    out_len = len(plan.preamble)
    for at, idx, text in placed:
        pieces.append(hay[last:at])
        out_len += at - last
        offsets[idx] = (out_len, at / max(len(hay), 1))
        pieces.append(text)
        out_len += len(text)
        last = at
    pieces.append(hay[last:])
    body = plan.preamble + "".join(pieces)
    if plan.boundaries == "line":
        body = body.rstrip(",\n") + "\n}"
    parts = [(body, False)]
    for q, a in plan.qa:
        parts.append(("\n\n" + q, False))
        parts.append((a, True))
    return parts, {"needle_offsets": offsets, "haystack_chars": len(hay)}


def build_parts(
    task: str,
    rng: random.Random,
    total_tokens: int,
    corpus: str,
    *,
    depth: Optional[float] = None,
    n_queries: int = 1,
    opts: Optional[dict] = None,
):
    """Training helper: one example as [(text, is_answer), ...].

    The text of all parts (answers included) takes at most ``total_tokens - 2``
    bytes, leaving room for <bos> and <eos>. ``rng`` drives every random choice
    (pass the training script's own generators: training never uses the
    evaluation seeds of ``make_examples``).
    """
    plan = _plan(task, rng, depth, corpus, n_queries=n_queries, opts=opts)
    parts, _ = _assemble(plan, total_tokens - 2, answers_in_budget=True)
    return parts


def make_example(
    task: str,
    context_tokens: int,
    seed: int,
    index: int = 0,
    depth: Optional[float] = None,
    filler: Optional[str] = None,
    count_tokens: Optional[Callable[[str], int]] = None,
    **opts,
) -> Example:
    """One deterministic example (see ``make_examples``)."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {TASKS}")
    corpus = load_default_filler() if filler is None else filler
    rng = random.Random(
        f"veloxquant-eval/{task}/{context_tokens}/{seed}/{index}/{depth}"
    )
    plan = _plan(task, rng, depth, corpus, n_queries=1, opts=opts)
    counter = count_tokens or byte_tokens
    budget = context_tokens - 1  # <bos>
    for _ in range(8):
        parts, info = _assemble(plan, budget, answers_in_budget=False)
        prompt = "".join(t for t, _ in parts[:-1])
        n = counter(prompt)
        if n <= context_tokens or count_tokens is None:
            break
        budget -= max(1, int((n - context_tokens) * budget / max(n, 1)) + 1)
    answer = parts[-1][0]
    target_off, actual_depth = info["needle_offsets"][plan.target]
    meta = {
        "actual_depth": round(actual_depth, 4),
        "needle_char": target_off,
        "needle_token": counter(
            prompt[:target_off]
        ),  # tokens before the target fact (<bos> counted)
        "distance_tokens": n - counter(prompt[:target_off]),
        "needles": len(plan.needles),
    }
    if task == "variable_tracking":
        meta["hops"] = int(opts.get("hops", VT_HOPS))
        meta["chains"] = int(opts.get("chains", VT_CHAINS))
        firsts = [
            off
            for (idx, (off, _)) in info["needle_offsets"].items()
            if idx <= meta["hops"]
        ]
        meta["chain_first_token"] = counter(prompt[: min(firsts)])
    if task == "niah_multikey":
        meta["keys"] = len(plan.needles)
    return Example(
        task,
        prompt,
        answer,
        context_tokens,
        n,
        float(plan.needles[plan.target][0]),
        seed,
        index,
        meta,
    )


def make_examples(
    task: str,
    n: int,
    context_tokens: int,
    seed: int = EVAL_SEED,
    depths: Optional[Sequence[float]] = None,
    filler: Optional[str] = None,
    count_tokens: Optional[Callable[[str], int]] = None,
    **opts,
) -> list:
    """``n`` deterministic examples of ``task`` with prompts of ``context_tokens`` tokens.

    Depths cycle through ``depths`` (default ``DEFAULT_DEPTHS``); the depth is
    where the asked fact sits in the haystack (for ``variable_tracking``: the
    statement that holds the number; the other statements are at random
    depths). ``filler`` is the natural text the haystack is cut from (default:
    the shipped held-out text). ``count_tokens`` counts a prompt's tokens
    (default: the reference model's byte tokenizer). Task options:
    ``n_keys`` (niah_multikey), ``hops`` and ``chains`` (variable_tracking).
    """
    depths = tuple(DEFAULT_DEPTHS if depths is None else depths)
    return [
        make_example(
            task,
            context_tokens,
            seed,
            i,
            depth=depths[i % len(depths)],
            filler=filler,
            count_tokens=count_tokens,
            **opts,
        )
        for i in range(n)
    ]
