"""Runs one scheduled step on this rank: builds the flat batch and attention
metadata, runs its pipeline stage, and (on the driver) samples.

    SchedulerOutput ──▶ input_ids/positions/slots ──▶ stage 0 ──hidden──▶ … ──▶ last stage
                                                                                 │ logits
                                         every rank ◀── broadcast ◀── driver: sample
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.attention import AttentionMetadata, PrefillSeq
from splitserve.engine.config import EngineConfig
from splitserve.engine.kv_cache import allocate_kv_caches, num_blocks_for
from splitserve.engine.models.config import ModelConfig
from splitserve.engine.models.llama import build_model
from splitserve.engine.parallel import ParallelState
from splitserve.engine.request import Request
from splitserve.engine.sampler import SampleResult, make_generator, prompt_logprobs, sample_row
from splitserve.engine.scheduler import SchedulerOutput

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, model: ModelConfig, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on GPU; float32 on CPU, where half-precision
    matmuls are slow and would change numerics against references."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(model.torch_dtype, torch.bfloat16)


@dataclass(frozen=True)
class ChunkResult:
    """What one scheduled chunk produced (identical on every rank)."""

    request_id: str
    sample: SampleResult | None
    prompt_log_probs: tuple[float, ...] = ()


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, ps: ParallelState, seed: int = 0):
        self.config = config
        self.ps = ps
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, model_config, self.device)
        self.model = build_model(model_config, ps, config.model, self.dtype, self.device)
        self.block_size = config.cache.block_size_tokens
        self.num_blocks = num_blocks_for(model_config, ps, config.cache, self.dtype)
        self.kv_caches = allocate_kv_caches(
            self.model.num_local_layers,
            self.num_blocks,
            self.model.num_local_kv_heads,
            self.block_size,
            model_config.head_dim,
            self.dtype,
            self.device,
        )
        self._hidden_size = model_config.hidden_size
        self._base_seeds: dict[str, int] = {}
        self._seed_source = torch.Generator().manual_seed(seed)

    # ----------------------------------------------------------------- batch
    def _prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSeq] = []
        for chunk in out.chunks:
            req = chunk.request
            q_start = len(ids)
            tokens = req.all_token_ids[chunk.start : chunk.start + chunk.num_tokens]
            pos = range(chunk.start, chunk.start + chunk.num_tokens)
            ids.extend(tokens)
            positions.extend(pos)
            slots.extend(req.block_ids[p // bs] * bs + p % bs for p in pos)
            ctx_len = chunk.start + chunk.num_tokens
            num_blocks = -(-ctx_len // bs)
            if chunk.num_tokens == 1:
                decode_idx.append(q_start)
                decode_tables.append(req.block_ids[:num_blocks])
                decode_lens.append(ctx_len)
            else:
                table = torch.tensor(req.block_ids[:num_blocks], dtype=torch.long, device=self.device)
                prefills.append(PrefillSeq(q_start, chunk.num_tokens, ctx_len, table))
        width = max((len(t) for t in decode_tables), default=0)
        padded = [t + [0] * (width - len(t)) for t in decode_tables]

        def tensor(x):
            return torch.tensor(x, dtype=torch.long, device=self.device)

        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            decode_token_idx=tensor(decode_idx),
            decode_block_tables=tensor(padded).reshape(len(padded), width),
            decode_ctx_lens=tensor(decode_lens),
            prefills=tuple(prefills),
        )
        return tensor(ids), tensor(positions), meta

    # --------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[ChunkResult]:
        input_ids, positions, meta = self._prepare(out)
        hidden = None
        if not self.ps.is_first_stage:
            hidden = self.ps.recv_prev((len(input_ids), self._hidden_size), self.dtype, self.device)
        hidden = self.model(positions, meta, self.kv_caches, input_ids=input_ids, hidden=hidden)
        results = None
        if not self.ps.is_last_stage:
            self.ps.send_next(hidden)
        elif self.ps.is_driver:
            results = self._sample(out, hidden)
        return self.ps.broadcast_from_driver(results)

    def _sample(self, out: SchedulerOutput, hidden: torch.Tensor) -> list[ChunkResult]:
        rows: list[int] = []
        offset = 0
        spans: list[tuple[int, int]] = []  # rows of each chunk in `logits`
        for chunk in out.chunks:
            first = len(rows)
            if chunk.request.wants_prompt_log_probs and chunk.start < chunk.request.prompt_len:
                rows.extend(range(offset, offset + chunk.num_tokens))
            elif chunk.is_sample:
                rows.append(offset + chunk.num_tokens - 1)
            spans.append((first, len(rows)))
            offset += chunk.num_tokens
        logits = self.model.compute_logits(hidden[rows]) if rows else None
        # Plain greedy rows (the common case) share one argmax and one host sync.
        greedy = logits.argmax(dim=-1).tolist() if logits is not None else []
        results = []
        for chunk, (first, last) in zip(out.chunks, spans, strict=True):
            req = chunk.request
            sample = None
            params = req.params
            if chunk.is_sample and params.is_greedy and not params.return_log_probs and not params.top_n_logprobs:
                sample = SampleResult(greedy[last - 1])
            elif chunk.is_sample:
                sample = sample_row(logits[last - 1], req.params, self._generator(req), self.config.logprobs_mode)
            plp: list[float] = []
            if req.wants_prompt_log_probs and chunk.start < req.prompt_len:
                end = min(chunk.start + chunk.num_tokens + 1, req.prompt_len)
                plp = prompt_logprobs(logits[first:last], req.all_token_ids[chunk.start + 1 : end])
            results.append(ChunkResult(req.request_id, sample, tuple(plp)))
        return results

    def _generator(self, req: Request) -> torch.Generator | None:
        """A generator seeded by (request seed, output position).

        Seeding per position rather than carrying one generator along makes a
        token depend only on its seed and index, so a request whose first token
        was sampled by a prefill engine continues exactly as it would have on
        one engine."""
        if req.params.is_greedy:
            return None
        seed = req.params.seed
        if seed is None:
            seed = self._base_seeds.get(req.request_id)
            if seed is None:
                seed = self._base_seeds[req.request_id] = int(
                    torch.randint(0, 2**62, (1,), generator=self._seed_source)
                )
        mixed = (seed * 0x9E3779B97F4A7C15 + len(req.output_token_ids) * 0xBF58476D1CE4E5B9) % (2**63 - 1)
        return make_generator(mixed, self.device)

    def forget(self, request_id: str) -> None:
        self._base_seeds.pop(request_id, None)
