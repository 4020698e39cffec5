"""Train the VeloxQuant reference model (PyTorch) and export it for mlx-lm.

A small mlx-lm ``llama`` (GQA 8/2 heads, head_dim 128) trained from scratch on
a mixture of RULER-style retrieval tasks (veloxquant/bench/tasks.py) whose
haystacks are natural text, plain text, and an induction warm-up (blocks of
random words written twice), with a context curriculum
256 -> 1024 -> 4096 -> 8192 tokens.

Reproduce (one NVIDIA H200: 185 s of training, about 3.5 minutes in all)::

    apt-get install -y bible-kjv bible-kjv-text
    python training/build_corpus.py --out training/data
    python training/train.py --corpus training/data/train.txt --out training/runs/ref

The curriculum is given in seconds of training (``--time-budget`` split by
``--phases``), so the number of steps depends on the hardware; the log prints
the steps each phase took, and ``--phase-steps`` replays exactly that plan.
Everything random is seeded by ``--seed``.

Outputs in --out: model.safetensors (float16, mlx-lm names), config.json,
tokenizer files, parity.safetensors (a fixed input and its float32 logits, for
checking the MLX port), train_log.txt, train_summary.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import bench_modules  # noqa: E402
import byte_tokenizer as bt  # noqa: E402

tasks, ruler = bench_modules.load()
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers fork


class Tok:
    """The model's tokenizer: bytes (``path`` None, the first reference model) or a
    ``tokenizer.json`` (the subword model); ``encode`` gives ids without <bos>."""

    def __init__(self, path: str | None = None):
        self.path = path
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

    def save(self, folder: Path) -> None:
        if self.path is None:
            bt.save_tokenizer(folder)
            return
        import shutil

        src = Path(self.path).parent
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copyfile(src / name, folder / name)

# ---------------------------------------------------------------------------
# Model: the same computation and parameter names as mlx_lm.models.llama.

CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 256,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 128,
    "vocab_size": bt.VOCAB_SIZE,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_traditional": False,
    "tie_word_embeddings": True,
    "attention_bias": False,
    "mlp_bias": False,
    "max_position_embeddings": 8192,
    "bos_token_id": bt.BOS_ID,
    "eos_token_id": bt.EOS_ID,
    "pad_token_id": bt.PAD_ID,
    "torch_dtype": "float16",
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(n: int, head_dim: int, base: float, device):
    # nn.RoPE(head_dim, traditional=False, base): rotate-half, pairs (i, i + d/2),
    # angle = position * base ** (-2i / d).
    inv = base ** (
        -torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim
    )
    ang = torch.arange(n, dtype=torch.float64, device=device)[:, None] * inv[None, :]
    return torch.cos(ang).float(), torch.sin(ang).float()


def apply_rope(x, cos, sin):
    # x: (B, H, L, D); cos/sin: (L, D/2)
    d2 = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :d2], xf[..., d2:]
    out = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, h, kv, hd = (
            c["hidden_size"],
            c["num_attention_heads"],
            c["num_key_value_heads"],
            c["head_dim"],
        )
        self.h, self.kv, self.hd = h, kv, hd
        self.q_proj = nn.Linear(d, h * hd, bias=False)
        self.k_proj = nn.Linear(d, kv * hd, bias=False)
        self.v_proj = nn.Linear(d, kv * hd, bias=False)
        self.o_proj = nn.Linear(h * hd, d, bias=False)

    def forward(self, x, cos, sin):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.kv, self.hd).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = self.h // self.kv  # query head i reads kv head i // rep, as in MLX
        k = (
            k[:, :, None]
            .expand(B, self.kv, rep, L, self.hd)
            .reshape(B, self.h, L, self.hd)
        )
        v = (
            v[:, :, None]
            .expand(B, self.kv, rep, L, self.hd)
            .reshape(B, self.h, L, self.hd)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.hd**-0.5)
        return self.o_proj(o.transpose(1, 2).reshape(B, L, self.h * self.hd))


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        d, m = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(d, m, bias=False)
        self.up_proj = nn.Linear(d, m, bias=False)
        self.down_proj = nn.Linear(m, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.post_attention_layernorm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList([Block(c) for _ in range(c["num_hidden_layers"])])
        self.norm = RMSNorm(c["hidden_size"], c["rms_norm_eps"])


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self._rope = (0, None, None)

    def rope(self, n, device):
        if self._rope[0] < n or self._rope[1].device != device:
            cos, sin = rope_tables(
                max(n, 8192), self.c["head_dim"], self.c["rope_theta"], device
            )
            self._rope = (cos.shape[0], cos, sin)
        return self._rope[1][:n], self._rope[2][:n]

    def forward(self, ids):
        cos, sin = self.rope(ids.shape[1], ids.device)
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        return x @ self.model.embed_tokens.weight.t().to(x.dtype)  # tied output layer


def init_weights(model: Llama, seed: int):
    g = torch.Generator().manual_seed(seed)
    n_layers = model.c["num_hidden_layers"]
    for name, p in model.named_parameters():
        if p.ndim == 1:
            continue
        std = 0.02
        if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
            std = 0.02 / math.sqrt(2 * n_layers)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


# ---------------------------------------------------------------------------
# Data: batches of fixed length built by CPU workers.

TASK_WEIGHTS = {
    "niah_single": 0.15,
    "niah_multikey": 0.3,
    "kv_lookup": 0.2,
    "variable_tracking": 0.35,
}
P_TEXT = 0.12  # plain-text sequences
P_COPY_SHORT, P_COPY = (
    0.5,
    0.08,
)  # copy (induction warm-up) sequences, at contexts <= 512 / longer
P_SINGLE = 0.6  # otherwise: one example fills the sequence, else 2-4 packed examples

# the subword model's mixture (--mixture ruler): the leaderboard's six tasks
# (veloxquant/bench/ruler.py, prefixed "ruler:") and, less often, the bench's own
MIXTURES = {
    "reference": TASK_WEIGHTS,
    "ruler": {
        "ruler:niah_single": 0.08,
        "ruler:niah_multikey": 0.14,
        "ruler:niah_multivalue": 0.14,
        "ruler:vt": 0.17,
        "ruler:cwe": 0.17,
        "ruler:qa": 0.17,
        "niah_multikey": 0.05,
        "variable_tracking": 0.08,
    },
}


def _example_opts(task, rng):
    if task == "niah_multikey":
        return {"n_keys": rng.randint(2, 8)}, rng.randint(1, 3)
    if task == "variable_tracking":
        return {"hops": rng.randint(1, 5), "chains": rng.randint(1, 3)}, rng.randint(
            1, 3
        )
    if task == "kv_lookup":
        return {}, rng.randint(1, 3)
    return {}, 1


def _random_words(rng: random.Random, n: int) -> str:
    out, size = [], 0
    while size < n:
        w = "".join(
            rng.choice("abcdefghijklmnopqrstuvwxyz0123456789")
            for _ in range(rng.randint(2, 7))
        )
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


def copy_sequence(rng: random.Random, L: int, tok: Tok):
    """Induction warm-up: blocks of random words, each written twice; the second copy is the answer."""
    ids = np.full(L + 1, tok.pad, dtype=np.int32)
    kind = np.zeros(L + 1, dtype=np.int8)
    ids[0] = tok.bos
    p = 1
    while p < L + 1 - 8:
        m = rng.randint(8, max(8, min(1024, (L + 1 - p - 3) // 2)))
        x = _random_words(rng, m)
        for chunk, k in ((x + "\n", 1), (x, 2), ("\n\n", 1)):
            b = tok.encode(chunk)
            n = min(len(b), L + 1 - p)
            ids[p : p + n] = b[:n]
            kind[p : p + n] = k
            p += n
    return ids, kind


def ruler_parts(task: str, rng: random.Random, size: int, corpus: str, tok: Tok):
    """One example of a leaderboard task in about ``size`` tokens (with <bos> and
    <eos>) as [(prompt, False), (answer, True)]: the bench's generator with this
    script's random stream and haystack, sized by two trial encodings instead of the
    bench's bisection (the data workers' time)."""
    if task != "cwe":  # a window of the books: the haystack reads only this far
        start = corpus.find(" ", rng.randrange(len(corpus) - 200_000)) + 1
        corpus = corpus[start : start + 4 * int(size * tok.chars_per_token) + 40_000]
    count = tok.count
    if task.startswith("niah"):
        render, most, answers, said, _ = ruler._niah(task, rng, corpus)
    elif task == "vt":
        render, most, answers, said, _ = ruler._vt(rng, corpus)
    elif task == "cwe":
        render, most, answers, said, _ = ruler._cwe(rng, corpus, size, count)
    else:
        render, most, answers, said, _ = ruler._qa(rng, corpus, size)
    room = size - 1 - len(tok.encode(said))
    fixed = count(render(0))
    n = max(0, min(most, room - fixed))  # a first guess: a token per unit
    for _ in range(3):
        got = count(render(n))
        if got <= room or n == 0:
            break
        n = max(0, int((n * (room - fixed) / max(1, got - fixed)) * 0.97))
    grow = count(render(n))
    if grow < room * 0.9 and n < most:  # the guess was short: scale up once
        m = min(most, int(n * (room - fixed) / max(1, grow - fixed) * 0.97))
        if count(render(m)) <= room:
            n = m
    prompt = render(n)
    if task in ("niah_multivalue", "cwe"):
        said = ", ".join(in_text_order(task, prompt, answers))
    return [(prompt, False), (said, True)]


def in_text_order(task: str, prompt: str, answers) -> list:
    """The answers of a task the scorer takes in any order (niah_multivalue, cwe) as the
    text first shows them: an order the model can know (the generator's is random)."""
    mark = " {}" if task == "niah_multivalue" else ". {} "
    return sorted(answers, key=lambda a: prompt.find(mark.format(a)) % (1 << 62))


def make_sequence(rng: random.Random, L: int, corpus: str, tok: Tok, mixture: str = "reference"):
    """L+1 token ids and, per target position, a kind: 0 ignore, 1 text, 2 answer."""
    ids = np.full(L + 1, tok.pad, dtype=np.int32)
    kind = np.zeros(L + 1, dtype=np.int8)  # kind[i] describes ids[i] as a target
    if rng.random() < (P_COPY_SHORT if L <= 512 else P_COPY):
        return copy_sequence(rng, L, tok)
    if rng.random() < P_TEXT:
        span = L if tok.path is None else int(L * tok.chars_per_token * 1.5)
        start = rng.randrange(len(corpus) - span)
        start = corpus.find(" ", start) + 1
        chunk = tok.encode(corpus[start : start + span])[:L]
        ids[0] = tok.bos
        ids[1 : 1 + len(chunk)] = chunk
        kind[1 : 1 + len(chunk)] = 1
        return ids, kind
    if rng.random() < P_SINGLE or L < 512:
        sizes = [L + 1]
    else:
        n = rng.randint(2, 4)
        cuts = sorted(rng.sample(range(256, L + 1 - 256), n - 1))
        sizes = [b - a for a, b in zip([0] + cuts, cuts + [L + 1])]
        sizes = [s for s in sizes if s >= 200] or [L + 1]
    pos = 0
    # the leaderboard's tasks need about 300 tokens of fixed text: from 1,024 tokens on
    weights_of = MIXTURES[mixture if L >= 1024 else "reference"]
    names, weights = list(weights_of), list(weights_of.values())
    for size in sizes:
        task = rng.choices(names, weights)[0]
        if task.startswith("ruler:"):
            parts = ruler_parts(task[len("ruler:"):], rng, size, corpus, tok)
        else:
            opts, nq = _example_opts(task, rng)
            budget = int(size * tok.chars_per_token * 0.95) if tok.path else size
            parts = tasks.build_parts(task, rng, budget, corpus, n_queries=nq, opts=opts)
        ids[pos] = tok.bos
        p = pos + 1
        for text, is_answer in parts:
            b = tok.encode(text)
            n = min(len(b), L + 1 - p)
            ids[p : p + n] = b[:n]
            kind[p : p + n] = 2 if is_answer else 1
            p += n
        if p < L + 1:
            ids[p] = tok.eos
            kind[p] = 1
            p += 1
        pos = max(p, pos + size)
        if pos >= L + 1:
            break
    return ids, kind


class Batches(torch.utils.data.IterableDataset):
    def __init__(self, corpus: str, L: int, B: int, seed: int, phase: int, tok: Tok,
                 mixture: str):
        self.corpus, self.L, self.B, self.seed, self.phase = corpus, L, B, seed, phase
        self.tok, self.mixture = tok, mixture

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        k = wid
        while True:  # batch k of this phase, made by worker k % nw: a fixed stream
            rng = random.Random(f"train/{self.seed}/{self.phase}/{k}")
            seqs = [make_sequence(rng, self.L, self.corpus, self.tok, self.mixture)
                    for _ in range(self.B)]
            ids = torch.from_numpy(np.stack([s[0] for s in seqs]))
            kind = torch.from_numpy(np.stack([s[1] for s in seqs]))
            yield ids, kind
            k += nw


# ---------------------------------------------------------------------------
# Export


SHARD_BYTES = 15 * 2**20


def load_weights(path: str) -> dict:
    """A model.safetensors, or every model*.safetensors of a folder."""
    from safetensors.torch import load_file

    p = Path(path)
    files = sorted(p.glob("model*.safetensors")) if p.is_dir() else [p]
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def to_mlx_state(model: Llama, dtype=torch.float16):
    return {
        k: v.detach().to("cpu", dtype).contiguous()
        for k, v in model.state_dict().items()
    }


def export(model: Llama, out: Path, tok: Tok, parity_ids=None, log=print):
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = to_mlx_state(model)
    # shards of at most SHARD_BYTES (mlx-lm loads every model*.safetensors; the device
    # returns files of up to 16 MiB)
    shards, size = [{}], 0
    for k, v in state.items():
        n = v.numel() * v.element_size()
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][k] = v
        size += n
    for old in out.glob("model*.safetensors"):
        old.unlink()
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    tok.save(out)
    (out / "special_tokens_map.json").unlink(
        missing_ok=True
    )  # optional; keeps $OUT under 8 files
    if parity_ids is not None:
        # float32 logits of the exported (float16-rounded) weights, for the MLX check
        ref = Llama(CONFIG)
        ref.load_state_dict({k: v.float() for k, v in state.items()})
        dev = next(model.parameters()).device
        ref = ref.to(dev).eval()
        with torch.no_grad(), torch.autocast(dev.type, enabled=False):
            logits = ref(torch.tensor([parity_ids], device=dev)).float().cpu()
        # the logits of the last positions, at most 1M of them (a large vocabulary's
        # file stays under the device's 16 MiB)
        logits = logits[:, -max(1, min(logits.shape[1], 2**20 // logits.shape[-1])):].contiguous()
        save_file(
            {
                "input_ids": torch.tensor([parity_ids], dtype=torch.int32),
                "logits": logits,
            },
            str(out / "parity.safetensors"),
        )
    size = sum(f.stat().st_size for f in out.glob("model*.safetensors"))
    log(f"exported to {out} ({size / 1e6:.2f} MB in {len(names)} file(s))")


# ---------------------------------------------------------------------------
# Evaluation during training (teacher forced: exact match of every answer
# token under argmax == greedy decoding gives the answer).


_EVAL_CACHE: dict = {}


def _eval_examples(ctx, n, seed, tok: Tok, mixture: str):
    """(name, prompt, answer) to check: the bench's tasks, and for the ruler mixture the
    leaderboard's, on the held-out book, sized in the model's tokens."""
    key = (ctx, n, seed, tok.path, mixture)
    if key not in _EVAL_CACHE:
        _EVAL_CACHE[key] = _make_eval_examples(ctx, n, seed, tok, mixture)
    return _EVAL_CACHE[key]


def _make_eval_examples(ctx, n, seed, tok: Tok, mixture: str):
    out = []
    if tok.path is None:
        for task in tasks.TASKS:
            out += [(task, e.prompt, e.answer) for e in tasks.make_examples(task, n, ctx, seed=seed)]
        return out
    # kv_lookup's hex keys take several tokens a character: not in the subword mixture
    for task in ("niah_multikey", "variable_tracking"):
        for i in range(n):  # sized in bytes
            e = tasks.make_example(task, int(ctx * tok.chars_per_token * 0.9), seed=seed, index=i)
            out.append((task, e.prompt, e.answer))
    if mixture == "ruler" and ctx >= 1024:
        for task in ruler.RULER_TASKS:
            for e in ruler.make_ruler_examples(task, n, ctx - 64, seed, tok.count):
                answers = e.answers
                if task in ("niah_multivalue", "cwe"):  # as trained
                    answers = in_text_order(task, e.prompt, answers)
                said = {"niah_multivalue": ", ", "cwe": ", ", "vt": " "}.get(task, "")
                out.append(("ruler:" + task, e.prompt, said.join(answers)))
    return out


@torch.no_grad()
def eval_retrieval(model, ctx, n, seed, device, amp, tok: Tok, mixture: str, batch=8):
    """Teacher-forced exact match of every answer token (argmax == greedy decoding gives
    the answer; answers the scorer takes in any order are checked in the text's order,
    the order the ruler mixture trains)."""
    model.eval()
    res: dict = {}
    examples = [e for e in _eval_examples(ctx, n, seed, tok, mixture) if e[2] is not None]
    for i in range(0, len(examples), batch):
        chunk = examples[i : i + batch]
        prompts = [np.concatenate([[tok.bos], tok.encode(p)]) for _, p, _ in chunk]
        answers = [tok.encode(a) for _, _, a in chunk]
        T = max(len(p) + len(a) for p, a in zip(prompts, answers))
        ids = torch.full((len(chunk), T), tok.pad, dtype=torch.long)
        for j, (p, a) in enumerate(zip(prompts, answers)):
            ids[j, : len(p) + len(a)] = torch.from_numpy(np.concatenate([p, a]).astype(np.int64))
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            pred = model(ids).argmax(-1)
        for j, ((name, _, _), p, a) in enumerate(zip(chunk, prompts, answers)):
            got = pred[j, len(p) - 1 : len(p) - 1 + len(a)]
            ok = bool((got == ids[j, len(p) : len(p) + len(a)]).all())
            res.setdefault(name, []).append(ok)
    model.train()
    return {k: sum(v) / len(v) for k, v in res.items()}


# ---------------------------------------------------------------------------


def parse_phases(s):
    out = []
    for item in s.split(","):
        L, frac, B = item.split(":")
        out.append((int(L), float(frac), int(B)))
    return out


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--corpus", default=str(HERE / "data" / "train.txt"))
    ap.add_argument("--out", default=str(HERE / "runs" / "ref"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--time-budget", type=float, default=185.0, help="seconds of training steps"
    )
    ap.add_argument(
        "--phases",
        default="256:0.3:512,1024:0.25:128,4096:0.3:32,8192:0.15:16",
        help="context:share_of_time:batch_size, in order",
    )
    ap.add_argument(
        "--phase-steps",
        default="",
        help="replay: steps per phase (overrides the time split)",
    )
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument(
        "--answer-weight",
        type=float,
        default=1.0,
        help="loss = mean text CE + w * mean answer CE",
    )
    ap.add_argument("--workers", type=int, default=min(12, (os.cpu_count() or 2) - 2))
    ap.add_argument("--log-every", type=int, default=150)
    ap.add_argument("--eval-every", type=float, default=40.0, help="seconds")
    ap.add_argument("--eval-n", type=int, default=16)
    ap.add_argument("--final-eval-n", type=int, default=24)
    ap.add_argument(
        "--ckpt-every", type=float, default=60.0, help="seconds; export a checkpoint"
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--final-ctx", default="4096,8192")
    ap.add_argument(
        "--amp", action="store_true", help="bf16 autocast also off CUDA (for testing)"
    )
    ap.add_argument(
        "--config",
        default="",
        help="JSON overrides of the model config (experiments only)",
    )
    ap.add_argument(
        "--init",
        default="",
        help="start from this model.safetensors instead of random weights",
    )
    ap.add_argument(
        "--tokenizer",
        default="",
        help="a tokenizer.json (subword_tokenizer.py); default: the byte tokenizer",
    )
    ap.add_argument(
        "--mixture",
        default="reference",
        choices=sorted(MIXTURES),
        help="the task mixture: the bench's tasks, or with the leaderboard's (ruler)",
    )
    args = ap.parse_args()

    t_start = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "train_log.txt", "w")

    def log(msg):
        line = f"[{time.time() - t_start:6.1f}s] {msg}"
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    amp = device.type == "cuda" or args.amp
    if amp:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    corpus = Path(args.corpus).read_text(encoding="utf-8")
    log(
        f"torch {torch.__version__} device {device} corpus {len(corpus):,} bytes args {vars(args)}"
    )

    tok = Tok(args.tokenizer or None)
    CONFIG.update(vocab_size=tok.vocab_size, bos_token_id=tok.bos, eos_token_id=tok.eos,
                  pad_token_id=tok.pad)
    if args.config:
        CONFIG.update(json.loads(args.config))
    model = Llama(CONFIG)
    init_weights(model, args.seed)
    if args.init:
        model.load_state_dict({k: v.float() for k, v in load_weights(args.init).items()})
        log(f"initialised from {args.init}")
    model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"params {n_params:,} ({n_params * 2 / 1e6:.2f} MB in float16)")

    decay = [p for n, p in model.named_parameters() if p.ndim == 2 and "embed" not in n]
    no_decay = [
        p for n, p in model.named_parameters() if not (p.ndim == 2 and "embed" not in n)
    ]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=device.type == "cuda",
    )

    phases = parse_phases(args.phases)
    fixed_steps = (
        [int(x) for x in args.phase_steps.split(",")] if args.phase_steps else None
    )
    total_steps_fixed = sum(fixed_steps) if fixed_steps else None
    parity_ids = [tok.bos] + tok.encode(
        tasks.make_example("niah_single", 1024, seed=7, depth=0.5).prompt
    ).tolist()

    sdpa_ctx = None
    if device.type == "cuda" or args.amp:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        sdpa_ctx = lambda: sdpa_kernel(
            [
                SDPBackend.FLASH_ATTENTION,
                SDPBackend.CUDNN_ATTENTION,  # noqa: E731
                SDPBackend.EFFICIENT_ATTENTION,
            ]
        )

    history, phase_steps_done, evals = [], [], []
    step, tokens_seen = 0, 0
    train_t0 = time.time()
    last_eval = last_ckpt = train_t0
    phase_end_time = 0.0

    def progress():
        if total_steps_fixed:
            return step / total_steps_fixed
        return (time.time() - train_t0) / args.time_budget

    for pi, (L, frac, B) in enumerate(phases):
        phase_end_time += frac * args.time_budget
        ds = Batches(corpus, L, B, args.seed, pi, tok, args.mixture)
        dl = torch.utils.data.DataLoader(
            ds,
            batch_size=None,
            num_workers=args.workers,
            pin_memory=device.type == "cuda",
            prefetch_factor=4 if args.workers else None,
            persistent_workers=False,
        )
        it = iter(dl)
        ph_step = 0
        acc = {"lm": 0.0, "ans": 0.0, "acc": 0.0, "n": 0}
        t_log, tok_log = time.time(), 0
        while True:
            if fixed_steps:
                if ph_step >= fixed_steps[pi]:
                    break
            elif time.time() - train_t0 >= phase_end_time:
                break
            ids, kind = next(it)
            ids = ids.to(device, non_blocking=True).long()
            kind = kind.to(device, non_blocking=True)
            x, y, k = ids[:, :-1], ids[:, 1:], kind[:, 1:]
            p = progress()
            lr = args.lr * min(1.0, (step + 1) / args.warmup)
            lr *= args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (
                1 + math.cos(math.pi * min(p, 1.0))
            )
            for g in opt.param_groups:
                g["lr"] = lr
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                if sdpa_ctx:
                    try:
                        with sdpa_ctx():
                            logits = model(x)
                    except RuntimeError as e:  # no fused kernel: let PyTorch choose
                        log(
                            f"fused attention unavailable ({str(e)[:200]}); using the default SDPA choice"
                        )
                        sdpa_ctx = None
                        logits = model(x)
                else:
                    logits = model(x)
            ce = F.cross_entropy(
                logits.float().reshape(-1, logits.shape[-1]),
                y.reshape(-1),
                reduction="none",
            ).view_as(y)
            m_txt = (k == 1).float()
            m_ans = (k == 2).float()
            lm = (ce * m_txt).sum() / m_txt.sum().clamp(min=1)
            ans = (ce * m_ans).sum() / m_ans.sum().clamp(min=1)
            loss = lm + args.answer_weight * ans
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            ph_step += 1
            tokens_seen += x.numel()
            tok_log += x.numel()
            if step % 10 == 0:
                with torch.no_grad():
                    a_acc = (
                        (logits.argmax(-1) == y).float() * m_ans
                    ).sum() / m_ans.sum().clamp(min=1)
                acc["lm"] += lm.item()
                acc["ans"] += ans.item()
                acc["acc"] += a_acc.item()
                acc["n"] += 1
            if step % args.log_every == 0 and acc["n"]:
                dt = time.time() - t_log
                rec = {
                    "step": step,
                    "ctx": L,
                    "t": round(time.time() - train_t0, 1),
                    "lr": lr,
                    "text_ce": acc["lm"] / acc["n"],
                    "answer_ce": acc["ans"] / acc["n"],
                    "answer_tok_acc": acc["acc"] / acc["n"],
                    "tok_per_s": tok_log / dt,
                }
                history.append(rec)
                log(
                    f"step {step:5d} ctx {L:5d} lr {lr:.2e} text_ce {rec['text_ce']:.3f} "
                    f"(bpb {rec['text_ce'] / math.log(2):.2f}) answer_ce {rec['answer_ce']:.3f} "
                    f"answer_tok_acc {rec['answer_tok_acc']:.3f} {rec['tok_per_s'] / 1e6:.2f}M tok/s"
                )
                acc = {"lm": 0.0, "ans": 0.0, "acc": 0.0, "n": 0}
                t_log, tok_log = time.time(), 0
            now = time.time()
            if args.eval_every and now - last_eval >= args.eval_every:
                r = eval_retrieval(model, min(L, 4096), args.eval_n, 999, device, amp, tok, args.mixture)
                evals.append({"step": step, "ctx": min(L, 4096), **r})
                log(
                    f"eval step {step} ctx {min(L, 4096)} (seed 999, n={args.eval_n}): "
                    + " ".join(f"{t}={v:.2f}" for t, v in r.items())
                )
                last_eval = time.time()
            if args.ckpt_every and now - last_ckpt >= args.ckpt_every:
                export(model, out, tok, log=log)
                last_ckpt = time.time()
        del it, dl
        phase_steps_done.append(ph_step)
        log(f"phase {pi} ctx {L} batch {B}: {ph_step} steps")

    train_time = time.time() - train_t0
    log(
        f"training done: {step} steps, {tokens_seen / 1e6:.1f}M tokens, {train_time:.0f}s; "
        f"replay with --phase-steps {','.join(map(str, phase_steps_done))}"
    )
    export(model, out, tok, parity_ids=parity_ids, log=log)

    final = {}
    for ctx in [int(c) for c in args.final_ctx.split(",") if c]:
        r = eval_retrieval(
            model, ctx, args.final_eval_n, 4321, device, amp, tok, args.mixture,
            batch=max(1, 32768 // ctx),
        )
        final[ctx] = r
        log(
            f"final eval ctx {ctx} (seed 4321, n={args.final_eval_n}): "
            + " ".join(f"{t}={v:.2f}" for t, v in r.items())
        )
    summary = {
        "args": vars(args),
        "params": n_params,
        "steps": step,
        "phase_steps": phase_steps_done,
        "tokens": tokens_seen,
        "train_seconds": train_time,
        "history": history,
        "evals": evals,
        "final_eval_teacher_forced": final,
        "total_seconds": time.time() - t_start,
        "torch": torch.__version__,
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
    }
    (out / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    log(f"all done in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
