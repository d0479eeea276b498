"""Sampling a launched step: the tokens of a decode step taken at launch (argmax, logit
adjustments, device draws, log-probs) so the step can run ahead, and `collect`, which turns a
launched step into each chunk's result on every rank.

`StepSampling` is the sampling half of `ModelRunner` (engine/model_runner.py), which builds and
runs the forward pass; it uses the runner's `config`, `ps`, `model` (`compute_logits`),
`device`, `graphs`, `logit_slots` (and its `vocab`), `_triton_argmax`, `_draws_at_launch`, `_guided_draws`, `_base_seeds` and
`_seed_source`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from splitserve.engine.adjusted_rows import adjust_at_launch, adjust_in_place, adjusted_rows
from splitserve.engine.device_sampler import (
    device_drawable,
    draw_on_device,
    draw_rows,
    sampled_rows,
)
from splitserve.engine.devices import put_rows, to_device
from splitserve.engine.guided import StepMasks
from splitserve.engine.request import Request
from splitserve.engine.sampler import SampleResult, make_generator, prompt_logprobs, sample_row
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.step_logprobs import (
    StepLogprobs,
    log_softmax_rows,
    on_device,
    wants_logprobs,
)
from splitserve.engine.step_logprobs import compute as compute_logprobs
from splitserve.engine.step_logprobs import finish as finish_logprobs

PROMPT_LOGITS_ELEMENTS = 1 << 25
"""Logits computed at once for a chunk's prompt log-probs: 128 MiB of fp32 (256 rows of a 128k vocabulary)."""


def greedy_ids(logits: torch.Tensor, triton: bool) -> torch.Tensor:
    """Row-wise argmax (first index of the maximum, as torch's). `triton` (the runner decides it
    once: CUDA with Triton importable): the two-stage Triton kernel the decode graphs use — torch
    gives a whole 128k-entry row to one multiprocessor (~40 µs for 64 rows on an H200, against ~11)."""
    if triton and logits.dim() == 2 and logits.stride(-1) == 1:
        from splitserve import kernels

        return kernels.argmax_rows(logits)
    return logits.argmax(dim=-1)


@dataclass(frozen=True)
class PendingStep:
    """A launched step: what `collect` needs to sample it."""

    out: SchedulerOutput
    hidden: torch.Tensor | None = None
    """Last stage, eager: the hidden states of the step's tokens."""
    logits: torch.Tensor | None = None
    """Decode steps: one logits row per sequence (a graph's buffer: valid only until
    that graph replays again), their argmax on the device (`greedy`) and its host
    copy (`greedy_host`, complete once `ready` has fired)."""
    greedy: torch.Tensor | None = None
    greedy_host: torch.Tensor | None = None
    drawn: frozenset[int] = frozenset()
    """Sampled rows already drawn at launch: their tokens stand in `greedy` in place of the
    argmax, so the step can be fed forward like a greedy one (`_draw_at_launch`)."""
    adjusted: frozenset[int] = frozenset()
    """Rows whose logit bias / penalties are already in `logits` (engine/adjusted_rows.py)."""
    logprobs: StepLogprobs | None = None
    """Log-probs of the rows that want them, computed at launch (engine/step_logprobs.py)."""
    ready: torch.cuda.Event | None = None
    layer_marks: Callable[[], None] | None = None
    """Layer-wise streaming on a GPU: publishes the step's per-layer marks as its layers finish
    (engine/handoff_layerwise.py `DeviceLayerMarks.drain`); `collect` calls it first."""


@dataclass(frozen=True)
class ChunkResult:
    """What one scheduled chunk produced (identical on every rank)."""

    request_id: str
    sample: SampleResult | None
    prompt_log_probs: tuple[float, ...] = ()
    prompt_top_logprobs: tuple[dict[int, float], ...] = ()
    """Prompt positions' top-N alternatives, when the request wants prompt log-probs and top N."""


class StepSampling:
    """Samples launched steps (see the module docstring); mixed into `ModelRunner`."""

    def _decode_pending(
        self, out: SchedulerOutput, logits: torch.Tensor, greedy: torch.Tensor, graphed: bool = False,
        fed: torch.Tensor | None = None,
    ) -> PendingStep:
        """A decode step's logits (one row per sequence) and argmax — with the sampled rows'
        draws in place of theirs (`_draw_at_launch`) — on its way to the host now, so
        `collect` waits for this step only, not for a later one queued behind it."""
        greedy = greedy.clone()  # a graph's output buffer is rewritten by its next replay
        adjusted = drawn = frozenset()
        logprobs = None
        if self.ps.is_driver:
            chunks = out.chunks
            lp_rows = self._logprob_rows_at_launch(out)
            index = None if len(lp_rows) == len(chunks) else to_device(lp_rows, torch.long, logits.device)
            also = [i for i in lp_rows if chunks[i].request.params.adjusts_logits]
            taken = log_softmax_rows(logits, index) if also else None  # raw: before those rows are adjusted
            adjusted = adjust_at_launch(self.logit_slots, chunks, logits, greedy, fed, also)
            drawn = self._draw_at_launch(out, logits, greedy, graphed, adjusted)
            drawn |= {i for i in adjusted if chunks[i].request.params.is_greedy}
            if lp_rows:  # every one of them has its token in `greedy` now
                ids = greedy if index is None else greedy.index_select(0, index)
                top_n = [chunks[i].request.params.top_n_logprobs for i in lp_rows]
                logprobs = (finish_logprobs(taken, lp_rows, ids, top_n) if taken is not None
                            else compute_logprobs(logits, lp_rows, index, ids, top_n))
        step = PendingStep(out, logits=logits, greedy=greedy, greedy_host=greedy, drawn=drawn, adjusted=adjusted,
                           logprobs=logprobs)
        if greedy.device.type != "cuda":
            return step
        host = torch.empty(greedy.shape, dtype=greedy.dtype, pin_memory=True)
        host.copy_(greedy, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return replace(step, greedy_host=host, ready=ready)

    def _logprob_rows_at_launch(self, out: SchedulerOutput) -> list[int]:
        """A decode step's rows whose log-probs are taken at launch (engine/step_logprobs.py):
        each one's token is then in the step's tokens — greedy rows' argmax (an adjusted row's from
        the adjustment kernel), sampled rows' draws (`_draw_at_launch`, where a launch draws)."""
        mode, draws = self.config.logprobs_mode, self._draws_at_launch
        return [i for i, chunk in enumerate(out.chunks)
                if chunk.is_sample and on_device(chunk.request.params, mode, adjusted_too=True)
                and (draws or chunk.request.params.is_greedy)]

    def _draw_at_launch(
        self, out: SchedulerOutput, logits: torch.Tensor, tokens: torch.Tensor, graphed: bool = False,
        adjusted: frozenset[int] = frozenset(),
    ) -> frozenset[int]:
        """Draw a decode step's sampled rows now (those that want log-probs: where the device takes
        them, engine/step_logprobs.py), into `tokens` (row i = chunk i), so they need neither the
        logits nor a host round trip at `collect` and the step can run ahead
        (engine/step_pipeline.py). On CUDA the batched device sampler queues the draw behind the
        step; on CPU the host sampler draws as `collect` would (the CPU computes synchronously
        anyway). Either way the token is the one `collect` would have
        drawn: a draw depends only on the request's seed and the token's position, and no
        position changes between launch and collect. `graphed`: the logits are the decode graph's
        buffer, so a captured sampler graph may draw them (engine/sampler_graphs.py)."""
        # adjusted rows that want log-probs: adjusted here only because their raw log-probs were taken first
        raw_taken = {i for i in adjusted if not out.chunks[i].request.params.is_greedy
                     and wants_logprobs(out.chunks[i].request.params)}
        if tokens.is_cuda:
            picked = sorted(set(device_drawable(out.chunks, logits, self.config.logprobs_mode)) | raw_taken)
            if not picked:
                return frozenset()
            drawn = self.graphs.draw(out.chunks, picked, self.row_seed) if graphed else None
            if drawn is None:
                spans = [(i, i + 1) for i in range(len(out.chunks))]
                drawn = draw_rows(out.chunks, logits, spans, self.row_seed, picked)
            put_rows(tokens, picked, drawn)
            return frozenset(picked)
        picked = sorted(set(sampled_rows(out.chunks, self.config.logprobs_mode)) | raw_taken)
        for i in picked:
            req = out.chunks[i].request
            tokens[i] = sample_row(logits[i], req.params, self._generator(req), self.config.logprobs_mode,
                                   preadjusted=i in adjusted, token_only=True).token_id
        return frozenset(picked)

    @torch.inference_mode()
    def collect(self, step: PendingStep) -> list[ChunkResult]:
        """Sample the launched step (driver) and share the results with every rank."""
        masks = self._guided_masks(step.out, skip=step.drawn) if self.ps.is_driver else None  # (settled rows: done)
        if masks is not None:  # filled on the host while the device still runs the step
            masks.rows(self.device)
        if step.layer_marks is not None:  # its layers' readiness (a decode worker is pulling them) as they finish
            step.layer_marks()
        results = None
        if self.ps.is_driver:
            if step.logits is not None:
                if step.ready is not None:
                    step.ready.synchronize()
                spans = [(i, i + 1) for i in range(len(step.out.chunks))]
                results = self._sample_logits(step.out, step.logits, spans, step.greedy_host, step.drawn, step.adjusted,
                                              step.logprobs, masks=masks)
            elif step.hidden is not None:
                results = self._sample(step.out, step.hidden, masks)
        return self.ps.broadcast_from_driver(results)

    def _guided_masks(self, out: SchedulerOutput, skip: frozenset[int] = frozenset()) -> StepMasks | None:
        matchers = {i: c.request.guide for i, c in enumerate(out.chunks)
                    if c.is_sample and c.request.guide is not None and i not in skip}
        return StepMasks(matchers, self.logit_slots.vocab) if matchers else None

    def settles_guided(self, params, adjusted: bool = False) -> bool:
        """Can a guided row of these params take its token on the device alone (`_guided_tokens`):
        no log-probs, no bias / penalties left to apply (`adjusted`: already in its logits), greedy —
        or sampled where the device sampler draws?"""
        return (not wants_logprobs(params) and (not params.adjusts_logits or adjusted)
                and (params.is_greedy or self._guided_draws))

    @torch.inference_mode()
    def settle_guided(self, step: PendingStep) -> PendingStep:
        """Async scheduling (engine/step_pipeline.py): put the tokens of a launched decode step's
        guided rows into its device tokens, as `collect` would have, so the next step can be fed
        them before this one reaches the host. Call once every earlier token of the rows is
        consumed by their matchers (the previous step applied): the masks are filled now, while
        the device still runs the step, and the masked argmax / draws are queued behind it; the
        rows join `drawn`, and the tokens' host copy is queued again. Rows must satisfy
        `settles_guided`."""
        rows = {i: c.request.guide for i, c in enumerate(step.out.chunks)
                if c.is_sample and c.request.guide is not None and not c.request.status.is_finished}
        if not rows or not self.ps.is_driver:
            return step
        masks = StepMasks(rows, self.logit_slots.vocab)
        spans = [(i, i + 1) for i in range(len(step.out.chunks))]
        picked, tokens = self._guided_tokens(step.out, step.logits, spans, masks, step.adjusted)
        if set(picked) != set(rows):
            raise ValueError(f"guided rows {sorted(set(rows) - set(picked))} cannot be settled at launch")
        put_rows(step.greedy, picked, tokens)
        done = replace(step, drawn=step.drawn | set(rows))
        if step.ready is None:  # CPU: the host tokens are the tokens
            return done
        step.greedy_host.copy_(step.greedy, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return replace(done, ready=ready)

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor, masks: StepMasks | None = None) -> list[ChunkResult]:
        rows: list[int] = []
        offset = 0
        spans: list[tuple[int, int]] = []  # rows of each chunk in `logits`
        prompt: dict[int, tuple[list[float], list[dict[int, float]]]] = {}
        for i, chunk in enumerate(out.chunks):
            first = len(rows)
            if chunk.request.wants_prompt_log_probs and chunk.start < chunk.request.prompt_len:
                prompt[i] = self._prompt_logprobs(chunk, hidden[offset:offset + chunk.num_tokens])
            if chunk.is_sample:
                rows.append(offset + chunk.num_tokens - 1)
            spans.append((first, len(rows)))
            offset += chunk.num_tokens
        logits = self.model.compute_logits(hidden[rows]) if rows else None
        return self._sample_logits(out, logits, spans, prompt=prompt, masks=masks)

    def _prompt_logprobs(self, chunk, hidden: torch.Tensor) -> tuple[list[float], list[dict[int, float]]]:
        """The log-probs of the prompt tokens that follow a prefill chunk's positions (and their
        top N), from its hidden states [num_tokens, hidden], computed `PROMPT_LOGITS_ELEMENTS`
        logits at a time: a 2048-token chunk of a 128k vocabulary is 1 GiB of fp32 logits (2 with
        its log-softmax), which a serving engine must not allocate for one request's echo."""
        req = chunk.request
        targets = req.token_slice(chunk.start + 1, min(chunk.start + chunk.num_tokens + 1, req.prompt_len))
        rows = max(1, PROMPT_LOGITS_ELEMENTS // self.logit_slots.vocab)
        chosen: list[float] = []
        tops: list[dict[int, float]] = []
        for at in range(0, len(targets), rows):
            part, top = prompt_logprobs(self.model.compute_logits(hidden[at:at + rows]), targets[at:at + rows],
                                        req.params.top_n_logprobs)
            chosen += part
            tops += top
        return chosen, tops

    def _sample_logits(
        self, out: SchedulerOutput, logits, spans: list[tuple[int, int]], greedy: torch.Tensor | None = None,
        drawn: frozenset[int] = frozenset(), adjusted: frozenset[int] = frozenset(),
        logprobs: StepLogprobs | None = None,
        prompt: dict[int, tuple[list[float], list[dict[int, float]]]] | None = None, masks: StepMasks | None = None,
    ) -> list[ChunkResult]:
        """`spans[i]`: the rows of `logits` that belong to chunk i (its last row samples);
        `greedy`: their argmax when the step already computed it (a CUDA graph), with the
        tokens of the `drawn` chunks' rows drawn at launch in place of theirs; `adjusted`: rows
        whose bias / penalties are already in `logits` (the others are adjusted here first);
        `logprobs`: rows' log-probs computed at launch (the others that qualify are computed
        here the same way: engine/step_logprobs.py); `prompt`: chunk i's prompt log-probs and top N,
        computed from its hidden states (`_prompt_logprobs`); `masks`: the guided rows' (`_guided_masks`)."""
        if logits is not None and greedy is None:  # (a decode step's rows were adjusted at launch)
            late = adjusted_rows(out.chunks, skip=adjusted)
            if late:
                adjust_in_place(self.logit_slots, logits, out.chunks, late, [spans[i][1] - 1 for i in late])
                adjusted = adjusted | frozenset(late)
        # Plain greedy rows (the common case) share one argmax and one host sync.
        if greedy is None and logits is not None:
            greedy = greedy_ids(logits, self._triton_argmax)
        greedy = greedy.tolist() if greedy is not None else []
        mode = self.config.logprobs_mode
        drawn_now = draw_on_device(out.chunks, logits, spans, self.row_seed, mode, drawn) if logits is not None else {}
        lps = logprobs.read() if logprobs is not None else {}
        if logits is not None:
            late = [i for i, chunk in enumerate(out.chunks)
                    if i not in lps and chunk.is_sample and on_device(chunk.request.params, mode)
                    and (chunk.request.params.is_greedy or i in drawn or i in drawn_now)]
            if late:
                tokens = [drawn_now[i] if i in drawn_now else greedy[spans[i][1] - 1] for i in late]
                lps.update(compute_logprobs(logits, late, to_device([spans[i][1] - 1 for i in late], torch.long, logits.device),
                                            to_device(tokens, torch.long, logits.device),
                                            [out.chunks[i].request.params.top_n_logprobs for i in late]).read())
        allowed = masks.rows(logits.device) if masks is not None else {}
        guided = self._guided_batch(out, logits, spans, masks, adjusted)
        results = []
        for i, (chunk, (_, last)) in enumerate(zip(out.chunks, spans, strict=True)):
            req = chunk.request
            sample = None
            params = req.params
            if i in drawn or (chunk.is_sample and params.is_greedy and (i in lps or not wants_logprobs(params))
                              and (not params.adjusts_logits or i in adjusted) and req.guide is None):
                sample = SampleResult(greedy[last - 1], *lps.get(i, (None, None)))
            elif i in drawn_now:
                sample = SampleResult(drawn_now[i], *lps.get(i, (None, None)))
            elif i in guided:
                sample = SampleResult(guided[i])
            elif chunk.is_sample:  # log-probs (from the model's own logits), or sampled on the CPU
                sample = sample_row(logits[last - 1], req.params, self._generator(req), self.config.logprobs_mode,
                                    req.output_so_far() if params.adjusts_logits else (), preadjusted=i in adjusted,
                                    allowed=None if req.guide is None else allowed[i])
            plp, ptop = (prompt or {}).get(i, ((), ()))
            results.append(ChunkResult(req.request_id, sample, tuple(plp), tuple(ptop)))
        return results

    def _guided_batch(self, out: SchedulerOutput, logits, spans, masks: StepMasks | None,
                      adjusted: frozenset[int]) -> dict[int, int]:
        """Chunk index -> token of the guided rows that want nothing more than their token
        (`_guided_tokens`), with one host sync for all."""
        rows, tokens = self._guided_tokens(out, logits, spans, masks, adjusted)
        return dict(zip(rows, tokens.tolist(), strict=True)) if rows else {}

    def _guided_tokens(self, out: SchedulerOutput, logits, spans, masks: StepMasks | None,
                       adjusted: frozenset[int]) -> tuple[list[int], torch.Tensor | None]:
        """The guided rows that want nothing more than their token (no log-probs, no bias /
        penalties left to apply) and their tokens on the device, all at once: greedy rows by one
        masked argmax; sampled rows, on CUDA with Triton, masked in place and drawn by the batched
        device sampler (engine/device_sampler.py, seeded per position as every drawn row) —
        elsewhere they are left to the host sampler. No host sync."""
        if masks is None:
            return [], None
        allowed = masks.rows(logits.device)
        rows = [i for i in allowed if self.settles_guided(out.chunks[i].request.params, i in adjusted)]
        if not rows:
            return [], None
        at = [spans[i][1] - 1 for i in rows]
        whole = at == list(range(len(logits)))  # every row of `logits`, in order (a guided decode batch): no gather
        index = None if whole else to_device(at, torch.long, logits.device)
        keep = masks.stacked if rows == list(allowed) else torch.stack([allowed[i] for i in rows])
        masked = (logits if whole else logits.index_select(0, index)).masked_fill(~keep, float("-inf"))
        tokens = masked.argmax(dim=-1)
        if sampled := [k for k, i in enumerate(rows) if not out.chunks[i].request.params.is_greedy]:
            put_rows(logits, at, masked)
            drawn = draw_rows(out.chunks, logits, spans, self.row_seed, [rows[k] for k in sampled])
            put_rows(tokens, sampled, drawn)
        return rows, tokens

    def _generator(self, req: Request) -> torch.Generator | None:
        """A generator seeded by (request seed, output position).

        Seeding per position rather than carrying one generator along makes a
        token depend only on its seed and index, so a request whose first token
        was sampled by a prefill engine continues exactly as it would have on
        one engine."""
        if req.params.is_greedy:
            return None
        return make_generator(self.row_seed(req), self.device)

    def row_seed(self, req: Request) -> int:
        """The seed of `req`'s next token: (request seed, output position) mixed."""
        seed = req.params.seed
        if seed is None:
            seed = self._base_seeds.get(req.request_id)
            if seed is None:
                seed = self._base_seeds[req.request_id] = int(
                    torch.randint(0, 2**62, (1,), generator=self._seed_source)
                )
        position = req.params.output_offset + len(req.output_token_ids)  # a resumed stream goes on counting
        return (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9) % (2**63 - 1)
