"""The recurrent-state pool of hybrid models, next to the paged KV: one slot of
conv + SSM state per running request (or pinned handoff), plus a prefix store of
states cached at block boundaries, with its own memory budget.

Per local mamba layer::

    conv[num_slots, conv_dim_local, K - 1]      ssm[num_slots, H_local, P, N]
    prefix_conv[num_prefix, ...]                prefix_ssm[num_prefix, ...]

A slot also remembers how many tokens its state has consumed (`position`): a
chunk that starts elsewhere (a new request, a preempted one starting over, a
prefix-cache hit) resets the slot from zeros or from the cached state of the
block boundary it starts at. The prefix store maps a block hash (which chains
every token before it) to the state after that block, LRU-evicted.

Every rank of an engine runs the same schedule, so slot and prefix indices are
assigned identically everywhere. Not thread-safe: the engine's step loop owns it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from splitserve.engine.block_hash import BlockHash
from splitserve.engine.models.mamba2 import MambaLayerState


class NoFreeStateSlotError(RuntimeError):
    """Every recurrent-state slot is taken (running requests plus pinned handoffs)."""


class PrefixStateIndex:
    """Block hash -> prefix-store index, LRU. Pure bookkeeping (no tensors)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._index: OrderedDict[BlockHash, int] = OrderedDict()
        self._free = list(range(capacity - 1, -1, -1))

    def __len__(self) -> int:
        return len(self._index)

    def get(self, block_hash: BlockHash) -> int | None:
        """The index holding `block_hash`'s state (marks it recently used), or None."""
        idx = self._index.get(block_hash)
        if idx is not None:
            self._index.move_to_end(block_hash)
        return idx

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._index

    def put(self, block_hash: BlockHash) -> int | None:
        """An index to write `block_hash`'s state to (evicting the least recently used),
        or None when the store has no room at all."""
        if self.capacity == 0:
            return None
        if block_hash in self._index:
            return self.get(block_hash)
        if self._free:
            idx = self._free.pop()
        else:
            _, idx = self._index.popitem(last=False)
        self._index[block_hash] = idx
        return idx

    def clear(self) -> None:
        self._index.clear()
        self._free = list(range(self.capacity - 1, -1, -1))

    def check_integrity(self) -> None:
        used = list(self._index.values())
        if len(set(used)) != len(used) or set(used) & set(self._free) or len(used) + len(self._free) != self.capacity:
            raise AssertionError(f"prefix state index: used {sorted(used)} free {sorted(self._free)} capacity {self.capacity}")


def state_bytes(shapes: list[tuple[tuple[int, ...], tuple[int, ...]]], conv_dtype: torch.dtype, ssm_dtype: torch.dtype) -> int:
    """Bytes of one request's state over layers with (conv shape, ssm shape) each."""
    conv_elem = torch.empty((), dtype=conv_dtype).element_size()
    ssm_elem = torch.empty((), dtype=ssm_dtype).element_size()
    total = 0
    for conv, ssm in shapes:
        total += conv_elem * int(torch.Size(conv).numel()) + ssm_elem * int(torch.Size(ssm).numel())
    return total


class StatePool:
    def __init__(
        self,
        shapes: list[tuple[tuple[int, ...], tuple[int, ...]]],
        num_slots: int,
        num_prefix: int,
        conv_dtype: torch.dtype,
        ssm_dtype: torch.dtype,
        device: torch.device,
    ):
        """`shapes`: per local mamba layer, (conv [C, K-1], ssm [H, P, N]) of one request."""
        self.num_slots = num_slots
        self.conv_dtype, self.ssm_dtype = conv_dtype, ssm_dtype
        self.layers = [
            MambaLayerState(
                conv=torch.zeros((num_slots, *conv), dtype=conv_dtype, device=device),
                ssm=torch.zeros((num_slots, *ssm), dtype=ssm_dtype, device=device),
                prefix_conv=torch.zeros((num_prefix, *conv), dtype=conv_dtype, device=device),
                prefix_ssm=torch.zeros((num_prefix, *ssm), dtype=ssm_dtype, device=device),
            )
            for conv, ssm in shapes
        ]
        self.prefix = PrefixStateIndex(num_prefix)
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}
        self.position: dict[str, int] = {}
        """Tokens the state of a request's slot has consumed."""
        self.pinned: set[str] = set()
        """Requests whose slot is held for a handoff (prefill role) after they finished."""

    # ------------------------------------------------------------------ slots
    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def slot_of(self, request_id: str) -> int | None:
        return self._slot_of.get(request_id)

    def acquire(self, request_id: str) -> int:
        slot = self._slot_of.get(request_id)
        if slot is not None:
            return slot
        if not self._free:
            raise NoFreeStateSlotError(f"all {self.num_slots} recurrent-state slots are in use (mamba_state_slots)")
        slot = self._slot_of[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        """Give a request's slot back (no-op if it has none)."""
        slot = self._slot_of.pop(request_id, None)
        self.position.pop(request_id, None)
        self.pinned.discard(request_id)
        if slot is not None:
            self._free.append(slot)

    def reset(self, slot: int) -> None:
        for layer in self.layers:
            layer.conv[slot].zero_()
            layer.ssm[slot].zero_()

    def load_prefix(self, slot: int, index: int) -> None:
        for layer in self.layers:
            layer.conv[slot].copy_(layer.prefix_conv[index])
            layer.ssm[slot].copy_(layer.prefix_ssm[index])

    # -------------------------------------------------------------- lifecycle
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the pool: per layer the slots' conv and ssm states and the prefix cache's
        (a lifecycle suspend frees their memory with the KV's: engine/lifecycle.py)."""
        return [t for layer in self.layers for t in (layer.conv, layer.ssm, layer.prefix_conv, layer.prefix_ssm)]

    # ------------------------------------------------------------- inspection
    def check_integrity(self, owners: set[str]) -> None:
        """Slots: free + owned == total, and every owner is a live request or a pin."""
        used = list(self._slot_of.values())
        if len(set(used)) != len(used) or set(used) & set(self._free) or len(used) + len(self._free) != self.num_slots:
            raise AssertionError(f"state pool: slots used {sorted(used)} free {sorted(self._free)} total {self.num_slots}")
        stray = set(self._slot_of) - owners - self.pinned
        if stray:
            raise AssertionError(f"state pool: slots held by unknown requests {sorted(stray)}")
        self.prefix.check_integrity()
