"""Shared fixtures: tiny Hugging Face checkpoints built from random configs on the spot."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("UCX_NET_DEVICES", "lo")

TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


def build_hf_checkpoint(path, family: str = "llama", seed: int = 0, **overrides):
    """Save a random `transformers` model (fp32) to `path`; return the HF model."""
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = {**TINY, **overrides}
    if family == "llama":
        config = transformers.LlamaConfig(**cfg)
        model = transformers.LlamaForCausalLM(config)
    elif family == "qwen2":
        config = transformers.Qwen2Config(**cfg)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        raise ValueError(family)
    # Spread the weights so logits are far apart and greedy choices are not coin flips.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.eval()
    model.save_pretrained(path, safe_serialization=True)
    return model


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    build_hf_checkpoint(path, "llama")
    return path


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def build_tokenizer(path, vocab_size: int = 400):
    """A small byte-level BPE tokenizer trained on a few lines, saved beside a checkpoint."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["def hello(world): return world + 1", "the quick brown fox jumps over the lazy dog"] * 20
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "chat_template": CHAT_TEMPLATE})
    )


@pytest.fixture(scope="session")
def text_ckpt(tmp_path_factory):
    """A random Llama with a real tokenizer (eos = </s> = id 2)."""
    path = tmp_path_factory.mktemp("text")
    build_hf_checkpoint(path, "llama", eos_token_id=2, bos_token_id=1)
    build_tokenizer(path)
    return path
