"""Quick checks of a trained default model: held-out loss and greedy text.

``model`` is a ``LlamaForCausalLM`` and ``tokenizer`` a ``tokenizers.Tokenizer``;
both run on CPU in whatever dtype the model has.
"""

from __future__ import annotations

import torch

from splitserve.engine.default_model.corpus import held_out_text


@torch.no_grad()
def held_out_loss(model, tokenizer, max_tokens: int = 1024) -> float:
    """Mean next-token loss on a stdlib module that was kept out of the corpus."""
    ids = tokenizer.encode(held_out_text()).ids[:max_tokens]
    batch = torch.tensor([ids])
    return model(input_ids=batch, labels=batch).loss.float().item()


@torch.no_grad()
def greedy(model, tokenizer, text: str, max_new_tokens: int = 64, add_special_tokens: bool = True) -> str:
    """Greedy continuation of ``text``, with token healing of a trailing space.

    Byte-level BPE glues a space to the word after it (``" foo"``), so a prompt
    ending in a space ("def ") ends in a lone-space token the model has hardly
    seen. Healing drops that token and forces the first new token to start with
    a space; the returned text excludes the re-generated space.
    """
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
    healed = ""
    if len(ids) > 1 and text.endswith(" ") and tokenizer.decode(ids[-1:]) == " ":
        healed, ids = " ", ids[:-1]
    input_ids = torch.tensor([ids])
    if healed:
        logits = model(input_ids=input_ids).logits[0, -1]  # [vocab]
        allowed = torch.tensor(
            [tokenizer.decode([i]).startswith(healed) for i in range(logits.numel())], dtype=torch.bool
        )
        first = logits.masked_fill(~allowed, float("-inf")).argmax().view(1, 1)
        input_ids = torch.cat([input_ids, first], dim=1)
        max_new_tokens -= 1
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
    )
    new_ids = out[0, len(ids) :].tolist()
    return tokenizer.decode(new_ids, skip_special_tokens=True)[len(healed) :]
