"""Per-request stop conditions and incremental text: EOS / termination id,
token limit, and stop words (matched on the detokenized text).

A continuation (a stream resumed on another worker: the prompt ends with the tokens already
sent, `SamplingParams.output_offset` counts them) matches stop words across the break: the
tail of the earlier output's text is kept as `prior`, so a stop word begun before the break
and finished after it is still found (the text already sent stays sent, as in an unbroken
stream, which sends each delta before the stop word is complete)."""

from __future__ import annotations

from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer


class StopChecker:
    def __init__(self, req: Request, tokenizer: Tokenizer | None):
        self.req = req
        self.tokenizer = tokenizer
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids) if tokenizer else None
        self._max_stop_len = max((len(w) for w in req.params.stop_words), default=0)
        if req.params.stop_words and tokenizer is None:
            raise ValueError("stop_words need a tokenizer; this model directory has no tokenizer.json")
        self._prior = ""
        """The last characters of the output sent before this continuation (see the module docstring)."""
        if self._max_stop_len > 1 and req.params.output_offset:
            self._prior = prior_text(tokenizer, req.prompt_token_ids, req.params.output_offset, self._max_stop_len - 1)

    def on_token(self, token_id: int) -> tuple[str, RequestStatus | None]:
        """Account for a newly generated token; return (text delta, finish status or None)."""
        req, params = self.req, self.req.params
        is_eos = token_id in req.eos_token_ids
        delta = ""
        if self.detok is not None:
            if is_eos and params.detokenize_stop_sequence:
                delta = self.tokenizer.id_to_token(token_id) or ""
            elif not is_eos:
                delta = self.detok.add(token_id)
        before = req.text_length
        req.append_text(delta)
        if is_eos:
            return delta, RequestStatus.FINISHED_STOPPED
        if self._max_stop_len and delta:
            status = self._match_stop_word(before, len(delta))
            if status is not None:
                return req.generated_text[before:], status
        if len(req.output_token_ids) >= req.max_new_tokens:
            return delta, RequestStatus.FINISHED_LENGTH
        return delta, None

    def _match_stop_word(self, before: int, delta_len: int) -> RequestStatus | None:
        """A stop word ending in the new text: searched in the window of the last
        max_stop_len - 1 + `delta_len` characters of prior + output only (O(1) a token)."""
        need = self._max_stop_len - 1 + delta_len
        window = self.req.text_tail(need)
        if len(window) < need and self._prior:  # reaches back into the text sent before a break
            window = self._prior[-(need - len(window)):] + window
        prior = len(self._prior)
        window_start = prior + before + delta_len - len(window)  # in prior + output coordinates
        best = None
        for word in self.req.params.stop_words:
            at = window.find(word)
            if at != -1 and (best is None or at < best[0]):
                best = (at, word)
        if best is None:
            return None
        at, word = best
        at += window_start
        end = at + len(word) if self.req.params.detokenize_stop_sequence else at
        self.req.generated_text = self.req.generated_text[: end - prior] if end > prior else ""
        return RequestStatus.FINISHED_STOPPED


def prior_text(tokenizer: Tokenizer, prompt_ids, num_output: int, max_chars: int) -> str:
    """The last `max_chars` characters of the text the last `num_output` prompt tokens streamed as
    (detokenized incrementally after the tokens before them, as their stream was). Only the
    tail is decoded: a token is at least one character, or a byte of one (<= 4 per character)."""
    start = max(0, len(prompt_ids) - num_output, len(prompt_ids) - 4 * max_chars - 4)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids[:start])
    text = "".join(detok.add(t) for t in prompt_ids[start:])
    return text[-max_chars:]
