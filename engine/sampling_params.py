"""Per-request sampling parameters (field names follow the reference design)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.engine.guided import check_schema
from splitserve.engine.logit_adjustments import bias_pairs, check_penalty


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt. Validated on construction; errors quote the value."""

    num_tokens_to_generate: int | None = 16
    """Maximum new tokens. Mutually exclusive with `num_tokens_total`."""
    num_tokens_total: int | None = None
    """Cap on prompt + generated tokens. When set, `num_tokens_to_generate` must be None."""
    temperature: float = 1.0
    """Softmax temperature; 0.0 means greedy."""
    top_k: int = 0
    """Keep the k most likely tokens (0 = off)."""
    top_p: float = 0.0
    """Nucleus threshold in (0, 1] (0.0 = off)."""
    seed: int | None = None
    """Seed of this request's sampling generator; None draws from the engine seed."""
    termination_id: int | None = None
    """Token id that ends generation; None uses the model's EOS ids."""
    stop_words: tuple[str, ...] = field(default_factory=tuple)
    """Strings that end generation when they appear in the generated text."""
    detokenize_stop_sequence: bool = False
    """Keep the stop word / EOS in `generated_text` (it is stripped otherwise)."""
    return_log_probs: bool = False
    """Return log-probs of generated tokens (and of the prompt unless skipped)."""
    skip_prompt_log_probs: bool = False
    """With `return_log_probs`, skip prompt log-probs (cheaper)."""
    top_n_logprobs: int = 0
    """Return the top-N log-probs at every generated position."""
    return_prompt_tokens: bool = False
    """Echo the prompt token ids in the result."""
    add_BOS: bool = True  # noqa: N815 - the reference design's field name
    """Prepend the tokenizer's BOS token when the prompt is text."""
    ignore_eos: bool = False
    """Keep generating past EOS (benchmarks)."""
    output_offset: int = 0
    """Tokens at the end of the prompt that were generated earlier (a stream resumed elsewhere):
    sampling positions go on after them, so a seeded request draws what it would have drawn."""
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    """(token id, bias) pairs added to the logits before sampling, greedy included (OpenAI's
    `logit_bias`, values in [-100, 100]); a dict is accepted and stored sorted."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already holds (OpenAI, [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence of a token in the output so far (OpenAI, [-2, 2])."""
    json_schema: str | None = None
    """The JSON text of a JSON schema the output must follow (OpenAI's `response_format`;
    json_object mode is `{"type": "object"}`): tokens are sampled under a mask of those that keep
    it valid (engine/guided.py). Needs the model's tokenizer."""
    grammar: str | None = None
    """Or an llguidance Lark grammar the output must follow (`%json {...}` embeds a schema; the
    gateway's `tool_choice` "required" / named function), the same way."""

    def __post_init__(self) -> None:
        if isinstance(self.stop_words, str):
            object.__setattr__(self, "stop_words", (self.stop_words,))
        elif not isinstance(self.stop_words, tuple):
            object.__setattr__(self, "stop_words", tuple(self.stop_words))
        if self.num_tokens_to_generate is not None and self.num_tokens_total is not None:
            raise ValueError(
                "num_tokens_to_generate and num_tokens_total are mutually exclusive, got "
                f"{self.num_tokens_to_generate!r} and {self.num_tokens_total!r}"
            )
        if self.num_tokens_to_generate is None and self.num_tokens_total is None:
            raise ValueError("one of num_tokens_to_generate or num_tokens_total must be set")
        for name in ("num_tokens_to_generate", "num_tokens_total"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 <= self.top_p <= 1.0:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative integer, got {self.seed!r}")
        if self.termination_id is not None and (not _is_int(self.termination_id) or self.termination_id < 0):
            raise ValueError(f"termination_id must be a non-negative token id, got {self.termination_id!r}")
        if not _is_int(self.output_offset) or self.output_offset < 0:
            raise ValueError(f"output_offset must be an integer >= 0, got {self.output_offset!r}")
        if not _is_int(self.top_n_logprobs) or not 0 <= self.top_n_logprobs <= 20:
            raise ValueError(f"top_n_logprobs must be an integer in [0, 20], got {self.top_n_logprobs!r}")
        for word in self.stop_words:
            if not isinstance(word, str) or not word:
                raise ValueError(f"stop_words must be non-empty strings, got {word!r}")
        object.__setattr__(self, "logit_bias", bias_pairs(self.logit_bias))
        check_penalty("presence_penalty", self.presence_penalty)
        check_penalty("frequency_penalty", self.frequency_penalty)
        adjusts = bool(self.logit_bias) or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        object.__setattr__(self, "_adjusts", adjusts)  # read per row per step: not recomputed
        wants_logprobs = bool(self.return_log_probs or self.top_n_logprobs)
        if self.json_schema is not None:
            check_schema(self.json_schema)
        if self.grammar is not None and (self.json_schema is not None or not self.grammar.strip()):
            raise ValueError(f"grammar must be a non-empty Lark grammar and excludes json_schema, got {self.grammar!r:.80}")
        object.__setattr__(self, "_argmax_only", self.is_greedy and not adjusts and not wants_logprobs
                           and not self.is_guided)  # fmt: skip

    @classmethod
    def coerce(cls, params: object) -> SamplingParams:
        """`params` as the engine's SamplingParams: itself, or the SDK's (`splitserve.client.SamplingParams`,
        a subset of these fields) field by field, so code moves between `Client.generate` and
        `LLM.generate` unchanged; TypeError naming what it got otherwise."""
        if isinstance(params, cls):
            return params
        if type(params).__module__ == "splitserve.client.types":  # by name: the engine does not import the SDK
            fields = {name: getattr(params, name) for name in type(params).__dataclass_fields__}
            fields["skip_prompt_log_probs"] = not fields.pop("return_prompt_log_probs")  # the SDK asks by name
            return cls(**fields)
        raise TypeError(f"sampling params must be splitserve.SamplingParams (or splitserve.client.SamplingParams), "
                        f"got {type(params).__name__}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def adjusts_logits(self) -> bool:
        """A logit bias or a penalty: the row is scored on the host from its own logits (never a
        shared argmax or the batched device draw) — engine/adjusted_rows.py."""
        return self._adjusts

    @property
    def is_guided(self) -> bool:
        """A json_schema or grammar: the row is sampled under its mask (engine/guided.py)."""
        return self.json_schema is not None or self.grammar is not None

    @property
    def argmax_only(self) -> bool:
        """The row's token is the argmax of its raw logits and nothing else reads them: greedy,
        no bias or penalties, no log-probs (a decode graph then leaves its logits unstored,
        engine/cuda_graphs.py)."""
        return self._argmax_only

    def max_new_tokens(self, prompt_len: int) -> int:
        """New tokens allowed for a prompt of `prompt_len` tokens (may be <= 0)."""
        if self.num_tokens_to_generate is not None:
            return self.num_tokens_to_generate
        return self.num_tokens_total - prompt_len


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)
