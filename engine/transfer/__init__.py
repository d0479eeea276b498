"""splitserve.engine.transfer: moving a request's KV between engines of different TP/PP layouts.

One concept per module:

- `layout`     `KVLayout`: ranks, layer ranges, kv heads per rank of one engine (torch-free)
- `plan`       `build_plan` → `TransferPlan` of `TransferOp`s: what goes from which rank to which
- `regions`    plan ops → byte regions of the per-layer KV tensors (for memory transports)
- `pack`       plan ops → one contiguous buffer per (src, dst) pair, and back
- `checksum`   per-(layer, kv head) checksums that are the same on every layout
- `transport`  the pull interface (`KVTransport`), `TransferStats`, `TransferError`
- `inproc`, `nixl_transport`, `shm_transport`, `cuda_ipc`   pull transports; `torch_dist`: two-sided
               send/recv of a plan
- `nixl_endpoint`  what a NIXL source rank publishes; `nixl_staging`: reshard reads via staging buffers
- `local_copy` one plan op between tensors this process addresses (shm, staging; Triton on CUDA)
- `progress`   per-layer readiness board of a source rank (layer-wise streaming)
- `streaming`  the streamed pull: each layer as soon as the boards show it written

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
