"""The subword tokenizer of the second reference model (Hugging Face ``tokenizers``).

A byte-level BPE whose merges are learned from the training books plus the task
templates, with rules of our own so that what the RULER-style tasks ask about is short
in tokens and has one spelling in tokens wherever it appears:

* digits are cut into groups of at most three from the left, and every group of one to
  three digits is one token (1,110 of them, with the merges that reach each from any
  order): a 7-digit needle value is three tokens, a 5-digit one two. (Groups of four, a
  7-digit value in two tokens, were tried first: in 470 s of training on the H200 the
  model never learned to copy the 10,000 four-digit tokens, each seen a few dozen times,
  while it copied the three-digit ones; ``training/README.md``.)
* a word may carry the hyphen in front of it (``-cat``), so with merges learned from the
  tasks' keys an ``adjective-noun`` key is two tokens;
* whitespace is never merged into a word: a space is a token of its own. With GPT-2's
  ``Ġword`` tokens a prompt ending in a space (RULER's answer prefixes do: ``... in ``)
  asks for the answer's spaceless spelling, a different token from the one in the
  context, and the model has to map one to the other for every name it copies (the first
  run could not: ``Westmoor`` came back as ``Thestmoor``).

Specials: ``<bos>`` = 0 (added in front by the post-processor), ``<eos>`` = 1,
``<pad>`` = 2. The decoder is a ``Sequence`` holding the ``ByteLevel`` decoder, which
makes mlx-lm stream with its naive detokenizer (see the byte model's card for why).
"""

from __future__ import annotations

import itertools
import json
import random
import re
import sys
from pathlib import Path

BOS, EOS, PAD = "<bos>", "<eos>", "<pad>"
SPECIALS = (BOS, EOS, PAD)
BPE_MERGES = 6000  # merges learned from text, besides the digit groups'
MAX_DIGITS = 3

# digit groups | a word, maybe after a hyphen | other symbols | whitespace
SPLIT = r"\d{1,3}|\p{L}+|-\p{L}+|'\p{L}+|[^\s\p{L}\p{N}]+|\s+"

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": BOS,
    "eos_token": EOS,
    "pad_token": PAD,
    "model_max_length": 1048576,
    "clean_up_tokenization_spaces": False,
}


def _empty_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.Sequence([decoders.ByteLevel()])
    return tok


def task_text(n_examples: int = 3000, seed: int = 0) -> list[str]:
    """Sentences in the tasks' own templates (keys, variable names, questions), so the
    merges know them: generated from the task generators with a training stream."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench_modules

    tasks, ruler = bench_modules.load()

    rng = random.Random(f"tokenizer/{seed}")
    out = []
    # every word the generators draw from, often enough to be merged whole
    for word in tasks._ADJECTIVES + ruler._NAMES + ruler._TOWNS + ruler._THINGS:
        out += [f" {word}"] * 50
    for word in tasks._NOUNS:
        out += [f" {word}", f"-{word}"] * 50
    for i in range(n_examples):
        key = f"{rng.choice(tasks._ADJECTIVES)}-{rng.choice(tasks._NOUNS)}"
        out.append(f"The special magic number for {key} is: {rng.randrange(10**6, 10**7)}.")
        out.append(f"Question: What is the special magic number for {key}?\n"
                   f"Answer: The special magic number for {key} is: ")
        out.append(f"{rng.choice(ruler._NAMES)} keeps the {rng.choice(ruler._THINGS)} in "
                   f"{rng.choice(ruler._TOWNS)}.")
    for name in ("Memorize the special magic numbers hidden in this text.",
                 "Memorize and track the chain(s) of variable assignment hidden in this text.",
                 "Question: Find all variables that are assigned the value",
                 "Answer: According to the chain(s) of variable assignment in the text above,",
                 "Below is a numbered list of words. Memorize the ones that appear most often.",
                 "Question: What are the 10 most common words in the above list?",
                 "Answer: The top 10 words that appear most often in the list are:",
                 "Answer the question based on the given documents. Document",
                 "Question: In which town does", "Answer:"):
        out += [name] * 200
    return out


def _digit_groups():
    for n in range(1, MAX_DIGITS + 1):
        for t in itertools.product("0123456789", repeat=n):
            yield "".join(t)


def build_tokenizer(corpus: str, merges: int = BPE_MERGES):
    """Learn the merges from ``corpus`` (and the task templates), then add every digit
    group with the merges that reach it."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = _empty_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=len(SPECIALS) + len(alphabet) + merges, special_tokens=list(SPECIALS),
        initial_alphabet=alphabet, min_frequency=2, show_progress=False)
    # digits carry no learned merges: the groups below are all of them
    paragraphs = [p for p in corpus.split("\n") if p.strip()] + task_text()
    tok.train_from_iterator((re.sub(r"\d+", " ", p) for p in paragraphs), trainer=trainer)
    spec = json.loads(tok.to_str())
    vocab, merge_list = spec["model"]["vocab"], spec["model"]["merges"]
    merge_list = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in merge_list]
    known = set(merge_list)
    for group in _digit_groups():
        if group not in vocab:
            vocab[group] = len(vocab)
        for cut in range(1, len(group)):  # every order of merging ends at the group
            pair = (group[:cut], group[cut:])
            if len(group) > 1 and pair not in known:
                merge_list.append(pair)
                known.add(pair)
    spec["model"]["merges"] = [list(m) for m in merge_list]
    # specials keep ids 0-2: the trainer puts them first
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                   {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}},
                 {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": BOS, "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [vocab[BOS]], "tokens": [BOS]}},
    }
    out = Tokenizer.from_str(json.dumps(spec))
    assert [out.token_to_id(s) for s in SPECIALS] == [0, 1, 2]
    return out


def save_tokenizer(tok, folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(TOKENIZER_CONFIG, indent=2) + "\n")


def main():
    import argparse

    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", default=str(Path(__file__).parent / "data" / "train.txt"))
    ap.add_argument("--out", default=str(Path(__file__).parent / "runs" / "subword_tokenizer"))
    ap.add_argument("--merges", type=int, default=BPE_MERGES)
    args = ap.parse_args()
    corpus = Path(args.corpus).read_text(encoding="utf-8")
    tok = build_tokenizer(corpus, args.merges)
    save_tokenizer(tok, args.out)
    sample = "The special magic number for wet-cat is: 1234567."
    enc = tok.encode(sample)
    print(f"vocabulary {tok.get_vocab_size():,}; {sample!r} -> {enc.tokens}")


if __name__ == "__main__":
    main()
