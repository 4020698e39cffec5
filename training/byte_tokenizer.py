"""The reference model's byte-level tokenizer (Hugging Face ``tokenizers``).

Token id == UTF-8 byte value (0..255); three special tokens follow:
``<bos>`` = 256, ``<eos>`` = 257, ``<pad>`` = 258. The model's embedding has
264 rows (a multiple of 8); ids 259..263 are never produced.

The tokenizer is a BPE model with the 256 byte symbols of the GPT-2 byte-level
alphabet and no merges, behind a byte-level pre-tokenizer without the split
regex, so every byte becomes exactly one token. Encoding adds ``<bos>`` in
front (post-processor), as the model was trained with.
"""

from __future__ import annotations

import json
from pathlib import Path

BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
SPECIALS = ("<bos>", "<eos>", "<pad>")
VOCAB_SIZE = 264  # embedding rows (259 used)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(0xA1, 0xAC + 1))
        + list(range(0xAE, 0xFF + 1))
    )
    chars = list(keep)
    n = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, (chr(c) for c in chars)))


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    table = _bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=False, use_regex=False
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    assert [tok.token_to_id(s) for s in SPECIALS] == [BOS_ID, EOS_ID, PAD_ID]
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", BOS_ID)]
    )
    return tok


TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<bos>",
    "eos_token": "<eos>",
    "pad_token": "<pad>",
    "model_max_length": 1048576,
    "clean_up_tokenization_spaces": False,
}


def save_tokenizer(folder: str | Path) -> None:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    build_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(TOKENIZER_CONFIG, indent=2) + "\n"
    )
    special = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>"}
    (folder / "special_tokens_map.json").write_text(
        json.dumps(special, indent=2) + "\n"
    )


def encode(text: str) -> list[int]:
    """What the tokenizer produces, without the library: <bos> + UTF-8 bytes."""
    return [BOS_ID] + list(text.encode("utf-8"))


if __name__ == "__main__":
    import sys

    save_tokenizer(sys.argv[1] if len(sys.argv) > 1 else ".")
