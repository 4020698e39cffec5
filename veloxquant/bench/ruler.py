"""RULER-style long-context tasks for the leaderboard: seeded generators and RULER's scorers.

Six tasks (``RULER_TASKS``), each a prompt of a requested length in tokens of the model's
tokenizer, ending with its question and the start of the answer (RULER's answer prefix),
and a list of reference strings:

``niah_single``
    One needle "The special magic number for <key> is: <7 digits>." in natural text.
``niah_multikey``
    Four such needles with different keys; one key is asked.
``niah_multivalue``
    Four needles with the same key and different numbers; all four are asked.
``vt``
    Variable tracking: a chain ``VAR A = 12345``, ``VAR B = VAR A``, ... hidden in text
    with a distractor chain holding another number; asked: every variable that holds
    the first chain's number.
``cwe``
    Common-word extraction: a numbered list of words in which ten words recur often and
    the rest a few times each; asked: the ten most common.
``qa``
    Questions over the context: documents (paragraphs of the filler) carrying facts
    "<Name> keeps the <thing> in <town>."; asked: where one person keeps one thing.
    RULER takes its QA from SQuAD and HotpotQA, which we neither ship nor fetch; this
    keeps RULER's shape (answer in one of many documents, distractor facts about the
    same people and things) with synthetic facts.

Scoring follows RULER: the output, lower-cased, is searched for each reference;
``all`` tasks (the needles, vt, cwe) score the fraction of references found, ``part``
(qa) scores 1 when any is found.

The needle sentence is the one the reference model was trained on (``tasks.py``), so
its figures mean something on that model; the haystack is the held-out book shipped
with it. Lengths are counted with ``count_tokens`` (default: the byte tokenizer); the
haystack is sized by bisection so that the prompt is the longest that fits.

Standard library only, like ``tasks.py``.
"""

from __future__ import annotations

import bisect
import random
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from .tasks import _ADJECTIVES, _NOUNS, byte_tokens, load_default_filler

__all__ = ["RULER_TASKS", "METRICS", "RulerExample", "make_ruler_example",
           "make_ruler_examples", "ruler_score"]

RULER_TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "vt", "cwe", "qa")
METRICS = {"niah_single": "all", "niah_multikey": "all", "niah_multivalue": "all",
           "vt": "all", "cwe": "all", "qa": "part"}

MULTIKEY_KEYS = 4
MULTIVALUE_VALUES = 4
VT_HOPS = 4  # a chain of VT_HOPS + 1 variables
CWE_COMMON = 10
QA_DOCUMENTS_PER_1K = 3  # documents per 1,024 tokens: ~340 tokens each

_NAMES = ("Abel", "Bertha", "Cyrus", "Dorcas", "Edwin", "Flora", "Gideon", "Hilda",
          "Ivor", "Jemima", "Kaspar", "Lydia", "Magnus", "Nell", "Oswin", "Phoebe",
          "Quentin", "Rhoda", "Silas", "Tabitha", "Ulric", "Vera", "Wilfred", "Zelda")
_TOWNS = ("Ashford", "Brambleton", "Coldwater", "Dunmore", "Elmstead", "Fairhaven",
          "Glenrock", "Hollowmere", "Ironbridge", "Juniper Falls", "Kingsbay", "Larkspur",
          "Millbrook", "Northwick", "Oakhurst", "Pinecrest", "Redcliff", "Stonegate",
          "Thornbury", "Westmoor")
_THINGS = ("ledger", "violin", "lantern", "compass", "telescope", "kettle", "saddle",
           "atlas", "hourglass", "mirror", "anchor", "bell")


@dataclass(frozen=True)
class RulerExample:
    task: str
    prompt: str  # everything the model is given (without <bos>)
    answers: tuple  # the references the scorer looks for
    context_tokens: int  # requested length
    n_tokens: int  # actual length under the counter used
    max_new_tokens: int  # enough to say every reference, with slack
    seed: int
    index: int
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def question(self) -> str:
        """The prompt's closing question and answer prefix (every task's prompt ends with
        a blank line, then "Question: ..."): what kvpress's pipeline reads after
        compressing the rest."""
        return self.prompt[self.prompt.rindex("\n\nQuestion:") + 2:]


def ruler_score(task_or_example, output: str, answers=None) -> float:
    """RULER's score of one output in [0, 1]: ``all`` tasks, the fraction of the
    references found in it; ``part`` tasks, 1 when any is. Case-insensitive."""
    if isinstance(task_or_example, RulerExample):
        task, answers = task_or_example.task, task_or_example.answers
    else:
        task = task_or_example
    found = [a.lower() in output.lower() for a in answers]
    if METRICS[task] == "part":
        return float(any(found))
    return sum(found) / len(found)


# ---------------------------------------------------------------------------
# The haystack: natural text cut at sentence boundaries, sized by the caller.


class _Text:
    """The corpus's words from a random sentence on, wrapping around (so any size fits),
    with where its sentences start: a haystack is its first n words."""

    def __init__(self, corpus: str, rng: random.Random):
        sentences = [s.split() for s in re.split(r"(?<=[.;:?!])\s+", corpus.replace("\n", " "))]
        sentences = [s for s in sentences if s]
        first = rng.randrange(len(sentences))
        self.words: list[str] = []
        self.starts: list[int] = []
        for s in sentences[first:] + sentences[:first]:
            self.starts.append(len(self.words))
            self.words += s

    def __len__(self) -> int:
        return len(self.words)

    def haystack(self, n: int, needles: list[tuple[float, str]], skip: int = 0) -> str:
        """Words ``skip`` to ``skip + n`` with each needle at the sentence start nearest to
        its depth (or at either end); needles at one place keep their given order."""
        cuts = [0] + [i - skip for i in self.starts if skip < i < skip + n] + [n]
        slots: dict[int, list[str]] = {}
        for depth, text in needles:
            pos = min(max(depth, 0.0), 1.0) * n
            j = bisect.bisect_left(cuts, pos)
            near = min((cuts[k] for k in (j - 1, j) if 0 <= k < len(cuts)),
                       key=lambda c: (abs(c - pos), c))
            slots.setdefault(near, []).append(text)
        out = []
        for i in range(n + 1):
            out += slots.get(i, [])
            if i < n:
                out.append(self.words[(skip + i) % len(self.words)])
        return " ".join(out)


def _fit(task: str, render: Callable[[int], str], count: Callable[[str], int], tokens: int,
         most: int) -> tuple[str, int]:
    """The prompt of the largest size in [0, most] whose token count is at most
    ``tokens`` (token counts grow with the size), and that count."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if count(render(mid)) <= tokens:
            lo = mid
        else:
            hi = mid - 1
    prompt = render(lo)
    n = count(prompt)
    if n > tokens:
        raise ValueError(f"{task}: its fixed text alone takes {n} tokens, more than the "
                         f"{tokens} asked for")
    return prompt, n


def _keys(rng: random.Random, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        k = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if k not in keys:
            keys.append(k)
    return keys


def _numbers(rng: random.Random, n: int, low: int = 1_000_000, high: int = 10_000_000):
    return [str(v) for v in rng.sample(range(low, high), n)]


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is: {value}."


_NIAH_INTRO = "Memorize the special magic numbers hidden in this text.\n\n"


def _niah(task: str, rng: random.Random, corpus: str):
    n_keys = MULTIKEY_KEYS if task == "niah_multikey" else 1
    n_values = MULTIVALUE_VALUES if task == "niah_multivalue" else 1
    keys = _keys(rng, n_keys)
    values = _numbers(rng, n_keys * n_values)
    needles = [(rng.random(), _needle(keys[i // n_values], v)) for i, v in enumerate(values)]
    asked = rng.randrange(n_keys)
    key = keys[asked]
    answers = tuple(values[asked * n_values:(asked + 1) * n_values])
    if n_values == 1:
        question = (f"Question: What is the special magic number for {key}?\n"
                    f"Answer: The special magic number for {key} is: ")
    else:
        question = (f"Question: What are all the special magic numbers for {key}?\n"
                    f"Answer: The special magic numbers for {key} are: ")
    text = _Text(corpus, rng)
    render = lambda n: _NIAH_INTRO + text.haystack(n, needles) + "\n\n" + question  # noqa: E731
    return render, len(text), answers, ", ".join(answers), {"depths": [d for d, _ in needles]}


def _vt(rng: random.Random, corpus: str):
    names: list[str] = []
    while len(names) < 2 * (VT_HOPS + 1):
        v = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if v not in names:
            names.append(v)
    value, other = _numbers(rng, 2, 10_000, 100_000)
    needles = []
    for chain, val in ((names[: VT_HOPS + 1], value), (names[VT_HOPS + 1:], other)):
        # a chain reads in order: each assignment after the one it copies
        depths = sorted(rng.random() for _ in chain)
        for i, (d, name) in enumerate(zip(depths, chain)):
            rhs = val if i == 0 else f"VAR {chain[i - 1]}"
            needles.append((d, f"VAR {name} = {rhs}."))
    answers = tuple(names[: VT_HOPS + 1])
    question = (f"Question: Find all variables that are assigned the value {value} in the "
                f"text above.\nAnswer: According to the chain(s) of variable assignment in "
                f"the text above, {len(answers)} variables are assigned the value {value}, "
                f"they are: ")
    text = _Text(corpus, rng)
    intro = "Memorize and track the chain(s) of variable assignment hidden in this text.\n\n"
    render = lambda n: intro + text.haystack(n, needles) + "\n\n" + question  # noqa: E731
    return render, len(text), answers, " ".join(answers), {}


_WORDS_CACHE: dict[int, list[str]] = {}


def _vocabulary(corpus: str) -> list[str]:
    """Distinct lower-case words of the corpus, four letters or more, in a fixed order."""
    key = hash(corpus)
    if key not in _WORDS_CACHE:
        _WORDS_CACHE[key] = sorted({w for w in re.findall(r"\b[a-z]{4,}\b", corpus)})
    return _WORDS_CACHE[key]


def _cwe(rng: random.Random, corpus: str, context_tokens: int, count: Callable[[str], int],
         n_common: int = CWE_COMMON):
    """cwe's prompt maker; ``n_common`` common words (the bench's ten; fewer for training's
    smaller instances, ``training/mixture.py``)."""
    vocabulary = _vocabulary(corpus)
    words = rng.sample(vocabulary, min(len(vocabulary), 2000))
    common, rare = words[:n_common], words[n_common:]
    order = [rng.random() for _ in range(len(rare) * 3 + n_common * 30)]
    question = (f"Question: What are the {n_common} most common words in the above list?\n"
                f"Answer: The top {n_common} words that appear most often in the list are: ")

    def render_at(freq_common: int, freq_rare: int, n: int) -> str:
        items = [w for w in common for _ in range(freq_common)]
        items += [w for w in rare[:n] for _ in range(freq_rare)]
        keyed = sorted(zip(order, items))  # one fixed shuffle for every size
        listed = " ".join(f"{i + 1}. {w}" for i, (_, w) in enumerate(keyed))
        return ("Below is a numbered list of words. Memorize the ones that appear most "
                "often.\n\n" + listed + "\n\n" + question)

    # RULER repeats each common word 30 times and each other word 3 times; where that
    # would fill more than half the prompt with the common words (short contexts, long
    # tokens), fewer repeats, and the other words once when the common ones are rare
    freq_common = 30
    while freq_common > 2 and count(render_at(freq_common, 0, 0)) > context_tokens // 2:
        freq_common -= 1
    freq_rare = 3 if freq_common >= 10 else 1
    render = lambda n: render_at(freq_common, freq_rare, n)  # noqa: E731
    meta = {"freq_common": freq_common, "freq_rare": freq_rare}
    return render, len(rare), tuple(common), ", ".join(common), meta


def _qa(rng: random.Random, corpus: str, context_tokens: int):
    people = rng.sample(_NAMES, 3)
    things = rng.sample(_THINGS, 4)
    towns = rng.sample(_TOWNS, 7)
    # every (person, thing) pair is a distinct fact with its own town; the asked pair's
    # person and thing each appear in other facts, so neither alone finds the answer
    lone = (people[2], things[3])  # a fact about neither: never asked
    pairs = [(p, t) for p in people[:2] for t in things[:3]] + [lone]
    rng.shuffle(pairs)
    facts = [f"{p} keeps the {t} in {towns[i]}." for i, (p, t) in enumerate(pairs)]
    asked = rng.choice([i for i, pair in enumerate(pairs) if pair != lone])
    person, thing = pairs[asked]
    answers = (towns[asked],)
    n_docs = max(2, round(QA_DOCUMENTS_PER_1K * context_tokens / 1024))
    doc_of = [rng.randrange(n_docs) for _ in facts]
    where = [rng.random() for _ in facts]
    text = _Text(corpus, rng)
    question = (f"Question: In which town does {person} keep the {thing}?\n"
                f"Answer: {person} keeps the {thing} in ")

    def render(n: int) -> str:
        per_doc, docs = n // n_docs, []
        for d in range(n_docs):
            own = [(where[i], facts[i]) for i in range(len(facts)) if doc_of[i] == d]
            body = text.haystack(per_doc, own, skip=d * per_doc)
            docs.append(f"Document {d + 1}:\n{body}")
        return ("Answer the question based on the given documents.\n\n" + "\n\n".join(docs)
                + "\n\n" + question)

    return render, len(text), answers, answers[0], {
        "documents": n_docs, "answer_document": doc_of[asked] + 1}


def make_ruler_example(task: str, context_tokens: int, seed: int = 0, index: int = 0,
                       count_tokens: Optional[Callable[[str], int]] = None,
                       filler: Optional[str] = None) -> RulerExample:
    """One example of ``task``: the same (task, length, seed, index) always gives the same
    prompt and answers under the same counter and filler."""
    if task not in RULER_TASKS:
        raise ValueError(f"unknown task {task!r}; expected one of {', '.join(RULER_TASKS)}")
    corpus = load_default_filler() if filler is None else filler
    count = count_tokens or byte_tokens
    rng = random.Random(f"veloxquant-ruler/{task}/{context_tokens}/{seed}/{index}")
    if task.startswith("niah"):
        render, most, answers, said, meta = _niah(task, rng, corpus)
    elif task == "vt":
        render, most, answers, said, meta = _vt(rng, corpus)
    elif task == "cwe":
        render, most, answers, said, meta = _cwe(rng, corpus, context_tokens, count)
    else:
        render, most, answers, said, meta = _qa(rng, corpus, context_tokens)
    prompt, n = _fit(task, render, count, context_tokens, most)
    # the answer as a list, minus the <bos> the counter includes, plus slack
    max_new = count(said) - (count("") if count("") else 0) + 8
    return RulerExample(task, prompt, answers, context_tokens, n, max_new, seed, index, meta)


def make_ruler_examples(task: str, n: int, context_tokens: int, seed: int = 0,
                        count_tokens: Optional[Callable[[str], int]] = None,
                        filler: Optional[str] = None) -> list[RulerExample]:
    return [make_ruler_example(task, context_tokens, seed, i, count_tokens, filler)
            for i in range(n)]
