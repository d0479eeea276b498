"""Moving recurrent-state byte regions (`state_plan.state_regions`) with the KV transports.

The state tensors of a rank are a flat list `[conv_0, ssm_0, conv_1, ssm_1, ...]`; a region
names a tensor of that list by index (`Regions.src_layer` / `dst_layer`) and a byte range.

    in-process   `expose_inproc` / `pull_inproc`: byte copies (tests, same process)
    NIXL         `register_nixl` on the source BEFORE its KV `expose` (so the agent metadata it
                 publishes covers the state memory too), then `pull_nixl` reads the regions with
                 one READ per source rank, like `NixlTransport.pull` does for KV
    torch_dist   `pack` on the source, `send_packed` / `recv_packed` over the pair group, `unpack`
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from splitserve.engine.transfer.regions import Regions
from splitserve.engine.transfer.transport import TransferError, TransferStats

_NIXL_MAGIC = b"SSNXS1"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8)


def _check(tensors: Sequence[torch.Tensor], regions: Regions, side: str) -> None:
    if not len(regions):
        return
    index = regions.src_layer if side == "src" else regions.dst_layer
    offset = regions.src_offset if side == "src" else regions.dst_offset
    if int(index.max()) >= len(tensors):
        raise TransferError(f"{side} state region names tensor {int(index.max())}; the rank has {len(tensors)}")
    sizes = np.asarray([t.numel() * t.element_size() for t in tensors], dtype=np.int64)
    if np.any(offset + regions.num_bytes > sizes[index]):
        raise TransferError(f"{side} state region past the end of its tensor")


def copy_regions(regions: Regions, src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor]) -> int:
    """Copy every region from `src` to `dst` tensors (any devices); returns bytes moved."""
    _check(src, regions, "src")
    _check(dst, regions, "dst")
    s_bytes, d_bytes = [_bytes(t) for t in src], [_bytes(t) for t in dst]
    for sl, so, dl, do, n in zip(regions.src_layer.tolist(), regions.src_offset.tolist(), regions.dst_layer.tolist(),
                                 regions.dst_offset.tolist(), regions.num_bytes.tolist(), strict=True):
        d_bytes[dl][do:do + n].copy_(s_bytes[sl][so:so + n])
    return regions.bytes_total


def pack(regions: Regions, src: Sequence[torch.Tensor]) -> torch.Tensor:
    """The source side of `regions`, concatenated into one uint8 buffer (region order)."""
    _check(src, regions, "src")
    s_bytes = [_bytes(t) for t in src]
    parts = [s_bytes[sl][so:so + n] for sl, so, n in zip(
        regions.src_layer.tolist(), regions.src_offset.tolist(), regions.num_bytes.tolist(), strict=True)]
    device = src[0].device if src else torch.device("cpu")
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)


def unpack(buf: torch.Tensor, regions: Regions, dst: Sequence[torch.Tensor]) -> None:
    _check(dst, regions, "dst")
    if buf.numel() != regions.bytes_total:
        raise TransferError(f"state buffer of {buf.numel()} bytes for {regions.bytes_total} bytes of regions")
    d_bytes = [_bytes(t) for t in dst]
    pos = 0
    for dl, do, n in zip(regions.dst_layer.tolist(), regions.dst_offset.tolist(), regions.num_bytes.tolist(), strict=True):
        d_bytes[dl][do:do + n].copy_(buf[pos:pos + n])
        pos += n


# ------------------------------------------------------------------ in-process
def expose_inproc(transport, tensors: Sequence[torch.Tensor]) -> bytes:
    """Register state tensors with an `InProcTransport`; returns their token."""
    return transport.expose(list(tensors))


def pull_inproc(sources: Mapping[int, tuple[bytes, Regions]], dst: Sequence[torch.Tensor]) -> TransferStats:
    """`sources[src_rank] = (token, regions)`: copy each source's regions into `dst`."""
    from splitserve.engine.transfer import inproc

    start, total, count = time.perf_counter(), 0, 0
    for src_rank, (token, regions) in sorted(sources.items()):
        tensors = inproc.exposed(token, f"source rank {src_rank}: state endpoint")
        total += copy_regions(regions, tensors, dst)
        count += len(regions)
    return TransferStats(total, time.perf_counter() - start, count)


# ------------------------------------------------------------------------ NIXL
def register_nixl(transport, tensors: Sequence[torch.Tensor]) -> bytes:
    """Register state tensors with a `NixlTransport` (call before its KV `expose`); returns
    the state endpoint: the tensors' addresses (the agent is the KV endpoint's)."""
    transport._register(list(tensors))
    mem = "VRAM" if tensors and tensors[0].is_cuda else "DRAM"
    device = tensors[0].get_device() if tensors and tensors[0].is_cuda else 0
    header = json.dumps({"addrs": [t.data_ptr() for t in tensors], "mem": mem, "device": device}).encode()
    return _NIXL_MAGIC + struct.pack("<I", len(header)) + header


def _nixl_endpoint(data: bytes) -> dict:
    if not data.startswith(_NIXL_MAGIC):
        raise TransferError(f"not a NIXL state endpoint (starts {data[:8]!r})")
    (size,) = struct.unpack_from("<I", data, len(_NIXL_MAGIC))
    start = len(_NIXL_MAGIC) + 4
    return json.loads(data[start:start + size])


def pull_nixl(
    transport,
    sources: Mapping[int, tuple[bytes, bytes, Regions]],
    dst: Sequence[torch.Tensor],
    timeout_s: float = 30.0,
) -> TransferStats:
    """`sources[src_rank] = (kv endpoint bytes, state endpoint bytes, regions)`: one NIXL READ per source."""
    start = time.perf_counter()
    agent = transport._agent
    transport._register(list(dst))
    local_mem = "VRAM" if dst[0].is_cuda else "DRAM"
    local_dev = dst[0].get_device() if dst[0].is_cuda else 0
    local_addrs = np.asarray([t.data_ptr() for t in dst], dtype=np.int64)
    pending, total, count = {}, 0, 0
    try:
        for src_rank, (kv_endpoint, state_endpoint, regions) in sorted(sources.items()):
            if not len(regions):
                continue
            _check(dst, regions, "dst")
            ep = _nixl_endpoint(state_endpoint)
            remote_addrs = np.asarray(ep["addrs"], dtype=np.int64)
            local = np.stack([local_addrs[regions.dst_layer] + regions.dst_offset, regions.num_bytes,
                              np.full(len(regions), local_dev)], axis=1).astype(np.uint64)
            far = np.stack([remote_addrs[regions.src_layer] + regions.src_offset, regions.num_bytes,
                            np.full(len(regions), ep["device"])], axis=1).astype(np.uint64)
            # the KV endpoint as the KV pull parsed and remembered it (a VRAM one carries ~13 KB of CUDA
            # IPC handles: parsing it per pull was ~0.1 ms on the H200 host); its agent metadata keeps its hash
            name = transport._remote_agent(transport._parse(kv_endpoint).agent_metadata)
            handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, local_mem),
                                           agent.get_xfer_descs(far, ep["mem"]), name)
            if agent.transfer(handle) == "ERR":
                handle.release()
                raise TransferError(f"NIXL state read from source rank {src_rank} failed to start")
            pending[src_rank] = handle
            total += regions.bytes_total
            count += len(regions)
        transport._wait(pending, time.monotonic() + timeout_s, timeout_s)
    finally:
        for handle in pending.values():
            try:
                handle.release()
            except Exception:  # noqa: BLE001 - an unabortable transfer stays on NIXL's leak list
                pass
    return TransferStats(total, time.perf_counter() - start, count)


# ------------------------------------------------------------------ torch_dist
def send_packed(bufs: Mapping[int, torch.Tensor], group, timeout_s: float = 30.0) -> None:
    """`bufs[peer]`: packed state for that pair-group rank."""
    from splitserve.engine.transfer.torch_dist import _post, _wait

    ops = [(True, buf, peer) for peer, buf in sorted(bufs.items()) if buf.numel()]
    if ops:
        _wait(_post(group, ops), f"state peers {sorted(bufs)}", timeout_s, ops[0][1].device)


def recv_packed(sizes: Mapping[int, int], group, device: torch.device, timeout_s: float = 30.0) -> dict[int, torch.Tensor]:
    """Receive `sizes[peer]` bytes from each pair-group peer."""
    from splitserve.engine.transfer.torch_dist import _post, _wait

    bufs = {peer: torch.empty(n, dtype=torch.uint8, device=device) for peer, n in sorted(sizes.items())}
    ops = [(False, buf, peer) for peer, buf in bufs.items() if buf.numel()]
    if ops:
        _wait(_post(group, ops), f"state peers {sorted(sizes)}", timeout_s, device)
    return bufs
