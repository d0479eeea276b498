"""splitserve.engine.transfer: moving a request's KV between engines of different TP/PP layouts.

One concept per module:

- `layout`     `KVLayout`: ranks, layer ranges, kv heads per rank of one engine (torch-free)
- `plan`       `build_plan` → `TransferPlan` of `TransferOp`s: what goes from which rank to which
- `regions`    plan ops → byte regions of the per-layer KV tensors (for memory transports)
- `pack`       plan ops → one contiguous buffer per (src, dst) pair, and back
- `checksum`   per-(layer, kv head) checksums that are the same on every layout
- `transport`  the pull interface (`KVTransport`), `TransferStats`, `TransferError`
- `inproc`, `nixl_transport`   pull transports; `torch_dist`: two-sided send/recv of a plan

Only the torch-free names are re-exported here; import the others from their modules.
"""

from splitserve.engine.transfer.layout import KVLayout, default_layer_ranges
from splitserve.engine.transfer.plan import BlockRun, TransferOp, TransferPlan, build_plan, check_compatible

__all__ = [
    "BlockRun",
    "KVLayout",
    "TransferOp",
    "TransferPlan",
    "build_plan",
    "check_compatible",
    "default_layer_ranges",
]
