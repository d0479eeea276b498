"""Byte-level BPE tokenizer of the default model, and its chat template.

Byte-level means every string round-trips exactly (indentation, tabs, any
Unicode), so no ``<unk>`` is ever produced; it exists only because loaders
expect one. ``encode(text)`` prepends ``<s>`` like Llama tokenizers do;
rendered chat templates already contain ``<s>`` and are encoded with
``add_special_tokens=False``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

UNK_TOKEN = "<unk>"
BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
SPECIAL_TOKENS = (UNK_TOKEN, BOS_TOKEN, EOS_TOKEN, PAD_TOKEN, *ROLE_TOKENS)
"""Ids 0..6 in this order: unk=0, bos=1, eos=2, pad=3, then the chat roles."""

MODEL_MAX_LEN = 1024

# Each turn is "<|role|>\n{content}</s>\n"; the end of an assistant turn is
# therefore the model's eos and generation stops there.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)


def render_chat(messages: Iterable[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Render ``CHAT_TEMPLATE`` with plain jinja2, as the trainer and tests do."""
    import jinja2

    template = jinja2.Environment(keep_trailing_newline=True).from_string(CHAT_TEMPLATE)
    return template.render(
        messages=list(messages),
        add_generation_prompt=add_generation_prompt,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
    )


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train byte-level BPE on ``texts`` (deterministic for a fixed input order)."""
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, bos_id)],
    )
    return tokenizer


def special_token_ids(tokenizer: Tokenizer) -> dict[str, int]:
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    missing = [token for token, token_id in ids.items() if token_id is None]
    if missing:
        raise ValueError(f"tokenizer lacks special tokens {missing}")
    return ids


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` carrying the chat template."""
    tokenizer.save(str(out_dir / "tokenizer.json"))
    ids = special_token_ids(tokenizer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": UNK_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": list(ROLE_TOKENS),
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LEN,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(token_id): {
                "content": token,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": True,
            }
            for token, token_id in ids.items()
        },
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
