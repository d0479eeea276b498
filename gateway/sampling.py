"""OpenAI sampling fields → the SDK's SamplingParams for one choice."""

from __future__ import annotations

from splitserve.client import SamplingParams
from splitserve.gateway.requests import SamplingFields


def stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(dict.fromkeys(stop))


def choice_params(
    request: SamplingFields, max_new_tokens: int, index: int, *, return_log_probs: bool, top_n_logprobs: int,
    return_prompt_log_probs: bool = False, json_schema: str | None = None, grammar: str | None = None,
) -> SamplingParams:
    """Choice `index` of `request`: OpenAI's defaults (temperature 1, top_p 1 = off), seed + index per choice."""
    top_p = request.top_p if request.top_p is not None and request.top_p < 1.0 else 0.0
    top_k = request.top_k if request.top_k is not None and request.top_k > 0 else 0
    return SamplingParams(
        num_tokens_to_generate=max_new_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_k=top_k, top_p=top_p,
        seed=None if request.seed is None else (request.seed + index) % (1 << 63),
        stop_words=stop_strings(request.stop), return_log_probs=return_log_probs, top_n_logprobs=top_n_logprobs,
        logit_bias=request.logit_bias_pairs, presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty, return_prompt_log_probs=return_prompt_log_probs,
        json_schema=json_schema, grammar=grammar,
        add_BOS=False,  # the gateway tokenizes; the SDK sees token ids only
    )  # fmt: skip
