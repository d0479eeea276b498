"""`--inference-shards`: which shard groups the cluster has, and the GPU-rank slots they expand to.

    tp=2,role=prefill+tp=1,dp=2,role=decode

Groups are joined by ``+``; each group is comma-separated ``key=value`` with
``role`` in {prefill, decode} (required) and ``tp``, ``pp``, ``dp`` (positive
integers, default 1). The example needs 2 + 2 = 4 GPU ranks, i.e. 4 slots.

Slot order (= slot ids) is group, then dp replica, then pp rank, then tp rank,
so the ranks of one dp replica are consecutive and ``rank = pp_rank * tp +
tp_rank`` counts up with the slot id::

    group 0 (prefill tp=2)        group 1 (decode tp=1 dp=2)
    slot 0: dp0 pp0 tp0 rank 0    slot 2: dp0 pp0 tp0 rank 0
    slot 1: dp0 pp0 tp1 rank 1    slot 3: dp1 pp0 tp0 rank 0
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass

_POSITIVE_INT = re.compile(r"[0-9]+")
_INT_KEYS = ("tp", "pp", "dp")


class Role(enum.StrEnum):
    """Which half of a disaggregated request a shard group serves."""

    PREFILL = "prefill"
    DECODE = "decode"


class ShardSpecError(ValueError):
    """A malformed `--inference-shards` spec; the message names the offending token."""


def _check_positive(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ShardGroup:
    """One `+`-separated group of the spec: `dp` replicas of a tp x pp shard."""

    index: int
    """0-based position in the spec."""
    role: Role
    tp: int = 1
    """Tensor-parallel size of each replica."""
    pp: int = 1
    """Pipeline-parallel size of each replica."""
    dp: int = 1
    """Number of independent replicas."""

    def __post_init__(self) -> None:
        if not isinstance(self.index, int) or self.index < 0:
            raise ValueError(f"index must be a non-negative integer, got {self.index!r}")
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, got {self.role!r}")
        for name in _INT_KEYS:
            _check_positive(name, getattr(self, name))

    @property
    def world_size(self) -> int:
        """Ranks of one replica, i.e. of its torch.distributed group."""
        return self.tp * self.pp

    @property
    def num_ranks(self) -> int:
        return self.world_size * self.dp

    def to_text(self) -> str:
        return f"role={self.role.value},tp={self.tp},pp={self.pp},dp={self.dp}"


@dataclass(frozen=True)
class Slot:
    """One GPU rank position a worker can fill."""

    slot_id: int
    group_index: int
    role: Role
    dp_replica: int
    tp_rank: int
    pp_rank: int
    tp: int
    """Tensor-parallel size of the group."""
    pp: int
    """Pipeline-parallel size of the group."""

    def __post_init__(self) -> None:
        for name in ("slot_id", "group_index", "dp_replica", "tp_rank", "pp_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
        if not isinstance(self.role, Role):
            raise ValueError(f"role must be a Role, got {self.role!r}")
        _check_positive("tp", self.tp)
        _check_positive("pp", self.pp)
        if self.tp_rank >= self.tp or self.pp_rank >= self.pp:
            raise ValueError(
                f"rank (tp_rank={self.tp_rank}, pp_rank={self.pp_rank}) outside tp={self.tp}, pp={self.pp}"
            )

    @property
    def world_size(self) -> int:
        return self.tp * self.pp

    @property
    def rank(self) -> int:
        """Rank within the dp replica's torch.distributed group."""
        return self.pp_rank * self.tp + self.tp_rank

    @property
    def replica(self) -> tuple[int, int]:
        """(group_index, dp_replica): identifies the replica the slot belongs to."""
        return (self.group_index, self.dp_replica)


@dataclass(frozen=True)
class ShardSpec:
    """A parsed `--inference-shards` spec."""

    groups: tuple[ShardGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a shard spec needs at least one group, got none")
        for position, group in enumerate(self.groups):
            if group.index != position:
                raise ValueError(f"group at position {position} has index {group.index}")

    @property
    def num_ranks(self) -> int:
        return sum(group.num_ranks for group in self.groups)

    def unservable_reason(self) -> str | None:
        """Why a cluster of this spec alone can answer no request (None: it can): decode workers
        generate every token (a decode worker prefills a prompt itself when no prefill worker
        is routable), so a spec without a decode group serves nothing."""
        if not any(group.role is Role.DECODE for group in self.groups):
            return (f"--inference-shards {self.to_text()!r} has no decode group: decode workers generate "
                    "every token, so prefill workers alone answer no request; add one, e.g. '+tp=1,role=decode'")
        return None

    def to_text(self) -> str:
        """Canonical text: parsing it gives an equal spec."""
        return "+".join(group.to_text() for group in self.groups)

    def slots(self) -> tuple[Slot, ...]:
        """Every slot in slot-id order (see the module docstring)."""
        return expand_slots(self)


@functools.cache  # specs are immutable and few; topologies ask for their slots on every snapshot
def expand_slots(spec: ShardSpec) -> tuple[Slot, ...]:
    slots: list[Slot] = []
    for group in spec.groups:
        for dp_replica in range(group.dp):
            for pp_rank in range(group.pp):
                for tp_rank in range(group.tp):
                    slots.append(
                        Slot(
                            slot_id=len(slots),
                            group_index=group.index,
                            role=group.role,
                            dp_replica=dp_replica,
                            tp_rank=tp_rank,
                            pp_rank=pp_rank,
                            tp=group.tp,
                            pp=group.pp,
                        )
                    )
    return tuple(slots)


@functools.lru_cache(maxsize=64)
def parse_inference_shards(text: str) -> ShardSpec:
    """Parses a spec; raises ShardSpecError naming the bad token and its 1-based group.

    Cached (the spec is frozen): every topology snapshot carries the spec's text and
    a worker decodes each one it is sent.
    """
    if not text.strip():
        raise ShardSpecError("empty --inference-shards spec")
    return ShardSpec(tuple(_parse_group(index, part) for index, part in enumerate(text.split("+"))))


def _parse_group(index: int, text: str) -> ShardGroup:
    where = f"in group {index + 1}"
    if not text.strip():
        raise ShardSpecError(f"empty group {index + 1}")
    values: dict[str, str] = {}
    for token in (t.strip() for t in text.split(",")):
        key, sep, value = token.partition("=")
        key, value = key.strip(), value.strip()
        if not sep:
            raise ShardSpecError(f"expected key=value, got {token!r} {where}")
        if key not in ("role", *_INT_KEYS):
            raise ShardSpecError(f"unknown key {key!r} {where}")
        if key in values:
            raise ShardSpecError(f"duplicate key {key!r} {where}")
        values[key] = value
    if "role" not in values:
        raise ShardSpecError(f"missing role {where}")
    try:
        role = Role(values["role"])
    except ValueError:
        raise ShardSpecError(f"role must be prefill or decode, got {values['role']!r} {where}") from None
    sizes: dict[str, int] = {}
    for key in _INT_KEYS:
        raw = values.get(key, "1")
        if not _POSITIVE_INT.fullmatch(raw) or int(raw) < 1:
            raise ShardSpecError(f"{key} must be a positive integer, got {raw!r} {where}")
        sizes[key] = int(raw)
    return ShardGroup(index=index, role=role, **sizes)
