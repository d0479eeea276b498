"""Tensor and pipeline parallelism inside one worker group (torch.distributed).

Global rank layout (the handoff layouts use the same convention):

    rank = pp_rank * tp_size + tp_rank

    pp stage 0: ranks 0 .. tp-1      (embedding + first layers)
    pp stage 1: ranks tp .. 2tp-1    ...
    last stage:                      (final norm + lm_head, sampling)

Every rank runs the same scheduler on the same inputs (SPMD), so block tables
agree everywhere; the last stage's first rank samples and broadcasts the
result, so all ranks see identical tokens.

The caller initialises the default process group (gloo on CPU, NCCL on GPU;
tests use a `file://` init method so nothing binds a public port).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from splitserve.engine.config import ParallelConfig


@dataclass(frozen=True)
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def driver_rank(self) -> int:
        """The rank that samples: first rank of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    @property
    def is_driver(self) -> bool:
        return self.rank == self.driver_rank

    # --------------------------------------------------------------- collectives
    def all_reduce_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def send_next(self, x: torch.Tensor) -> None:
        dist.send(x.contiguous(), dst=self.rank + self.tp_size)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=device)
        dist.recv(buf, src=self.rank - self.tp_size)
        return buf

    def broadcast_from_driver(self, obj: Any) -> Any:
        """Send a picklable object from the driver rank to every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=self.driver_rank)
        return box[0]

    def broadcast_from_first(self, obj: Any) -> Any:
        """Send a picklable object from global rank 0 (the group's gRPC front) to every rank."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        """True on every rank iff `flag` is true on every rank (a group-wide vote)."""
        if self.world_size == 1:
            return flag
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def gather_to_first(self, obj: Any) -> list[Any] | None:
        """Every rank's `obj`, by rank, on global rank 0 (None elsewhere)."""
        if self.world_size == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out


def init_parallel_state(config: ParallelConfig) -> ParallelState:
    """Build this rank's state; requires an initialised default group when world > 1."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    if tp * pp == 1:
        return ParallelState()
    if not dist.is_initialized():
        raise RuntimeError(
            f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} needs torch.distributed "
            "initialised with that many ranks (e.g. launched one process per rank)"
        )
    if dist.get_world_size() != tp * pp:
        raise ValueError(f"world size {dist.get_world_size()} != tp {tp} x pp {pp}")
    rank = dist.get_rank()
    my_group = None
    for stage in range(pp):  # every rank must create every group, in the same order
        ranks = list(range(stage * tp, (stage + 1) * tp))
        group = dist.new_group(ranks) if tp > 1 else None
        if rank in ranks:
            my_group = group
    return ParallelState(tp_size=tp, tp_rank=rank % tp, pp_size=pp, pp_rank=rank // tp, tp_group=my_group)


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """Layers [start, end) of a stage: as even as possible, earlier stages take the extra."""
    if pp_size > num_layers:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def kv_heads_of_rank(num_kv_heads: int, tp_size: int, tp_rank: int) -> tuple[int, int]:
    """KV heads [start, end) held by a TP rank.

    num_kv_heads >= tp: an even split. num_kv_heads < tp (GQA): each rank holds
    one head, replicated over tp // num_kv_heads consecutive ranks.
    """
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(f"{num_kv_heads} kv heads cannot be split over tensor_parallel_size {tp_size}")
        per = num_kv_heads // tp_size
        return tp_rank * per, (tp_rank + 1) * per
    if tp_size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size {tp_size} must be a multiple of {num_kv_heads} kv heads")
    head = tp_rank // (tp_size // num_kv_heads)
    return head, head + 1
