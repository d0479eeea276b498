"""How one engine (a TP × PP group of worker ranks) lays out a model's paged KV cache.

Every rank holds, for each of its *local* layers, one tensor::

    kv[i] : [2, num_pool_blocks, num_local_heads, block_size, head_dim]
             │         │                │
             │         │                └─ kv heads of this TP rank (see `heads_of`)
             │         └─ the rank's block pool; a request owns a list of block ids
             └─ 0 = K, 1 = V

so for one (layer, K|V, block) a contiguous range of kv heads is one contiguous
memory region. Ranks and layers::

    global rank = pp_rank * tp + tp_rank
    stage s holds global layers layer_ranges[s] = (start, end), end exclusive;
    its local layer i is global layer start + i

KV heads per TP rank::

    num_kv_heads >= tp:  rank r holds heads [r*h/tp, (r+1)*h/tp)        (tp | num_kv_heads)
    num_kv_heads <  tp:  rank r holds head  r // (tp // num_kv_heads)   (num_kv_heads | tp)
                         i.e. every head is replicated on tp // num_kv_heads ranks

This module is torch-free so descriptors can be built and checked anywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Bytes per element of the KV dtypes the cache may use (names as in `torch.<name>`).
DTYPE_ITEMSIZE: dict[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def default_layer_ranges(num_layers: int, pp: int) -> tuple[tuple[int, int], ...]:
    """Split `num_layers` over `pp` stages as evenly as possible, earlier stages get the extra layers.

    >>> default_layer_ranges(5, 2)
    ((0, 3), (3, 5))
    """
    if pp < 1:
        raise ValueError(f"pp must be >= 1, got {pp!r}")
    if num_layers < pp:
        raise ValueError(f"num_layers={num_layers!r} is fewer than pp={pp!r}: every stage needs a layer")
    base, extra = divmod(num_layers, pp)
    ranges = []
    start = 0
    for stage in range(pp):
        end = start + base + (1 if stage < extra else 0)
        ranges.append((start, end))
        start = end
    return tuple(ranges)


@dataclass(frozen=True)
class KVLayout:
    """The KV-cache layout of one engine; identical on all of its ranks.

    `layer_ranges` may be left empty to get `default_layer_ranges(num_layers, pp)`.
    """

    dtype: str
    """Element dtype, named as in torch (`"float32"`, `"bfloat16"`, ...)."""
    block_size: int
    """Tokens per KV block."""
    tp: int
    """Tensor-parallel size."""
    pp: int
    """Pipeline-parallel size."""
    num_layers: int
    """Attention layers of the whole model."""
    num_kv_heads: int
    """KV heads of the whole model (before TP sharding)."""
    head_dim: int
    """Elements per head per token."""
    layer_ranges: tuple[tuple[int, int], ...] = ()
    """Global layers `(start, end)` held by each PP stage, end exclusive; `()` = default split."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_ITEMSIZE)}")
        for name in ("block_size", "tp", "pp", "num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        h, tp = self.num_kv_heads, self.tp
        if h >= tp and h % tp != 0:
            raise ValueError(f"num_kv_heads={h} is not divisible by tp={tp}")
        if h < tp and tp % h != 0:
            raise ValueError(
                f"tp={tp} is not a multiple of num_kv_heads={h}: replicated kv heads need tp % num_kv_heads == 0"
            )
        if not self.layer_ranges:
            object.__setattr__(self, "layer_ranges", default_layer_ranges(self.num_layers, self.pp))
        ranges = tuple((int(s), int(e)) for s, e in self.layer_ranges)
        object.__setattr__(self, "layer_ranges", ranges)
        if len(ranges) != self.pp:
            raise ValueError(f"layer_ranges {ranges!r} has {len(ranges)} stages, expected pp={self.pp}")
        expected_start = 0
        for stage, (start, end) in enumerate(ranges):
            if start != expected_start or end <= start:
                raise ValueError(
                    f"layer_ranges {ranges!r} must cover [0, {self.num_layers}) contiguously with non-empty "
                    f"stages; stage {stage} is ({start}, {end})"
                )
            expected_start = end
        if expected_start != self.num_layers:
            raise ValueError(f"layer_ranges {ranges!r} end at {expected_start}, expected num_layers={self.num_layers}")

    # ---- sizes -------------------------------------------------------------------------------

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def world_size(self) -> int:
        """Ranks in the engine (tp * pp)."""
        return self.tp * self.pp

    @property
    def num_local_heads(self) -> int:
        """KV heads held by each TP rank (1 when heads are replicated)."""
        return max(1, self.num_kv_heads // self.tp)

    @property
    def num_replicas(self) -> int:
        """How many TP ranks hold each kv head (1 unless num_kv_heads < tp)."""
        return max(1, self.tp // self.num_kv_heads)

    @property
    def head_block_bytes(self) -> int:
        """Bytes of one (layer, K|V, block, kv head): `block_size * head_dim * itemsize`."""
        return self.block_size * self.head_dim * self.itemsize

    def block_bytes(self, rank: int) -> int:
        """Bytes one block occupies on `rank` over all its local layers, K and V."""
        return self.num_local_layers(self.pp_rank(rank)) * 2 * self.num_local_heads * self.head_block_bytes

    def kv_shape(self, num_pool_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of each local layer's tensor on any rank of this layout."""
        return (2, num_pool_blocks, self.num_local_heads, self.block_size, self.head_dim)

    # ---- ranks -------------------------------------------------------------------------------

    def rank(self, tp_rank: int, pp_rank: int) -> int:
        """Global rank of (tp_rank, pp_rank)."""
        if not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp_rank {tp_rank!r} out of range [0, {self.tp})")
        if not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp_rank {pp_rank!r} out of range [0, {self.pp})")
        return pp_rank * self.tp + tp_rank

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} out of range [0, {self.world_size}) for tp={self.tp}, pp={self.pp}")

    def tp_rank(self, rank: int) -> int:
        """TP coordinate of a global rank."""
        self._check_rank(rank)
        return rank % self.tp

    def pp_rank(self, rank: int) -> int:
        """PP coordinate (stage) of a global rank."""
        self._check_rank(rank)
        return rank // self.tp

    # ---- layers ------------------------------------------------------------------------------

    def stage_of(self, layer: int) -> int:
        """PP stage holding global `layer`."""
        for stage, (start, end) in enumerate(self.layer_ranges):
            if start <= layer < end:
                return stage
        raise ValueError(f"layer {layer!r} out of range [0, {self.num_layers})")

    def num_local_layers(self, pp_rank: int) -> int:
        """Layers held by stage `pp_rank`."""
        start, end = self.layer_ranges[pp_rank]
        return end - start

    def local_layer(self, layer: int) -> int:
        """Index of global `layer` within its stage's `kv` list."""
        return layer - self.layer_ranges[self.stage_of(layer)][0]

    # ---- heads -------------------------------------------------------------------------------

    def heads_of(self, tp_rank: int) -> tuple[int, int]:
        """Global kv heads `[start, end)` held by `tp_rank` (one head when replicated)."""
        if not 0 <= tp_rank < self.tp:
            raise ValueError(f"tp_rank {tp_rank!r} out of range [0, {self.tp})")
        if self.num_kv_heads >= self.tp:
            per = self.num_kv_heads // self.tp
            return tp_rank * per, (tp_rank + 1) * per
        head = tp_rank // self.num_replicas
        return head, head + 1

    def holders_of(self, head: int) -> tuple[int, ...]:
        """TP ranks holding global kv `head` (several when replicated), ascending."""
        if not 0 <= head < self.num_kv_heads:
            raise ValueError(f"kv head {head!r} out of range [0, {self.num_kv_heads})")
        if self.num_kv_heads >= self.tp:
            return (head // self.num_local_heads,)
        return tuple(range(head * self.num_replicas, (head + 1) * self.num_replicas))

    def is_primary(self, tp_rank: int, head: int) -> bool:
        """Whether `tp_rank` is the first holder of `head`: the one replica that reports it once."""
        return self.holders_of(head)[0] == tp_rank

    def describe(self) -> str:
        """One line for logs and error messages."""
        return (
            f"tp={self.tp} pp={self.pp} layers={self.layer_ranges} kv_heads={self.num_kv_heads} "
            f"head_dim={self.head_dim} block_size={self.block_size} dtype={self.dtype}"
        )


def layout_text(layout: KVLayout) -> str:
    """A short description for traces and logs, e.g. "tp=2,pp=1,bfloat16,block=16"."""
    return f"tp={layout.tp},pp={layout.pp},{layout.dtype},block={layout.block_size}"
