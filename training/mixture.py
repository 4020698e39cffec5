"""The training data of the reference models, without torch: the tokenizer wrapper, the
task mixtures, the induction warm-up, the packed sequences with their per-target kinds and
answer-loss weights, and the evaluation examples. ``train.py`` imports it; the tests run it
in the project's environment (numpy, tokenizers, no torch).

Two paths:

* ``--mixture reference`` (the byte model): the stream of the first reference model,
  unchanged (same random draws, same sequences); every answer token weighs 1, so the
  answer loss is the per-token mean it always was.
* ``--mixture ruler`` (the subword model, ``benchmarks/notes/subword_baseline.md`` section
  6): the leaderboard's tasks from 256 tokens on, a copy warm-up over the tasks' own token
  types, examples that always fit their slot (an example that does not is dropped, never
  cut), extra questions per qa and vt prompt, and answer weights of 1/n over the n tokens
  of each answer part (the loss is a mean over examples, not tokens).
"""

from __future__ import annotations

import random
import re
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import bench_modules  # noqa: E402
import byte_tokenizer as bt  # noqa: E402

tasks, ruler = bench_modules.load()


class Tok:
    """The model's tokenizer: bytes (``path`` None, the first reference model) or a
    ``tokenizer.json`` (the subword model); ``encode`` gives ids without <bos>."""

    def __init__(self, path: str | None = None):
        self.path = path
        self._pieces: dict = {}
        if path is None:
            self.bos, self.eos, self.pad = bt.BOS_ID, bt.EOS_ID, bt.PAD_ID
            self.vocab_size = bt.VOCAB_SIZE
            self.chars_per_token = 1.0
            return
        from tokenizers import Tokenizer

        self.t = Tokenizer.from_file(path)
        self.bos, self.eos, self.pad = (self.t.token_to_id(s) for s in ("<bos>", "<eos>", "<pad>"))
        self.vocab_size = -(-self.t.get_vocab_size() // 64) * 64
        # of the held-out book: sizes the generators whose budgets are in bytes
        sample = tasks.load_default_filler()[:50_000]
        self.chars_per_token = len(sample) / len(self.encode(sample))

    def encode(self, text: str) -> np.ndarray:
        if self.path is None:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)
        return np.asarray(self.t.encode(text, add_special_tokens=False).ids, dtype=np.int32)

    def count(self, text: str) -> int:  # as the bench counts: with <bos>
        return 1 + len(self.encode(text))

    def count_fast(self, text: str) -> int:
        """``count``, from cached counts of the text's whitespace-separated pieces: exact
        for a tokenizer whose pre-tokenizer never joins whitespace to other characters
        (``subword_tokenizer.SPLIT``), and about 7x faster than encoding, which matters to
        the data workers (sizing an example takes several counts)."""
        if self.path is None:
            return 1 + len(text.encode("utf-8"))
        if len(self._pieces) > 300_000:  # vt names are random: keep the cache bounded
            self._pieces.clear()
        n, cache = 1, self._pieces
        for piece in re.split(r"(\s+)", text):
            c = cache.get(piece)
            if c is None:
                c = cache[piece] = len(self.t.encode(piece, add_special_tokens=False).ids) if piece else 0
            n += c
        return n

    def save(self, folder: Path) -> None:
        if self.path is None:
            bt.save_tokenizer(folder)
            return
        import shutil

        src = Path(self.path).parent
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(src / name, folder / name)


# ---------------------------------------------------------------------------
# Mixtures

TASK_WEIGHTS = {
    "niah_single": 0.15,
    "niah_multikey": 0.3,
    "kv_lookup": 0.2,
    "variable_tracking": 0.35,
}
P_TEXT = 0.12  # plain-text sequences
P_COPY_SHORT, P_COPY = 0.5, 0.08  # copy (induction warm-up) sequences: short contexts / longer
P_SINGLE = 0.6  # otherwise: one example fills the sequence, else 2-4 packed examples

# --mixture: the weights from SHORT_BELOW[mixture] tokens on. The subword model's (ruler)
# is the leaderboard's six tasks (veloxquant/bench/ruler.py, prefixed "ruler:") plus the
# bench's niah_multikey. The needle tasks are learned early and need upkeep only; vt, cwe
# and qa get the weight (the note's section 6, item 6). tasks.py's variable_tracking and
# kv_lookup are not in it: the leaderboard does not score them, and variable_tracking's
# forward chains are not vt's.
MIXTURES = {
    "reference": TASK_WEIGHTS,
    "ruler": {
        "ruler:niah_single": 0.05,
        "ruler:niah_multikey": 0.08,
        "ruler:niah_multivalue": 0.12,
        "ruler:vt": 0.25,
        "ruler:cwe": 0.22,
        "ruler:qa": 0.25,
        "niah_multikey": 0.03,
    },
}
# below SHORT_BELOW tokens: the byte model trains its own tasks only; the subword model
# the tasks whose fixed text fits 256 tokens (qa and cwe do, ruler vt's 330 tokens do not),
# since copying circuits form at 256 tokens and not later (training/README.md)
SHORT_MIXTURES = {
    "reference": TASK_WEIGHTS,
    "ruler": {"niah_single": 0.15, "niah_multikey": 0.25, "ruler:qa": 0.3, "ruler:cwe": 0.3},
}
SHORT_BELOW = {"reference": 1024, "ruler": 512}
# a slot shorter than this never gets the task (another is drawn): vt's fixed text alone
# is about 330 tokens, and a slot that barely holds it has no haystack left
MIN_SLOT = {"ruler:vt": 400}
# mixtures trained with the new data rules (per-example answer weights, examples that
# always fit, the wider copy warm-up, extra questions); the others keep the old stream
NEW_RULES = {"ruler"}
QA_EXTRA_MAX = 3  # further qa questions about the same prompt's other bindings
# Target kinds (entry i describes ids[i] as a target): 0 ignored, 1 text, 2 answer, 3 the
# first token of a word in an answer list the scorer takes in any order (cwe): its loss is
# -log of the probability of every first token of the list's words not yet written, so the
# model is not trained to guess an order it cannot know when it writes the first word (the
# note's section 6, item 8). ``FREE_WIDTH`` such tokens at most a target (-1: none).
FREE = "free"  # an answer part of words in any order, joined by ", "
FREE_WIDTH = ruler.CWE_COMMON
# cwe's smaller instances (training only; the bench and the checks ask for ten): the
# generator leaves the ten common words at most half the slot, so below 1,024 tokens each
# is listed twice against the other words' once, and at 256 nearly every listed word is one
# of the ten; a model trained on that wrote one common word and then words not in the list
# (benchmarks/notes/subword_baseline.md section 11). Fewer common words in a short slot are
# listed more often: (slots below this many tokens, the counts drawn from).
CWE_CURRICULUM = ((512, (3,)), (1024, (3, 5)), (2048, (5, 10)))


def cwe_words(size: int, rng: random.Random) -> int:
    """How many common words a cwe example of a ``size``-token slot asks for."""
    for below, counts in CWE_CURRICULUM:
        if size < below:
            return rng.choice(counts)
    return ruler.CWE_COMMON


def free_targets(tok: "Tok", text: str) -> tuple[np.ndarray, list]:
    """An answer list ``text`` ("w1, w2, ...") as (its token ids, [(offset of word j's first
    token, the first tokens of words j, j+1, ... without repeats)]). The words are encoded
    alone: the tokenizer's pieces never join letters to punctuation or spaces, so the ids
    are ``tok.encode(text)``; where they are not, no token is free."""
    words = text.split(", ")
    sep = tok.encode(", ")
    pieces = [tok.encode(w) for w in words]
    ids = np.concatenate([x for i, b in enumerate(pieces) for x in ((sep, b) if i else (b,))])
    whole = tok.encode(text)
    if len(ids) != len(whole) or (ids != whole).any() or not all(len(b) for b in pieces):
        return whole, []
    firsts = [int(b[0]) for b in pieces]
    out, offset = [], 0
    for j, b in enumerate(pieces):
        out.append((offset, list(dict.fromkeys(firsts[j:]))))
        offset += len(b) + len(sep)
    return whole, out


def mixture_at(mixture: str, L: int) -> dict:
    return MIXTURES[mixture] if L >= SHORT_BELOW[mixture] else SHORT_MIXTURES[mixture]


def _example_opts(task, rng):
    if task == "niah_multikey":
        return {"n_keys": rng.randint(2, 8)}, rng.randint(1, 3)
    if task == "variable_tracking":
        return {"hops": rng.randint(1, 5), "chains": rng.randint(1, 3)}, rng.randint(1, 3)
    if task == "kv_lookup":
        return {}, rng.randint(1, 3)
    return {}, 1


# ---------------------------------------------------------------------------
# Induction warm-up


def _random_word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(rng.randint(2, 7)))


def _random_words(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        w = _random_word(rng)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


COPY_NAMED = ruler._TOWNS + ruler._NAMES + ruler._THINGS


def _task_words(rng: random.Random, n: int, vocabulary: list) -> str:
    """About ``n`` characters of the token types the leaderboard's answers are made of:
    the shipped model copied its warm-up's alphabet (lower case, digits) perfectly and
    upper-case names and towns almost never (the note's section 2.3)."""
    out, size = [], 0
    while size < n:
        r = rng.random()
        if r < 0.4:
            w = _random_word(rng)
        elif r < 0.6:  # a vt name
            w = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
            if rng.random() < 0.5:
                w = "VAR " + w
        elif r < 0.8:  # qa's towns, people and things
            w = rng.choice(COPY_NAMED)
        else:  # cwe's words
            w = rng.choice(vocabulary)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)


def copy_sequence(rng: random.Random, L: int, tok: Tok, corpus: str = "", mixture: str = "reference"):
    """Induction warm-up: blocks of words, each written twice; the second copy is the
    answer, one example (its weights sum to 1 under the new rules, else 1 a token). The
    same four arrays as ``make_sequence``."""
    ids = np.full(L + 1, tok.pad, dtype=np.int32)
    kind = np.zeros(L + 1, dtype=np.int8)
    ids[0] = tok.bos
    new = mixture in NEW_RULES
    vocabulary = ruler._vocabulary(corpus) if new else None
    p = 1
    while p < L + 1 - 8:
        m = rng.randint(8, max(8, min(1024, (L + 1 - p - 3) // 2)))
        x = _task_words(rng, m, vocabulary) if new else _random_words(rng, m)
        for chunk, k in ((x + "\n", 1), (x, 2), ("\n\n", 1)):
            b = tok.encode(chunk)
            n = min(len(b), L + 1 - p)
            ids[p : p + n] = b[:n]
            kind[p : p + n] = k
            p += n
    w = (kind == 2).astype(np.float32)
    if new:
        w /= max(1.0, float(w.sum()))
    return ids, kind, w, _no_free(L)


def _no_free(L: int) -> np.ndarray:
    return np.full((L + 1, FREE_WIDTH), -1, dtype=np.int32)


# ---------------------------------------------------------------------------
# Examples


def in_text_order(task: str, prompt: str, answers) -> list:
    """The answers of a task the scorer takes in any order (niah_multivalue, cwe) as the
    text first shows them: an order the model can know (the generator's is random)."""
    mark = " {}" if task == "niah_multivalue" else ". {} "
    return sorted(answers, key=lambda a: prompt.find(mark.format(a)) % (1 << 62))


_FACT = re.compile(r"(\w+) keeps the (\w+) in ([A-Z][a-z]+(?: Falls)?)\.")
_QA_ASKED = re.compile(r"In which town does (\w+) keep the (\w+)\?")
_VAR = re.compile(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.")
_VT_VALUE = re.compile(r"assigned the value (\d+) ")


def _last_question(prompt: str) -> str:
    return prompt[prompt.rindex("\n\nQuestion:"):]


def _extra_questions(task: str, skeleton: str, rng: random.Random) -> list:
    """More questions about the same prompt, in the bench's template, as (question,
    answer): qa, 0-3 other (person, thing) bindings; vt, the distractor chain's value.
    ``skeleton`` is the prompt without haystack (every fact, the bench's question last)."""
    question = _last_question(skeleton)
    if task == "qa":
        facts = _FACT.findall(skeleton)
        person, thing = _QA_ASKED.search(question).groups()
        people = [p for p, _, _ in facts]
        things = [t for _, t, _ in facts]
        # the bench asks bindings whose person and thing both recur (the fact about
        # neither is never asked): so do these
        pool = [(p, t, town) for p, t, town in facts
                if people.count(p) > 1 and things.count(t) > 1 and (p, t) != (person, thing)]
        k = min(len(pool), rng.randint(0, QA_EXTRA_MAX))
        out = []
        for p, t, town in rng.sample(pool, k):
            q = re.sub(rf"\b{person}\b", p, question)
            out.append((re.sub(rf"\b{thing}\b", t, q), town))
        return out
    if task == "vt":
        rhs = dict(_VAR.findall(skeleton))
        value = _VT_VALUE.search(question).group(1)
        roots = [n for n, r in rhs.items() if r.isdigit() and r != value]
        if len(roots) != 1:
            return []
        chain = [roots[0]]
        while True:  # the variable assigned from the last one, if any
            nxt = [n for n, r in rhs.items() if r == f"VAR {chain[-1]}"]
            if not nxt:
                break
            chain.append(nxt[0])
        q = question.replace(value, rhs[roots[0]])
        q = re.sub(r"\b\d+ variables are", f"{len(chain)} variables are", q)
        return [(q, " ".join(chain))]
    return []


def _largest_fit(render, count, room: int, most: int, fixed: int, guess: int) -> int:
    """An n in [0, most] with count(render(n)) <= room, near the largest: secant steps
    from ``guess`` (the bench bisects; the workers cannot afford a dozen encodings)."""
    best, n = 0, max(0, min(most, guess))
    for _ in range(5):
        if n <= best:
            break
        got = count(render(n))
        scale = (room - fixed) / max(1, got - fixed)
        if got <= room:
            best = n
            if got >= 0.96 * room or n == most:
                break
            n = min(most, int(n * scale * 0.99))
        else:
            n = int(n * scale * 0.97)
    return best


def ruler_parts(task: str, rng: random.Random, size: int, corpus: str, tok: Tok, extra: bool = False):
    """One example of a leaderboard task in at most ``size`` tokens (with <bos> and <eos>)
    as [(prompt, False), (answer, True), ...], or None when its fixed text does not fit:
    the bench's generator with this script's random stream and haystack. With ``extra``,
    further questions about the same prompt follow (``_extra_questions``) when they leave
    the haystack a sixteenth of the slot (at 512 tokens vt's second question leaves ~50)."""
    window = 4 * int(size * tok.chars_per_token) + 40_000
    if task != "cwe" and len(corpus) > window + 1000:  # the haystack reads only this far
        start = corpus.find(" ", rng.randrange(len(corpus) - window)) + 1
        corpus = corpus[start : start + window]
    count = tok.count_fast
    if task.startswith("niah"):
        render, most, answers, said, meta = ruler._niah(task, rng, corpus)
    elif task == "vt":
        render, most, answers, said, meta = ruler._vt(rng, corpus)
    elif task == "cwe":
        render, most, answers, said, meta = ruler._cwe(rng, corpus, size, count, cwe_words(size, rng))
    else:
        render, most, answers, said, meta = ruler._qa(rng, corpus, size)
    skeleton = render(0)
    fixed = count(skeleton)
    room = size - 1 - (count(said) - 1)  # <eos>, and the answer
    extras = _extra_questions(task, skeleton, rng) if extra else []
    cost = [count(q) + count(a) - 2 for q, a in extras]
    while extras and fixed + sum(cost) > room - size // 16:
        extras.pop()
        cost.pop()
    room -= sum(cost)
    if fixed > room:
        return None
    # a first guess: a word of text is about two tokens with its space; a cwe item about
    # five (number, ". ", word, space) and freq_rare items a word
    per_unit = 6 * meta["freq_rare"] if task == "cwe" else 2
    n = _largest_fit(render, count, room, most, fixed, (room - fixed) // per_unit)
    if task == "cwe" and n == 0:  # only the ten words, none rarer: not the task
        return None
    prompt = render(n)
    if task == "niah_multivalue":
        said = ", ".join(in_text_order(task, prompt, answers))
    elif task == "cwe":
        # its words are free targets, so the order written only decides which words are
        # already written when the next is asked for: a random order shows every word
        # written early, the model's favourite too (in text order, a model that had one
        # favourite common word learned to say it again after writing it; notes/
        # subword_baseline.md section 10)
        said = ", ".join(rng.sample(list(answers), len(answers)))
    parts = [(prompt, False), (said, FREE if task == "cwe" else True)]
    for q, a in extras:
        parts += [(q, False), (a, True)]
    return parts


def tasks_parts(task: str, rng: random.Random, size: int, corpus: str, tok: Tok):
    """One example of a bench task of ``tasks.py`` in at most ``size`` tokens (with <bos>
    and <eos>), or None. Its generator takes a budget in bytes: for a tokenizer other than
    bytes, the example is built, counted, and rebuilt with a smaller budget until it fits
    (as ``tasks.make_example`` does with ``count_tokens``). The old sizing with the prose
    ratio cut off most variable_tracking and every kv_lookup answer at 256 tokens."""
    opts, nq = _example_opts(task, rng)
    if tok.path is None:
        return tasks.build_parts(task, rng, size, corpus, n_queries=nq, opts=opts)
    seed = rng.getrandbits(64)  # the same plan at every budget
    budget = int(size * tok.chars_per_token * 0.95)
    for _ in range(8):
        parts = tasks.build_parts(task, random.Random(seed), budget, corpus, n_queries=nq, opts=opts)
        n = 1 + sum(tok.count_fast(t) - 1 for t, _ in parts) + 1
        if n <= size:
            return parts
        if budget <= 0:
            return None
        budget = min(budget - 1, int(budget * size / n * 0.97))
    return None


def _fitting_example(rng, weights: dict, size: int, corpus: str, tok: Tok):
    """A task drawn from ``weights`` among those allowed in a slot of ``size`` tokens,
    built to fit it; a task that does not fit is replaced by another draw, and after a
    few, nothing (the slot stays padding)."""
    names = [t for t in weights if size >= MIN_SLOT.get(t, 0)]
    if not names:
        return None
    w = [weights[t] for t in names]
    for _ in range(4):
        task = rng.choices(names, w)[0]
        if task.startswith("ruler:"):
            parts = ruler_parts(task[len("ruler:"):], rng, size, corpus, tok, extra=True)
        else:
            parts = tasks_parts(task, rng, size, corpus, tok)
        if parts is None:
            continue
        enc = []
        for t, a in parts:
            if a == FREE:  # the first token of each word free among the words not yet written
                b, free = free_targets(tok, t)
                enc.append((b, free or True))
            else:
                enc.append((tok.encode(t), a))
        if 2 + sum(len(b) for b, _ in enc) <= size:
            return enc
    return None


def make_sequence(rng: random.Random, L: int, corpus: str, tok: Tok, mixture: str = "reference",
                  task: str | None = None):
    """L+1 token ids and, per target position (entry i describes ids[i] as a target), a
    kind (0 ignore, 1 text, 2 answer, 3 an answer token free among ``free[i]``'s ids), the
    answer loss's weight and ``free`` (L+1, FREE_WIDTH; -1 pads). ``task`` (tests,
    simulations): every example of that task, no copy or text sequences."""
    new = mixture in NEW_RULES
    ids = np.full(L + 1, tok.pad, dtype=np.int32)
    kind = np.zeros(L + 1, dtype=np.int8)
    w = np.zeros(L + 1, dtype=np.float32)
    free = _no_free(L)
    # the subword model's 512 phase is for the leaderboard's tasks, not the warm-up
    short = L < 512 if new else L <= 512
    if task is None and rng.random() < (P_COPY_SHORT if short else P_COPY):
        return copy_sequence(rng, L, tok, corpus, mixture)
    if task is None and rng.random() < P_TEXT:
        span = L if tok.path is None else int(L * tok.chars_per_token * 1.5)
        start = rng.randrange(len(corpus) - span)
        start = corpus.find(" ", start) + 1
        chunk = tok.encode(corpus[start : start + span])[:L]
        ids[0] = tok.bos
        ids[1 : 1 + len(chunk)] = chunk
        kind[1 : 1 + len(chunk)] = 1
        return ids, kind, w, free
    # packed examples from 1,024 tokens on for the subword model: at 512, two slots of
    # 256 would shut out vt, the task its 512 phase is for
    if rng.random() < P_SINGLE or L < (1024 if new else 512):
        sizes = [L + 1]
    else:
        n = rng.randint(2, 4)
        between = range(256, L + 1 - 256)  # at L = 512 one cut only
        cuts = sorted(rng.sample(between, min(n - 1, len(between))))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [L + 1])]
        sizes = [s for s in sizes if s >= 200] or [L + 1]
    weights_of = {task: 1.0} if task else mixture_at(mixture, L)
    names, weights = list(weights_of), list(weights_of.values())
    pos = 0
    for i, size in enumerate(sizes):
        if new:
            # the last slot takes what is left; none reaches past the sequence, so no
            # answer is ever cut (an example that does not fit is not used)
            size = L + 1 - pos if i == len(sizes) - 1 else min(size, L + 1 - pos)
            enc = _fitting_example(rng, weights_of, size, corpus, tok)
            if enc is None:
                pos += size
                if pos >= L + 1:
                    break
                continue
        else:  # the old stream: tasks.py examples, cut where they overflow
            parts = tasks_parts(rng.choices(names, weights)[0], rng, size, corpus, tok)
            enc = [(tok.encode(t), a) for t, a in (parts or [])]
        ids[pos] = tok.bos
        p = pos + 1
        for b, is_answer in enc:
            n = min(len(b), L + 1 - p)
            ids[p : p + n] = b[:n]
            kind[p : p + n] = 2 if is_answer else 1
            if isinstance(is_answer, list):  # a list's words in any order (``free_targets``)
                for offset, allowed in is_answer:
                    if offset < n:
                        kind[p + offset] = 3
                        free[p + offset, : len(allowed)] = allowed
            if is_answer and n:
                # one example's answer weighs 1 in all under the new rules
                w[p : p + n] = 1.0 / len(b) if new else 1.0
            p += n
        if p < L + 1:
            ids[p] = tok.eos
            kind[p] = 1
            p += 1
        pos = max(p, pos + size)
        if pos >= L + 1:
            break
    return ids, kind, w, free


# ---------------------------------------------------------------------------
# Evaluation examples (teacher forced in train.py)


def teacher_forced_match(tok: Tok, name: str, answer: str, predicted) -> bool:
    """Whether the argmax predictions at an answer's positions (teacher forced) give the
    answer: every token exact, except that in a list the scorer takes in any order (cwe,
    as trained) a word may start as any word not yet written."""
    target, free = free_targets(tok, answer) if name == "ruler:cwe" else (tok.encode(answer), [])
    pred = np.asarray(predicted).reshape(-1)
    if len(pred) != len(target):
        return False
    ok = pred == target
    for offset, allowed in free:
        ok[offset] = int(pred[offset]) in allowed
    return bool(ok.all())


def make_eval_examples(ctx: int, n: int, seed: int, tok: Tok, mixture: str) -> list:
    """(name, prompt, answer) to check: the bench's tasks, and for the ruler mixture the
    leaderboard's, on the held-out book, sized in the model's tokens."""
    out = []
    if tok.path is None:
        for task in tasks.TASKS:
            out += [(task, e.prompt, e.answer) for e in tasks.make_examples(task, n, ctx, seed=seed)]
        return out
    # kv_lookup's hex keys take several tokens a character: not in the subword mixture;
    # nor, now, variable_tracking (an untrained task's 0.00 says nothing)
    for task in ("niah_multikey",) if mixture in NEW_RULES else ("niah_multikey", "variable_tracking"):
        for i in range(n):  # sized in bytes
            e = tasks.make_example(task, int(ctx * tok.chars_per_token * 0.9), seed=seed, index=i)
            out.append((task, e.prompt, e.answer))
    if mixture != "ruler":
        return out
    if ctx >= 512:  # ruler vt needs about 400 tokens: ctx - 64 = 448 holds it
        which = ruler.RULER_TASKS
    else:  # what the 256 phase trains
        which = ("cwe", "qa")
    for task in which:
        # room for the answer (cwe's fixed text takes 193 of 256 tokens: a smaller margin);
        # count_fast is exact, so these are the examples tok.count gives, 5x sooner
        for e in ruler.make_ruler_examples(task, n, ctx - min(64, ctx // 8), seed, tok.count_fast):
            answers = e.answers
            if task in ("niah_multivalue", "cwe"):  # as trained
                answers = in_text_order(task, e.prompt, answers)
            said = {"niah_multivalue": ", ", "cwe": ", ", "vt": " "}.get(task, "")
            out.append(("ruler:" + task, e.prompt, said.join(answers)))
    return out
