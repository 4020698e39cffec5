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

The data (mixtures, copy warm-up, packing, answer weights) is ``mixture.py``, which
does not need torch. ``--mixture ruler`` trains the subword model on the leaderboard's
tasks (``training/README.md``).

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
import byte_tokenizer as bt  # noqa: E402
# the data (torch-free, tested in tests/test_training_mixture.py)
from mixture import (MIXTURES, Tok, in_text_order, make_eval_examples,  # noqa: E402,F401
                     make_sequence, ruler, ruler_parts, tasks, teacher_forced_match)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the data workers fork

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


def free_target_loss(logits, allowed):
    """-log of the probability of any of ``allowed``'s ids (n, FREE_WIDTH; -1 pads, at least
    one id a row) under ``logits`` (n, vocabulary): the loss of an answer token the scorer
    takes in any order (``mixture.make_sequence``'s kind 3). With one id it is that id's
    cross-entropy."""
    logits = logits.float()
    valid = allowed >= 0
    picked = logits.gather(-1, allowed.clamp(min=0).long()).masked_fill(~valid, float("-inf"))
    return torch.logsumexp(logits, -1) - torch.logsumexp(picked, -1)


# ---------------------------------------------------------------------------
# Data: batches of fixed length built by CPU workers.

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
            # token ids, target kinds, answer-loss weights, free targets (mixture.make_sequence)
            yield tuple(torch.from_numpy(np.stack([s[i] for s in seqs])) for i in range(4))
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
        _EVAL_CACHE[key] = make_eval_examples(ctx, n, seed, tok, mixture)
    return _EVAL_CACHE[key]


@torch.no_grad()
def eval_retrieval(model, ctx, n, seed, device, amp, tok: Tok, mixture: str, batch=8):
    """Teacher-forced exact match of every answer token (argmax == greedy decoding gives
    the answer; niah_multivalue's values in the text's order, the order trained; cwe's
    words in any order, each word's first token free among those not yet written:
    ``mixture.teacher_forced_match``)."""
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
        for j, ((name, _, said), p, a) in enumerate(zip(chunk, prompts, answers)):
            got = pred[j, len(p) - 1 : len(p) - 1 + len(a)]
            res.setdefault(name, []).append(teacher_forced_match(tok, name, said, got.cpu().numpy()))
    model.train()
    return {k: sum(v) / len(v) for k, v in res.items()}


@torch.no_grad()
def eval_cwe_free(model, ctx, n, seed, device, amp, tok: Tok, mixture: str) -> dict:
    """cwe as the bench scores it: each prompt's answer generated greedily from the model's
    own words (no teacher forcing: a model that says one word again scores 1 of 10 here
    while it may pass the teacher-forced check), scored by ``ruler.ruler_score``. Empty
    where the mixture has no cwe."""
    model.eval()
    scores = []
    for name, prompt, said in _eval_examples(ctx, n, seed, tok, mixture):
        if name != "ruler:cwe" or said is None:
            continue
        prompt_ids = np.concatenate([[tok.bos], tok.encode(prompt)]).astype(np.int64)
        start, ids = len(prompt_ids), torch.from_numpy(prompt_ids)[None].to(device)
        for _ in range(len(tok.encode(said)) + 4):
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                nxt = model(ids)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
            if int(nxt) == tok.eos:
                break
        text = tok.t.decode(ids[0, start:].tolist(), skip_special_tokens=True)
        scores.append(ruler.ruler_score("cwe", text, answers=said.split(", ")))
    model.train()
    return {"ruler:cwe(free)": sum(scores) / len(scores)} if scores else {}


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
    if args.mixture == "ruler":
        ruler._vocabulary(corpus)  # cached here once, not in every forked data worker
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
            ids, kind, wts, free = next(it)
            ids = ids.to(device, non_blocking=True).long()
            kind = kind.to(device, non_blocking=True)
            wts = wts.to(device, non_blocking=True)
            free = free.to(device, non_blocking=True)
            x, y, k, w_ans = ids[:, :-1], ids[:, 1:], kind[:, 1:], wts[:, 1:]
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
            is_free = k == 3
            if is_free.any():
                ce = ce.masked_scatter(is_free, free_target_loss(logits[is_free], free[:, 1:][is_free]))
            m_txt = (k == 1).float()
            m_ans = (k >= 2).float()
            lm = (ce * m_txt).sum() / m_txt.sum().clamp(min=1)
            # the answer weights are 1 a token (--mixture reference: the per-token mean) or
            # 1/n on each answer's n tokens (ruler: the mean over answers, so one-token qa
            # answers are not drowned by long copies); each answer sums to 1, hence clamp 1
            ans = (ce * w_ans).sum() / w_ans.sum().clamp(min=1)
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
                    hit = logits.argmax(-1) == y
                    if is_free.any():  # a free target's argmax may be any of its ids
                        top = logits[is_free].argmax(-1, keepdim=True)
                        hit = hit.masked_scatter(is_free, (free[:, 1:][is_free] == top).any(-1))
                    a_acc = (hit.float() * m_ans).sum() / m_ans.sum().clamp(min=1)
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
                r.update(eval_cwe_free(model, min(L, 4096), args.eval_n, 999, device, amp, tok, args.mixture))
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
        r.update(eval_cwe_free(model, ctx, args.final_eval_n, 4321, device, amp, tok, args.mixture))
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
