"""The embedded default model: its files exist, load with the reference
libraries, and hold a model that learned something from the stdlib."""

from __future__ import annotations

import hashlib
import json
import math

import jinja2
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer

import splitserve.engine.default_model as default_model
from splitserve.engine.default_model import REQUIRED_FILES, default_model_path
from splitserve.engine.default_model.corpus import HELD_OUT_MODULES, held_out_text
from splitserve.engine.default_model.evaluate import greedy

MAX_DIR_BYTES = 6 * 1024 * 1024

SNIPPET = (
    "class Point:\n"
    '    """A point in the plane — façade test ✓."""\n'
    "\n"
    "    def __init__(self, x: float, y: float) -> None:\n"
    "\tself.x, self.y = x, y  # tab-indented on purpose\n"
    "        return None\n"
)


@pytest.fixture(scope="module")
def path():
    return default_model_path()


@pytest.fixture(scope="module")
def tokenizer(path):
    return Tokenizer.from_file(str(path / "tokenizer.json"))


@pytest.fixture(scope="module")
def tokenizer_config(path):
    return json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_files_exist_within_size_budget(path):
    for name in (*REQUIRED_FILES, "generation_config.json"):
        assert (path / name).is_file(), name
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    assert total <= MAX_DIR_BYTES, f"{total} bytes"


def test_missing_files_error_names_build_command(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "FILES_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"python -m splitserve\.engine\.default_model\.train"):
        default_model.default_model_path()


def test_config_is_small_gqa_llama_saved_in_half_precision(path):
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    assert config["tie_word_embeddings"] is True
    assert config["max_position_embeddings"] == 1024
    saved_dtype = config.get("dtype", config.get("torch_dtype"))
    assert saved_dtype in ("float16", "bfloat16")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(name).get_dtype() for name in f.keys()}
    assert dtypes == {"F16" if saved_dtype == "float16" else "BF16"}


def test_tokenizer_round_trips_python(tokenizer):
    encoding = tokenizer.encode(SNIPPET, add_special_tokens=False)
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == SNIPPET
    assert tokenizer.token_to_id("<unk>") not in encoding.ids
    assert len(encoding.ids) < len(SNIPPET) / 2  # BPE merged something
    with_bos = tokenizer.encode(SNIPPET).ids
    assert with_bos[0] == tokenizer.token_to_id("<s>")
    assert with_bos[1:] == encoding.ids


def test_special_ids_agree_across_files(path, tokenizer, tokenizer_config):
    config = json.loads((path / "config.json").read_text())
    assert tokenizer.token_to_id(tokenizer_config["bos_token"]) == config["bos_token_id"]
    assert tokenizer.token_to_id(tokenizer_config["eos_token"]) == config["eos_token_id"]
    assert tokenizer.token_to_id(tokenizer_config["pad_token"]) == config["pad_token_id"]
    assert tokenizer.get_vocab_size() == config["vocab_size"]


def test_chat_template_renders_with_jinja2(tokenizer, tokenizer_config):
    template = jinja2.Environment().from_string(tokenizer_config["chat_template"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is a list?"},
    ]
    specials = {"bos_token": tokenizer_config["bos_token"], "eos_token": tokenizer_config["eos_token"]}
    rendered = template.render(messages=messages, add_generation_prompt=True, **specials)
    assert rendered == "<s><|system|>\nBe brief.</s>\n<|user|>\nWhat is a list?</s>\n<|assistant|>\n"
    closed = template.render(messages=messages, add_generation_prompt=False, **specials)
    assert closed == rendered.removesuffix("<|assistant|>\n")
    # Every control token is one id, so prompts stay short and unambiguous.
    ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    for token in ("<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"):
        assert tokenizer.token_to_id(token) in ids


def test_transformers_tokenizer_applies_the_same_template(path, tokenizer):
    from transformers import AutoTokenizer

    hf_tokenizer = AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "Hi"}]
    ids = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):  # transformers 5 may return a BatchEncoding
        ids = ids["input_ids"]
    expected = "<s><|user|>\nHi</s>\n<|assistant|>\n"
    assert list(ids) == tokenizer.encode(expected, add_special_tokens=False).ids
    assert hf_tokenizer.eos_token_id == tokenizer.token_to_id("</s>")


@torch.no_grad()
def test_held_out_loss_is_well_below_uniform(model, tokenizer):
    # textwrap.py is excluded from the training corpus.
    assert "textwrap.py" in HELD_OUT_MODULES
    ids = tokenizer.encode(held_out_text("textwrap.py")).ids[:512]
    batch = torch.tensor([ids])
    loss = model(input_ids=batch, labels=batch).loss.item()
    uniform = math.log(model.config.vocab_size)
    assert loss < 0.6 * uniform, f"held-out loss {loss:.3f} vs uniform {uniform:.3f}"


def test_greedy_continuation_is_readable_text(model, tokenizer):
    text = greedy(model, tokenizer, "def ", max_new_tokens=24)
    assert len(text) >= 24
    printable = sum(c.isprintable() or c in "\n\t" for c in text)
    assert printable == len(text), repr(text)
    assert sum(c.isalpha() for c in text) >= len(text) // 3, repr(text)


def test_greedy_heals_a_trailing_space_into_a_function_name(model, tokenizer):
    # "def " ends in a lone-space token the model has hardly seen; healing regenerates the
    # space as the start of the next token, so the continuation is the function's name.
    healed = greedy(model, tokenizer, "def ", max_new_tokens=8)
    assert healed[:1].isidentifier(), repr(healed)
    assert tokenizer.decode(tokenizer.encode("def " + healed).ids, skip_special_tokens=True).startswith(
        "def "
    )


@pytest.mark.slow
def test_training_is_deterministic(tmp_path):
    from splitserve.engine.default_model.train import ModelShape, TrainConfig, run

    config = TrainConfig(num_steps=2, batch_size=2, seq_len=32, max_corpus_chars=200_000)
    shape = ModelShape(vocab_size=512, hidden_size=32, intermediate_size=64)
    digests = []
    for name in ("a", "b"):
        run(tmp_path / name, config, shape)
        digests.append(
            {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted((tmp_path / name).iterdir())}
        )
    assert digests[0] == digests[1]
    assert "model.safetensors" in digests[0]
