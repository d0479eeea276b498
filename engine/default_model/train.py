"""Train the embedded default model: a tiny Llama on the Python stdlib.

    python -m splitserve.engine.default_model.train [--out DIR] [--minutes M] [--seed S]

Pipeline: stdlib corpus (``corpus.py``) -> byte-level BPE (``tokenizer.py``)
-> ``LlamaForCausalLM`` trained on next-token prediction -> ``save_pretrained``
in ``ModelShape.save_dtype``. Runs on one CPU thread (matmuls under bf16
autocast, float32 master weights); the result is a pure function of (stdlib on
disk, seed, number of steps, torch build), so rebuilding with the same
arguments in the same environment reproduces the files byte for byte.

``--minutes`` is turned into a step count with ``STEPS_PER_MINUTE`` (measured
on the machine the committed files were built on) rather than by watching the
clock, which would make the result depend on machine load.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from splitserve.engine.default_model import FILES_DIR, REQUIRED_FILES
from splitserve.engine.default_model.corpus import Corpus, build_corpus
from splitserve.engine.default_model.evaluate import greedy, held_out_loss
from splitserve.engine.default_model.tokenizer import (
    MODEL_MAX_LEN,
    render_chat,
    save_tokenizer,
    special_token_ids,
    train_tokenizer,
)

OUTPUT_FILES = (*REQUIRED_FILES, "generation_config.json", "train_summary.json")

STEPS_PER_MINUTE = 120
"""Optimizer steps per minute of one shared EPYC (Zen 4, AVX512-BF16) core at the
default shape, leaving room for corpus and tokenizer building (about 30 s)."""


@dataclass(frozen=True)
class ModelShape:
    """Architecture of the default model; everything else follows Llama defaults."""

    vocab_size: int = 3072
    """BPE vocabulary including the 7 special tokens."""
    hidden_size: int = 192
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    """Fewer than ``num_heads`` so that the default model exercises GQA."""
    intermediate_size: int = 512
    max_position_embeddings: int = MODEL_MAX_LEN
    rope_theta: float = 10000.0
    save_dtype: str = "bfloat16"
    """dtype of the saved weights (training runs in float32)."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size!r} not divisible by num_heads {self.num_heads!r}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads!r} not divisible by num_kv_heads {self.num_kv_heads!r}"
            )
        if self.save_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"save_dtype must be float16, bfloat16 or float32, got {self.save_dtype!r}")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; ``num_steps`` fixes the run, not the clock."""

    num_steps: int
    seed: int = 0
    batch_size: int = 16
    seq_len: int = 256
    """Tokens per training window (windows are cut at random offsets of the token stream)."""
    peak_lr: float = 3e-3
    min_lr_ratio: float = 0.1
    """Cosine decays to ``peak_lr * min_lr_ratio``."""
    num_warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    max_corpus_chars: int = 8_000_000
    autocast_dtype: str | None = "bfloat16"
    """Matmul dtype of forward/backward (weights and AdamW stay float32); bf16 halves
    step time on CPUs with AVX512-BF16 or AMX. None trains in plain float32."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps!r}")
        if not 0 < self.seq_len <= MODEL_MAX_LEN:
            raise ValueError(f"seq_len must be in (0, {MODEL_MAX_LEN}], got {self.seq_len!r}")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size!r}")
        if self.autocast_dtype not in (None, "bfloat16", "float16"):
            raise ValueError(f"autocast_dtype must be None, bfloat16 or float16, got {self.autocast_dtype!r}")


def build_model(shape: ModelShape, special_ids: dict[str, int]):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rope_theta=shape.rope_theta,
        tie_word_embeddings=True,
        bos_token_id=special_ids["<s>"],
        eos_token_id=special_ids["</s>"],
        pad_token_id=special_ids["<pad>"],
    )
    return LlamaForCausalLM(config)


def encode_corpus(corpus: Corpus, tokenizer) -> torch.Tensor:
    """One token stream: ``<s> doc </s>`` per code doc, then the rendered chats.

    Shape: [num_tokens], int64.
    """
    eos_id = tokenizer.token_to_id("</s>")
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(list(corpus.code_docs)):
        ids.extend(encoding.ids)  # the post-processor already put <s> in front
        ids.append(eos_id)
    chat_texts = [render_chat(chat) for chat in corpus.chat_docs]
    for encoding in tokenizer.encode_batch(chat_texts, add_special_tokens=False):
        ids.extend(encoding.ids)  # the template carries <s> ... </s>
    return torch.tensor(ids, dtype=torch.long)


def lr_lambda(config: TrainConfig):
    def factor(step: int) -> float:
        if step < config.num_warmup_steps:
            return (step + 1) / config.num_warmup_steps
        progress = (step - config.num_warmup_steps) / max(1, config.num_steps - config.num_warmup_steps)
        cosine = 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return config.min_lr_ratio + (1.0 - config.min_lr_ratio) * cosine

    return factor


def train_loop(model, stream: torch.Tensor, config: TrainConfig) -> list[float]:
    """Run ``config.num_steps`` AdamW steps; returns the loss of each step."""
    from tqdm import tqdm

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # RMSNorm gains
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.peak_lr,
        betas=(0.9, 0.95),
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    generator = torch.Generator().manual_seed(config.seed)
    offsets = torch.arange(config.seq_len)
    autocast_dtype = None if config.autocast_dtype is None else getattr(torch, config.autocast_dtype)
    losses: list[float] = []
    model.train()
    progress = tqdm(range(config.num_steps), desc="train", unit="step", file=sys.stdout)
    for _ in progress:
        starts = torch.randint(
            0, stream.numel() - config.seq_len, (config.batch_size, 1), generator=generator
        )
        batch = stream[starts + offsets]  # [batch_size, seq_len]
        with torch.autocast("cpu", dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        progress.set_postfix(
            loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", lr=f"{scheduler.get_last_lr()[0]:.2e}"
        )
    model.eval()
    return losses


def run(out_dir: Path, config: TrainConfig, shape: ModelShape = ModelShape()) -> dict:
    """Build corpus, tokenizer and model, train, save to ``out_dir``; returns a summary."""
    torch.set_num_threads(1)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core, and a fixed merge order
    torch.manual_seed(config.seed)
    torch.use_deterministic_algorithms(True, warn_only=True)

    corpus = build_corpus(config.max_corpus_chars)
    print(
        f"corpus: {len(corpus.code_docs)} modules, {corpus.num_code_chars / 1e6:.2f} M chars, "
        f"{len(corpus.chat_docs)} docstring chats"
    )
    chat_texts = [render_chat(chat) for chat in corpus.chat_docs]
    tokenizer = train_tokenizer(list(corpus.code_docs) + chat_texts, shape.vocab_size)
    special_ids = special_token_ids(tokenizer)
    stream = encode_corpus(corpus, tokenizer)
    print(
        f"tokens: {stream.numel() / 1e6:.2f} M ({corpus.num_code_chars / stream.numel():.2f} chars/token), "
        f"vocab {tokenizer.get_vocab_size()}"
    )

    model = build_model(shape, special_ids)
    num_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {num_params / 1e6:.2f} M params, {config.num_steps} steps of "
        f"{config.batch_size}x{config.seq_len} tokens"
    )
    started = time.monotonic()
    losses = train_loop(model, stream, config)
    train_seconds = time.monotonic() - started

    fp32_loss = held_out_loss(model, tokenizer)
    model.to(getattr(torch, shape.save_dtype))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    save_tokenizer(tokenizer, out_dir)
    # save_pretrained leaves the weights owner-only; this is package data.
    for name in OUTPUT_FILES:
        if (out_dir / name).is_file():
            (out_dir / name).chmod(0o644)
    summary = {
        "seed": config.seed,
        "num_steps": config.num_steps,
        "train_config": asdict(config),
        "model_shape": asdict(shape),
        "num_params": num_params,
        "num_train_tokens": stream.numel(),
        "final_train_loss": sum(losses[-20:]) / len(losses[-20:]),
        "held_out_loss_fp32": fp32_loss,
        "held_out_loss_saved": held_out_loss(model, tokenizer),
        "uniform_loss": math.log(shape.vocab_size),
    }
    # No timings in the file: it must rebuild byte for byte.
    (out_dir / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
    summary["train_seconds"] = train_seconds
    summary["sample_def"] = greedy(model, tokenizer, "def ")
    chat_prompt = render_chat(
        [{"role": "user", "content": "What does the function dumps in the json module do?"}],
        add_generation_prompt=True,
    )
    summary["sample_chat"] = greedy(model, tokenizer, chat_prompt, add_special_tokens=False)
    return summary


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m splitserve.engine.default_model.train",
        description="Train splitserve's embedded default model (a tiny Llama on the Python stdlib) "
        "on one CPU thread and save it with its tokenizer.",
    )
    parser.add_argument(
        "--out", type=Path, default=FILES_DIR, help=f"output directory (default: {FILES_DIR})"
    )
    parser.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help=f"training budget; becomes minutes * {STEPS_PER_MINUTE} steps so results stay deterministic "
        "(default: 10)",
    )
    parser.add_argument("--steps", type=int, default=None, help="exact number of steps (overrides --minutes)")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and batch sampling (default: 0)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.minutes <= 0:
        raise SystemExit(f"--minutes must be positive, got {args.minutes!r}")
    num_steps = args.steps if args.steps is not None else max(1, round(args.minutes * STEPS_PER_MINUTE))
    summary = run(args.out, TrainConfig(num_steps=num_steps, seed=args.seed))
    print(f"saved to {args.out} in {summary['train_seconds']:.0f} s of training")
    print(
        f"final train loss {summary['final_train_loss']:.3f} (mean of last 20 steps); held-out loss "
        f"{summary['held_out_loss_saved']:.3f} vs uniform {summary['uniform_loss']:.3f}"
    )
    print(f"greedy continuation of 'def ' (trailing space token-healed):\ndef {summary['sample_def']}")
    print(f"chat sample:\n{summary['sample_chat']}")


if __name__ == "__main__":
    main()
