"""The subword model's training data (training/mixture.py, no torch): every example fits
its sequence, every answer is whole and right (solved here from the sequence's own text),
the answer weights make one example weigh 1, the copy warm-up holds the tasks' token types,
the short mixture trains qa and cwe, and the byte model's stream is the one it always was
(benchmarks/notes/subword_baseline.md, section 6)."""

from __future__ import annotations

import hashlib
import random
import re
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "training"))
import mixture as M  # noqa: E402

TOKENIZER = REPO / "veloxquant" / "assets" / "reference_subword" / "tokenizer.json"
LENGTHS = (256, 512, 1024, 4096)
TASKS = ["ruler:" + t for t in M.ruler.RULER_TASKS] + list(M.tasks.TASKS)


@pytest.fixture(scope="module")
def tok():
    return M.Tok(str(TOKENIZER))


@pytest.fixture(scope="module")
def corpus():
    return M.tasks.load_default_filler()  # Acts: the training books are not in the repo


def _decode(tok, ids) -> str:
    return tok.t.decode([int(i) for i in ids], skip_special_tokens=False)


# --- the answer each question asks for, read from the text before it -------------------

_NEEDLE = r"The special magic number for {} is: (\d+)\."
_VAR = re.compile(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.")
_FACT = re.compile(r"(\w+) keeps the (\w+) in ([A-Z][a-z]+(?: Falls)?)\.")


def _solve(text: str):
    """(task, expected answer, the references the bench scores) for the question that
    ``text`` ends with."""
    if m := re.search(r"The special magic number for (\S+) is: $", text):
        (v,) = re.findall(_NEEDLE.format(re.escape(m[1])), text)
        return "niah", v, [v]
    if m := re.search(r"The special magic numbers for (\S+) are: $", text):
        vs = re.findall(_NEEDLE.format(re.escape(m[1])), text)
        return "niah_multivalue", ", ".join(vs), vs
    if m := re.search(r"(\d+) variables are assigned the value (\d+), they are: $", text):
        rhs = dict(_VAR.findall(text))
        chain = [n for n, r in rhs.items() if r == m[2]]
        while nxt := [n for n, r in rhs.items() if r == f"VAR {chain[-1]}"]:
            chain += nxt
        assert len(chain) == int(m[1])
        return "vt", " ".join(chain), chain
    if text.endswith("appear most often in the list are: "):
        listed = text[text.rindex("often.\n\n"): text.rindex("\n\nQuestion")]
        items = re.findall(r"\d+\. ([a-z]+)", listed)
        counts = Counter(items).most_common()
        n = int(re.findall(r"What are the (\d+) most common words", text)[-1])
        assert counts[n - 1][1] > counts[n][1]  # the n are well defined
        top = {w for w, _ in counts[:n]}
        first = [w for w in dict.fromkeys(items) if w in top]  # the text's order (trained: any)
        return "cwe", ", ".join(first), first
    if m := re.search(r"Answer: (\w+) keeps the (\w+) in $", text):
        (town,) = [t for p, th, t in _FACT.findall(text) if (p, th) == (m[1], m[2])]
        return "qa", town, [town]
    if m := re.search(r"Answer: VAR ([A-Z]{5}) = $", text):
        rhs, steps, cur = dict(_VAR.findall(text)), [], m[1]
        while not rhs[cur].isdigit():
            steps.append(rhs[cur])
            cur = rhs[cur][4:]
        return "variable_tracking", " = ".join(steps + [rhs[cur]]), None
    if m := re.search(r'Answer: "([0-9a-f]{4}-[0-9a-f]{4})": "$', text):
        (v,) = re.findall(rf'"{m[1]}": "([0-9a-f]{{4}}-[0-9a-f]{{4}})"', text)
        return "kv_lookup", v, None
    raise AssertionError(f"no known question at the end of {text[-200:]!r}")


def _runs(mask):
    """(start, end) of each run of True."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return list(zip(edges[::2], edges[1::2]))


def _check_examples(tok, ids, kind, w):
    """Every example (from its <bos>) ends with <eos> inside the sequence, and each answer
    run is exactly the answer its question asks for and weighs 1. Returns the tasks of
    the answers seen, one entry per answer run."""
    seen = []
    assert not w[kind < 2].any()
    starts = list(np.flatnonzero(ids == tok.bos)) + [len(ids)]
    for a, b in zip(starts, starts[1:]):
        runs = [(s + a, e + a) for s, e in _runs(kind[a:b] >= 2)]
        if not runs:
            continue
        eos = np.flatnonzero(ids[a:b] == tok.eos)
        assert len(eos) == 1 and a + eos[0] >= runs[-1][1], "an example runs past the sequence"
        for s, e in runs:
            task, expected, refs = _solve(_decode(tok, ids[a + 1 : s]))
            got = _decode(tok, ids[s:e])
            if task == "cwe":  # its words in an order drawn per example
                assert sorted(got.split(", ")) == sorted(expected.split(", ")), (task, got, expected)
            else:
                assert got == expected, (task, got, expected)
            assert list(ids[s:e]) == list(tok.encode(got))  # whole: not cut
            if refs is not None:
                scored = {"niah": "niah_single"}.get(task, task)
                assert M.ruler.ruler_score(scored, got, answers=refs) == 1.0
            assert abs(float(w[s:e].sum()) - 1.0) < 1e-5 and np.ptp(w[s:e]) < 1e-6
            seen.append(task)
    return seen


@pytest.mark.parametrize("L", LENGTHS)
def test_every_task_fits_and_every_answer_is_whole_and_right(tok, corpus, L):
    n = {256: 5, 512: 3, 1024: 2, 4096: 1}[L]
    for task in TASKS:
        rng = random.Random(f"test/{task}/{L}")
        answers = []
        for _ in range(n):
            ids, kind, w, free = M.make_sequence(rng, L, corpus, tok, "ruler", task=task)
            assert ids.shape == kind.shape == w.shape == (L + 1,)
            answers += _check_examples(tok, ids, kind, w)
        if task == "ruler:vt" and L < M.MIN_SLOT[task]:
            assert not answers  # skipped, never cut
        else:
            assert answers, (task, L)


@pytest.mark.parametrize("L", (512, 1024))
def test_qa_and_vt_ask_more_than_the_bench_question(tok, corpus, L):
    per_example = {"ruler:qa": [], "ruler:vt": []}
    for task in per_example:
        rng = random.Random(f"extra/{task}")
        for _ in range(8):
            ids, kind, w, free = M.make_sequence(rng, L, corpus, tok, "ruler", task=task)
            starts = list(np.flatnonzero(ids == tok.bos)) + [len(ids)]
            for a, b in zip(starts, starts[1:]):
                if (k := len(_runs(kind[a:b] == 2))):
                    per_example[task].append(k)
    assert max(per_example["ruler:qa"]) > 1 and min(per_example["ruler:qa"]) >= 1
    assert max(per_example["ruler:qa"]) <= 1 + M.QA_EXTRA_MAX
    assert Counter(per_example["ruler:vt"])[2] >= len(per_example["ruler:vt"]) // 2  # the distractor's


def test_the_mixtures_sequences_fit_and_the_256_one_trains_qa_and_cwe(tok, corpus):
    for L, n in ((256, 120), (1024, 12)):
        rng = random.Random(f"mix/{L}")
        seen = Counter()
        for _ in range(n):
            ids, kind, w, free = M.make_sequence(rng, L, corpus, tok, "ruler")
            if tok.eos in ids:  # task examples (copy and text sequences have no <eos>)
                seen.update(_check_examples(tok, ids, kind, w))
            else:  # copy or text: the copy's answer is one example
                assert float(w.sum()) == pytest.approx(1.0 if (kind == 2).any() else 0.0, abs=1e-5)
        if L == 256:
            assert seen["qa"] and seen["cwe"] and seen["niah"]
            assert not (seen["vt"] or seen["variable_tracking"] or seen["kv_lookup"])
        else:
            assert seen["vt"] and seen["qa"] and seen["cwe"]
            assert not (seen["variable_tracking"] or seen["kv_lookup"])


def test_copy_warmup_holds_the_tasks_token_types(tok, corpus):
    text = ""
    rng = random.Random("copy")
    for _ in range(4):
        ids, kind, w, free = M.copy_sequence(rng, 256, tok, corpus, "ruler")
        text += _decode(tok, ids[kind == 2]) + " "
        assert float(w.sum()) == pytest.approx(1.0, abs=1e-5)
    words = set(text.split())
    assert len([x for x in words if re.fullmatch(r"[A-Z]{5}", x)]) > 5
    assert "VAR" in words
    for pool in (M.ruler._TOWNS, M.ruler._NAMES, M.ruler._THINGS):
        assert words & {p.split()[0] for p in pool}
    assert len(words & set(M.ruler._vocabulary(corpus)) - set(M.ruler._THINGS)) > 5
    # the byte model's warm-up is what it was: lower case and digits, a token weighs 1
    ids, kind, w, free = M.copy_sequence(random.Random("copy"), 256, M.Tok(None), corpus)
    assert re.fullmatch(r"[a-z0-9 ]+", bytes(ids[kind == 2].astype(np.uint8)).decode())
    assert (w == (kind == 2)).all()


def test_the_byte_models_stream_is_unchanged(corpus):
    # the hash of the same draws under train.py before mixture.py existed (torch stubbed)
    tok = M.Tok(None)
    h = hashlib.sha256()
    for L, n in ((256, 40), (1024, 12), (4096, 4)):
        rng = random.Random(f"golden/{L}")
        for _ in range(n):
            ids, kind, w, free = M.make_sequence(rng, L, corpus, tok, "reference")
            assert (w == (kind == 2)).all()  # the per-token mean, as before
            h.update(ids.tobytes())
            h.update(kind.tobytes())
    assert h.hexdigest() == "1126b58e270f0952013e4bb8302e23bb4b87d1d27190a4291d7a2a3326ab0263"


def test_the_stream_is_a_function_of_the_seed(tok, corpus):
    def draw(seed):
        rng = random.Random(seed)
        return [M.make_sequence(rng, 512, corpus, tok, "ruler") for _ in range(6)]

    a, b, c = draw("s/1"), draw("s/1"), draw("s/2")
    assert all((x == y).all() for s, t in zip(a, b) for x, y in zip(s, t))
    assert any((x != y).any() for s, t in zip(a, c) for x, y in zip(s, t))


def test_fast_count_is_the_tokenizers_count(tok, corpus):
    rng = random.Random("count")
    texts = [M._task_words(rng, 400, M.ruler._vocabulary(corpus)), corpus[:5000]]
    for task in ("qa", "vt", "cwe", "niah_multivalue"):
        texts += [t for t, _ in M.ruler_parts(task, rng, 700, corpus, tok, extra=True)]
    texts += [t for t, _ in M.tasks_parts("kv_lookup", rng, 300, corpus, tok)]
    for t in texts:
        assert tok.count_fast(t) == tok.count(t)


def test_the_checks_during_training_cover_the_leaderboard_from_512(tok):
    names = lambda ctx: {e[0] for e in M.make_eval_examples(ctx, 1, 999, tok, "ruler")}  # noqa: E731
    assert names(256) == {"niah_multikey", "ruler:qa", "ruler:cwe"}
    assert names(512) == {"niah_multikey"} | {"ruler:" + t for t in M.ruler.RULER_TASKS}
    for name, prompt, answer in M.make_eval_examples(512, 1, 999, tok, "ruler"):
        if name.startswith("ruler:"):
            assert tok.count(prompt) + len(tok.encode(answer)) <= 512


# --- cwe's words in any order (kind 3: the note's section 6, item 8) ----------------------


def test_cwe_frees_each_listed_words_first_token_among_the_words_not_yet_written(tok, corpus):
    checked = 0
    for L in (256, 1024):
        rng = random.Random(f"free/{L}")
        for _ in range(3):
            ids, kind, w, free = M.make_sequence(rng, L, corpus, tok, "ruler", task="ruler:cwe")
            assert free.shape == (L + 1, M.FREE_WIDTH)
            assert (free[kind != 3] == -1).all()
            for s, e in _runs(kind >= 2):
                words = _decode(tok, ids[s:e]).split(", ")
                firsts = [int(tok.encode(x)[0]) for x in words]
                at = s + np.flatnonzero(kind[s:e] == 3)
                # one free token a word, at its first token (fewer words in short slots: cwe_words)
                assert len(at) == len(words) == len(set(words)) and len(words) in (3, 5, 10)
                for j, i in enumerate(at):
                    assert _decode(tok, ids[i:e]).startswith(words[j])
                    allowed = [int(x) for x in free[i] if x >= 0]
                    assert allowed == list(dict.fromkeys(firsts[j:]))  # the words from this one on
                    assert int(ids[i]) in allowed
                checked += 1
    assert checked >= 6
    # the other tasks' answers are exact targets
    ids, kind, w, free = M.make_sequence(random.Random("qa"), 512, corpus, tok, "ruler", task="ruler:qa")
    assert not (kind == 3).any() and (free == -1).all()


def test_cwe_asks_short_slots_for_fewer_words_listed_far_more_often_than_the_others(tok, corpus):
    """Ten common words leave each listed twice against the other words' once below 1,024
    tokens; training's smaller instances (``cwe_words``) ask for fewer, each listed at least
    ``ratio`` times as often as any other word, and the bench's ten from 2,048 tokens on."""
    for size, counts, ratio in ((256, {3}, 2), (512, {3, 5}, 3), (1024, {5, 10}, 5), (4096, {10}, 10)):
        asked = set()
        for k in range(8):
            parts = M.ruler_parts("cwe", random.Random(f"curriculum/{size}/{k}"), size, corpus, tok)
            prompt, words = parts[0][0], parts[1][0].split(", ")
            listed = Counter(re.findall(r"\d+\. (\w+)", prompt))
            assert f"What are the {len(words)} most common words" in prompt
            assert sorted(words) == sorted(w for w, c in listed.items() if c == max(listed.values()))
            least_common = min(listed[w] for w in words)
            assert all(least_common >= ratio * c for w, c in listed.items() if w not in words), size
            asked.add(len(words))
        assert asked == counts, size


def test_cwe_writes_its_common_words_in_a_random_order_not_the_texts(tok, corpus):
    """Each cwe answer is the ten most common words of its list, each once; the order is
    drawn per example (the text's order only by chance, 1 in 10!), so that the free targets
    see every word among those already written."""
    in_text_order = []
    for k in range(12):
        parts = M.ruler_parts("cwe", random.Random(f"order/{k}"), 2048, corpus, tok)
        prompt, said = parts[0][0], parts[1][0]
        listed = Counter(re.findall(r"\d+\. (\w+)", prompt))
        common = sorted(w for w, c in listed.items() if c == max(listed.values()))
        words = said.split(", ")
        assert sorted(words) == common and len(common) == 10
        in_text_order.append(words == M.in_text_order("cwe", prompt, words))
    assert sum(in_text_order) <= 2  # in text order, all 12 would be


def test_teacher_forced_match_takes_cwes_words_in_any_order_and_nothing_else(tok):
    words = ["gentle", "apple", "river", "stone", "candle", "mirror", "tiger", "window", "basket", "orange"]
    said = ", ".join(words)
    target = tok.encode(said)
    assert M.teacher_forced_match(tok, "ruler:cwe", said, target)
    _, free = M.free_targets(tok, said)
    offsets = [o for o, _ in free]
    # the first word written as the fourth (its first token: still a word not yet written)
    pred = target.copy()
    pred[offsets[0]] = tok.encode("stone")[0]
    assert M.teacher_forced_match(tok, "ruler:cwe", said, pred)
    # a word already written, or none of the ten, is wrong
    for wrong in ("gentle", "zebra"):
        pred = target.copy()
        pred[offsets[3]] = tok.encode(wrong)[0]
        assert not M.teacher_forced_match(tok, "ruler:cwe", said, pred)
    # a separator or a continuation token is exact, and other tasks are exact everywhere
    pred = target.copy()
    pred[offsets[1] - 1] = tok.encode("stone")[0]
    assert not M.teacher_forced_match(tok, "ruler:cwe", said, pred)
    pred = target.copy()
    pred[offsets[0]] = tok.encode("stone")[0]
    assert not M.teacher_forced_match(tok, "ruler:niah_multivalue", said, pred)


def test_free_target_loss_is_minus_log_of_the_allowed_mass():
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "training"))
    import train as T

    logits = torch.randn(3, 50, dtype=torch.float64)
    allowed = torch.tensor([[4, 9, 17, -1], [7, -1, -1, -1], [1, 2, 3, 49]])
    got = T.free_target_loss(logits, allowed)
    p = torch.softmax(logits, -1)
    want = torch.stack([-torch.log(p[i, [a for a in row.tolist() if a >= 0]].sum()) for i, row in enumerate(allowed)])
    assert torch.allclose(got.double(), want, atol=1e-5)
    ce = torch.nn.functional.cross_entropy(logits, torch.tensor([0, 7, 0]), reduction="none")
    assert torch.allclose(got[1].double(), ce[1], atol=1e-6)  # one id: its cross-entropy


def test_cwe_free_run_scores_a_repeated_word_as_the_bench_does(tok):
    """The training log's free-run cwe check generates from the model's own words: a model
    that writes the ten words scores 1, one that writes its first word ten times 0.1 (the
    bench's score), although that one writes a common word at every word start."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "training"))
    import train as T

    ((_, prompt, said),) = [e for e in T._eval_examples(512, 1, 7, tok, "ruler") if e[0] == "ruler:cwe"]
    words = said.split(", ")
    start = 1 + len(tok.encode(prompt))

    class Scripted(torch.nn.Module):  # says ``text`` after the prompt, one token a call
        def __init__(self, text):
            super().__init__()
            self.says = list(tok.encode(text)) + [tok.eos]

        def forward(self, ids):
            logits = torch.zeros(ids.shape[0], ids.shape[1], tok.vocab_size)
            logits[:, -1, self.says[min(ids.shape[1] - start, len(self.says) - 1)]] = 1.0
            return logits

    def score(text):
        (value,) = T.eval_cwe_free(Scripted(text), 512, 1, 7, torch.device("cpu"), False, tok, "ruler").values()
        return value

    assert score(", ".join(reversed(words))) == 1.0
    assert score(", ".join([words[0]] * 10)) == 0.1
