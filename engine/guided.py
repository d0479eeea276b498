"""Structured output: a request's tokens constrained to a JSON schema (OpenAI's `response_format`
json_object / json_schema) or a grammar (llguidance's Lark: the gateway's forced tool calls) by a
mask of the allowed next tokens at every sampled position.

    SamplingParams.json_schema ─▶ Guides.matcher(req) ─▶ req.guide (an llguidance LLMatcher,
                                  the schema compiled for this model's tokenizer, fed the tokens
                                  the request already output: a decode worker's imported first
                                  token, a resumed stream's earlier output)
    each sampled position: StepMasks (the step's rows at once) ─▶ disallowed logits -inf ─▶ greedy / draw
    each step's tokens:    their matchers consume them (`consume_tokens`: together on a GPU engine)

Why llguidance: it computes a mask over a whole vocabulary from a tokenizer's byte-level trie and
an Earley parser of the grammar (a Rust library, MIT, no dependencies), so a schema costs one host
call per token rather than a walk of the vocabulary in Python (mask + consume 36-48 µs a token on
this 2-core machine for the embedded model's 3,072-token vocabulary: benchmarks/guided.py); the
same library serves structured outputs in several production engines. The module imports
neither torch nor llguidance at load: the gateway and the SDK check schemas with `check_schema`.

A step's guided rows have their masks computed together while the step runs (`StepMasks`); those
that want only their tokens then take them together — greedy rows by one masked argmax on the
device, sampled rows (on CUDA) by the batched device sampler — and rows that want log-probs are
sampled one by one (step_sampling.py `_guided_batch`). A mask depends on the token before it: with
async scheduling (step_pipeline.py) the rows that want only their tokens have them taken on the
device once the step before is applied and before the next is launched (`settle_guided`); a step
with any other guided row does not run ahead. The device sampler, the launch-time argmax and the
launch-time adjustments skip a guided row; its log-probs are the model's own (raw mode) or
those of the masked distribution (processed mode), as with top-k / top-p. When the grammar is
complete the mask leaves only the end-of-sequence tokens, so the request stops there; a token
budget reached first cuts the JSON short (as OpenAI's API does: finish_reason "length").
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""The JSON's layout: one line, `json.dumps`'s separators. With whitespace left free a model can
spend its token budget on blank lines between keys (a small or unsure model does); a schema may
ask otherwise with llguidance's `x-guidance` key."""


def check_schema(schema: str) -> None:
    """ValueError unless `schema` is the JSON text of a JSON schema (an object or a boolean)."""
    try:
        value = json.loads(schema)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema must be the JSON text of a schema, got {schema!r:.80}: {exc}") from None
    if not isinstance(value, dict | bool):
        raise ValueError(f"json_schema must be a JSON object (a schema), got {type(value).__name__}")


class Guides:
    """One engine's compiler of JSON-schema guides, for its model's tokenizer and vocabulary."""

    def __init__(self, tokenizer_dir: str | Path | None, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self._dir = None if tokenizer_dir is None else Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self._eos = list(eos_ids)
        self._fresh = functools.lru_cache(maxsize=64)(self._fresh_matcher)

    @cached_property
    def _tokenizer(self):
        import llguidance

        file = None if self._dir is None else self._dir / "tokenizer.json"
        if file is None or not file.is_file():
            raise ValueError("json_schema / grammar need the model's tokenizer.json (this engine runs on token ids only)")
        return llguidance.LLTokenizer(str(file), n_vocab=self.vocab_size, eos_token=self._eos or None)

    def matcher(self, params, output_so_far: list[int]):
        """A matcher for `params`' json_schema or grammar that has consumed `output_so_far`.
        ValueError for one the compiler refuses, or output that does not follow it.

        A copy of a fresh matcher kept per grammar (the last 64): building one from the grammar
        took 585 µs on this 2-core machine (1.1 ms on an H100's host, 13% of a batch of 64
        guided requests of 64 tokens each), copying one 1 µs."""
        what = "json_schema" if params.json_schema is not None else "grammar"
        matcher = self._fresh(what, params.json_schema if params.json_schema is not None else params.grammar).deep_copy()
        if output_so_far and not matcher.consume_tokens(list(output_so_far)):
            raise ValueError(f"the request's earlier output does not follow its {what}: {matcher.get_error()}")
        return matcher

    def _fresh_matcher(self, what: str, text: str):
        import llguidance

        grammar = compile_schema(text) if what == "json_schema" else compile_lark(text)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"{what} cannot be compiled: {matcher.get_error()}")
        return matcher


@functools.lru_cache(maxsize=256)  # a few schemas are reused by most clients
def compile_schema(schema: str) -> str:
    """`schema` (JSON text) as an llguidance grammar. ValueError, quoting the compiler, for one it
    refuses (the gateway asks before routing a request, so the client gets a plain 400)."""
    import llguidance

    check_schema(schema)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise ValueError(f"json_schema cannot be compiled: {error}")
    return grammar


@functools.lru_cache(maxsize=256)
def compile_lark(grammar: str) -> str:
    """An llguidance Lark grammar (`%json {...}` embeds a schema) as an llguidance grammar;
    ValueError quoting the compiler for one it refuses."""
    import llguidance

    if not isinstance(grammar, str) or not grammar.strip():
        raise ValueError(f"grammar must be a non-empty Lark grammar, got {grammar!r:.80}")
    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    error = llguidance.LLMatcher.validate_grammar(compiled)
    if error:
        raise ValueError(f"grammar cannot be compiled: {error}")
    return compiled


class StepMasks:
    """The masks of one step's guided rows, computed together while the device runs the step.

    `collect` (step_sampling.py) asks for them before it waits for the step, and with async
    scheduling `settle_guided` does, before the next step is launched: either way the host fills
    them while the device computes, from matchers that have consumed every earlier token. For a
    GPU engine llguidance's executor fills a batch's rows in parallel (Rust threads, the GIL
    dropped: 64 rows in 213 µs against 725 one after another on an H100's host); a CPU engine
    fills them one after another, as its cores run the forward pass (on this 2-core machine the
    executor's threads took them from it: guided ÷ free 0.72 against 0.80 at batch 32). The
    packed bits (4 bytes per 32 tokens) go to the device in one copy from pinned memory and are
    unpacked there. (Before, each row's mask was filled, unpacked on the host and copied when its
    row was sampled, one after another, after the step: benchmarks/RESULTS.md, session 37.) A
    broken matcher's mask, or an empty one, lets every token through: sampling never sees an
    empty distribution (the error is the caller's to report).
    """

    def __init__(self, matchers: dict[int, object], vocab_size: int) -> None:
        self._matchers = matchers
        self.vocab_size = vocab_size
        self._rows: RowMasks | None = None
        self.stacked: torch.Tensor | None = None
        """After `rows`: bool [rows, vocab_size], the rows in the order of `matchers`."""

    def rows(self, device, parallel: bool | None = None) -> RowMasks:
        """Chunk index -> bool [vocab_size] on `device`: the tokens its matcher accepts next
        (`parallel`: by llguidance's executor; default: on a GPU, see above)."""
        if self._rows is None:
            import llguidance.torch as llg_torch
            import torch

            matchers = list(self._matchers.values())
            bits = llg_torch.allocate_token_bitmask(len(matchers), self.vocab_size)  # pinned where CUDA is
            if parallel is None:
                parallel = torch.device(device).type == "cuda"
            if parallel and len(matchers) > 1:
                llg_torch.fill_next_token_bitmask_par(_mask_executor(), [(m, k) for k, m in enumerate(matchers)], bits)
            else:
                for k, matcher in enumerate(matchers):
                    llg_torch.fill_next_token_bitmask(matcher, bits, k)
            # Fixed on the host through numpy (a few µs; as torch ops they took ~100 µs a step on an
            # H100's host): no bit past the vocabulary; a broken matcher's row, or an empty one, lets
            # every token through (checked on 4 bytes per 32 tokens).
            words = bits.numpy()
            if tail := self.vocab_size % 32:
                words[:, -1] &= (1 << tail) - 1
            let_all = ~words.any(axis=1)
            let_all |= [m.is_error() for m in matchers]
            if let_all.any():
                words[let_all] = -1
            if torch.device(device).type == "cuda" and not bits.is_pinned():  # pageable: the copy would wait
                bits = bits.pin_memory()
            packed = bits.to(device, non_blocking=True)
            masks = torch.bitwise_and(packed[:, :, None], _bit_values(str(device))).flatten(1)[:, : self.vocab_size] != 0
            self.stacked = masks
            self._rows = RowMasks({i: k for k, i in enumerate(self._matchers)}, masks)
        return self._rows


class RowMasks(Mapping):
    """Chunk index -> its row of a step's stacked masks, each row taken when asked for: a batch's
    rows are mostly used stacked (`StepMasks.stacked`), and 64 tensor views cost ~50 µs a step."""

    def __init__(self, order: dict[int, int], stacked: torch.Tensor) -> None:
        self._order = order
        self._stacked = stacked

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._stacked[self._order[i]]

    def __iter__(self):
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


def consume_tokens(pairs: list[tuple[object, int]], parallel: bool) -> None:
    """Each (matcher, token): the matcher takes its row's new token (a token its mask did not allow
    leaves it in error: its next mask lets everything through, see `StepMasks`). `parallel`: by
    llguidance's executor (GPU engines, as the masks), else one after another."""
    if parallel and len(pairs) > 1:
        _mask_executor().consume_token_par(pairs)
    else:
        for matcher, token in pairs:
            matcher.consume_token(token)


@functools.cache
def _bit_values(device: str):
    """int32 [32]: bit k set alone (bit 31 is the sign bit: negative, as a mask it is the same)."""
    import torch

    return torch.tensor([1 << k for k in range(31)] + [-(1 << 31)], dtype=torch.int32, device=device)


@functools.cache
def _mask_executor():
    import llguidance

    return llguidance.LLExecutor()
