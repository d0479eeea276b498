"""The two processes of benchmarks/handoff.py: a source that holds (and "prefills") a KV pool,
and a destination that pulls from it and times the pulls against a plain copy.

Commands over the pipe, destination → source:
    ("prefill", num_tokens, layer_s, request_id, dst_tp)
                                                   open a board slot, say ("started", slot,
                                                   endpoint bytes), then mark one layer every
                                                   layer_s seconds (nixl_packed: pack each layer
                                                   for a tp=dst_tp destination first); send the
                                                   monotonic time prefill ended; wait for the
                                                   ack; close the slot (and free the packing)
    plan (torch_dist only)                         send this plan's ops
    ("push", plan, layer_s, layerwise)             (torch_dist only) "compute" one layer every
                                                   layer_s seconds and push the plan's ops after
                                                   the last, or each layer once computed; send the
                                                   monotonic time prefill ended
    None                                           exit
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from datetime import timedelta

import torch

LAYERS, HEADS, HEAD_DIM, BLOCK = 16, 8, 64, 16
STREAMING = ("shm", "nixl", "nixl_strided", "nixl_packed")
"""Transports with a progress board (layer-wise streaming)."""


def layout(tp: int = 1):
    from splitserve.engine.transfer.layout import KVLayout

    return KVLayout(dtype="bfloat16", block_size=BLOCK, tp=tp, pp=1, num_layers=LAYERS, num_kv_heads=HEADS,
                    head_dim=HEAD_DIM)


def _host(shape, dtype) -> torch.Tensor:
    """CPU memory as the engine allocates its KV pool (huge pages, engine/host_memory.py), for the
    pools and the plain copy alike."""
    from splitserve.engine.host_memory import huge_page_empty

    return huge_page_empty(shape, dtype)


def pool(num_blocks: int, heads: int, device: str) -> tuple[torch.Tensor, ...]:
    """A tuple of layers, as the engine holds its pool (engine/kv_cache.py)."""
    shape = (2, num_blocks, heads, BLOCK, HEAD_DIM)
    if device == "cuda":
        return tuple(torch.randn(shape, device=device).to(torch.bfloat16) for _ in range(LAYERS))
    return tuple(_host(shape, torch.bfloat16).copy_(torch.randn(shape)) for _ in range(LAYERS))


def make(kind: str, pack_arena_bytes: int = 0, *, source: bool = True):
    """nixl_strided: reshards read head slices from the pool (A/B against nixl's staging);
    nixl_packed: the source packs them (engine/transfer/source_pack.py). A NIXL destination
    runs without NIXL's progress thread, as a decode worker does (engine/worker_runtime.py)."""
    if kind in ("nixl", "nixl_strided", "nixl_packed"):
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        return NixlTransport(stage_reshards=kind == "nixl", pack_arena_bytes=pack_arena_bytes,
                             progress_thread=source)
    if kind == "shm":
        from splitserve.engine.transfer.shm_transport import ShmTransport

        return ShmTransport()
    from splitserve.engine.transfer.cuda_ipc import CudaIpcTransport

    return CudaIpcTransport()


def pair_group(store_dir: str, rank: int, device: str):
    store = torch.distributed.FileStore(os.path.join(store_dir, "store"), 2)
    if device == "cuda":
        return torch.distributed.ProcessGroupNCCL(store, rank, 2)
    return torch.distributed.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))


def source(conn, kind: str, max_blocks: int, device: str, store_dir: str, threads: int) -> None:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    kv = pool(max_blocks, HEADS, device)
    if kind == "torch_dist":
        from splitserve.engine.transfer.torch_dist import send_plan

        conn.send((b"", b""))  # first: the destination joins the group after this
        group = pair_group(store_dir, 0, device)
        while (msg := conn.recv()) is not None:
            if isinstance(msg, tuple):  # ("push", plan, layer_s, layerwise): a modelled prefill
                _, plan, layer_s, layerwise = msg
                _push_during_prefill(conn, plan, kv, group, layer_s, layerwise)
            else:
                send_plan(msg, 0, kv, {0: 1}, group=group)
        return
    packing = kind == "nixl_packed"
    transport = make(kind, sum(t.numel() * t.element_size() for t in kv) if packing else 0)
    conn.send((transport.expose(kv), b""))
    board = transport.board
    while (msg := conn.recv()) is not None:
        _, num_tokens, layer_s, request_id, dst_tp = msg
        slot = board.open(request_id)
        blocks = list(range(num_tokens // BLOCK))
        if packing:
            transport.pack_begin(request_id, layout(1), layout(dst_tp), 0, blocks)
            meta = transport.packed_metadata(request_id)
        conn.send(("started", slot, meta if packing else None))
        pack_s = 0.0
        for layer in range(LAYERS):  # "compute" the layer (pack it), then publish it (readiness only)
            if layer_s:
                time.sleep(layer_s)
            if packing:
                t0 = time.perf_counter()
                transport.pack_layers(request_id, kv, layer, layer + 1)
                pack_s += time.perf_counter() - t0
            board.mark(slot, layer, None, (), num_tokens)
        conn.send((time.monotonic(), pack_s))
        conn.recv()  # the destination's ack
        if packing:
            transport.pack_release(request_id)
        board.close(request_id)
    transport.close()


def _push_during_prefill(conn, plan, kv, group, layer_s: float, layerwise: bool) -> None:
    """torch_dist's exposed-time run: "compute" one layer every `layer_s` (sleeping), then push
    after the last (`layerwise` False), or push each layer as it is computed; send the monotonic
    time prefill ended once the push is done."""
    from splitserve.engine.transfer.torch_dist import send_plan

    start = time.monotonic()
    prefill_end = start + LAYERS * layer_s

    def layer_ready(layer: int, seconds_left: float) -> None:
        time.sleep(max(0.0, start + (layer + 1) * layer_s - time.monotonic()))

    if layerwise:
        send_plan(plan, 0, kv, {0: 1}, group=group, layer_ready=layer_ready)
    else:
        time.sleep(max(0.0, prefill_end - time.monotonic()))
        send_plan(plan, 0, kv, {0: 1}, group=group)
    conn.send(prefill_end)


_COPY_BUFFERS: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _copy_time(moved: int, device: str) -> float:
    """One plain copy of `moved` bytes. The source holds data: never-written pages all map the
    kernel's zero page, and reading them would time a cache-resident copy, not a memcpy."""
    if moved not in _COPY_BUFFERS:
        _COPY_BUFFERS.clear()
        if device == "cuda":
            a, b = torch.randint(0, 256, (moved,), dtype=torch.uint8, device=device), torch.empty(moved, dtype=torch.uint8, device=device)
        else:
            a, b = _host(moved, torch.uint8), _host(moved, torch.uint8)
            a.copy_(torch.randint(0, 256, (moved,), dtype=torch.uint8))
        _COPY_BUFFERS[moved] = (a, b.fill_(1))
    a, b = _COPY_BUFFERS[moved]
    _sync(device)
    t0 = time.perf_counter()
    b.copy_(a)
    _sync(device)
    return time.perf_counter() - t0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _only_rank0(plan):
    return replace(plan, ops=tuple(op for op in plan.ops if op.dst_rank == 0))


def destination(conn, kind, tokens, device, store_dir, prefill_tok_s, repeats, exposed, threads, out) -> None:
    torch.set_num_threads(threads)
    from splitserve.engine.transfer.plan import build_plan
    from splitserve.engine.transfer.progress import request_tag
    from splitserve.engine.transfer.streaming import StreamSpec, streamed_pull

    meta, _ = conn.recv()
    group = pair_group(store_dir, 1, device) if kind == "torch_dist" else None
    transport = None if kind == "torch_dist" else make(kind, source=False)
    rows = []
    for n_tokens in tokens:
        n = n_tokens // BLOCK
        for case, dst_tp in (("same", 1), ("reshard", 2)):
            kv = pool(n, HEADS // dst_tp, device)
            plan = _only_rank0(build_plan(layout(1), layout(dst_tp), {0: list(range(n))},
                                          {r: list(range(n)) for r in range(dst_tp)}))

            def pull(plan=plan, kv=kv, dst_tp=dst_tp, n_tokens=n_tokens):
                if kind == "nixl_packed" and dst_tp > 1:  # the source packs while we read: timed together
                    return _packed_pull(conn, transport, plan, kv, n_tokens, dst_tp)
                if kind == "torch_dist":
                    from splitserve.engine.transfer.torch_dist import recv_plan

                    conn.send(plan)
                    return recv_plan(plan, 0, kv, {0: 0}, group=group)
                return transport.pull(plan, 0, {0: meta}, kv)

            moved = pull().num_bytes  # warm-up: registrations, mappings, connections
            times, copies = [], []
            for i in range(repeats):  # interleaved, so both see the same machine load; in
                if i % 2:             # alternating order, so neither always runs right after the other
                    copies.append(_copy_time(moved, device))
                t0 = time.perf_counter()
                stats = pull()  # returns with the data in place (the transports' contract)
                times.append(stats.seconds if kind == "nixl_packed" and dst_tp > 1 else time.perf_counter() - t0)
                _sync(device)
                if not i % 2:
                    copies.append(_copy_time(moved, device))
            prefill_s = n_tokens / prefill_tok_s
            row = dict(case=case, tokens=n_tokens, bytes=moved, gbps=moved / min(times) / 1e9,
                       copy_gbps=moved / min(copies) / 1e9, median_ratio=statistics.median(copies) / statistics.median(times),
                       prefill_s=prefill_s, exposed_off=None, exposed_on=None,
                       pack_ms=1e3 * min(_PACK_TIMES.pop(n_tokens, [float("nan")])))
            if kind in STREAMING and exposed:
                def stream(rid, slot, source_meta, plan=plan, kv=kv, n_tokens=n_tokens):
                    spec = StreamSpec(slot, request_tag(rid), n_tokens)
                    return streamed_pull(transport, plan, 0, {0: source_meta or meta}, kv, spec, timeout_s=120,
                                         verify=False)

                def after(source_meta, plan=plan, kv=kv):
                    return transport.pull(plan, 0, {0: source_meta or meta}, kv)

                row["exposed_off"] = min(_exposed(conn, n_tokens, prefill_s, f"off-{i}", dst_tp, after, None)
                                         for i in range(2))
                row["exposed_on"] = min(_exposed(conn, n_tokens, prefill_s, f"on-{i}", dst_tp, None, stream)
                                        for i in range(2))
            elif kind == "torch_dist" and exposed:
                row["exposed_off"], row["exposed_on"] = (
                    min(_pushed_exposed(conn, plan, kv, group, prefill_s, layerwise) for _ in range(2))
                    for layerwise in (False, True))
            rows.append(row)
    conn.send(None)
    out.put(rows)


_PACKED_REQUESTS = iter(range(1 << 62))


def _packed_pull(conn, transport, plan, kv, n_tokens, dst_tp):
    """A reshard read from a source that packed the head slices (for all `dst_tp` ranks) first,
    as a prefill worker does layer by layer while it computes: the timed pull starts once the
    source has packed (its pack time is printed apart)."""
    rid = f"packed-{next(_PACKED_REQUESTS)}"
    conn.send(("prefill", n_tokens, 0.0, rid, dst_tp))
    started, _, meta = conn.recv()
    assert started == "started"
    _, pack_s = conn.recv()
    _PACK_TIMES.setdefault(n_tokens, []).append(pack_s)
    t0 = time.perf_counter()
    stats = transport.pull(plan, 0, {0: meta}, kv)
    seconds = time.perf_counter() - t0
    conn.send("ack")
    return replace(stats, seconds=seconds)


_PACK_TIMES: dict[int, list[float]] = {}
"""Source seconds spent packing, per prompt length (printed by the destination)."""


def _exposed(conn, n_tokens, prefill_s, request_id, dst_tp, pull_after, stream) -> float:
    """Seconds the handoff ran past the end of a modelled prefill (0 if it finished within it)."""
    conn.send(("prefill", n_tokens, prefill_s / LAYERS, request_id, dst_tp))
    started, slot, meta = conn.recv()
    assert started == "started"
    if stream is not None:
        stream(request_id, slot, meta)
        done = time.monotonic()
        prefill_end, _ = conn.recv()
    else:
        prefill_end, _ = conn.recv()
        pull_after(meta)
        done = time.monotonic()
    conn.send("ack")
    return max(0.0, done - prefill_end)


def _pushed_exposed(conn, plan, kv, group, prefill_s: float, layerwise: bool) -> float:
    """torch_dist: seconds the push ran past the end of a modelled prefill; every receive is
    posted at prefill start."""
    from splitserve.engine.transfer.torch_dist import recv_plan

    conn.send(("push", plan, prefill_s / LAYERS, layerwise))
    recv_plan(plan, 0, kv, {0: 0}, group=group, timeout_s=120, by_layer=layerwise)
    done = time.monotonic()
    return max(0.0, done - conn.recv())


def _tcp_sink(conn, nbytes: int, chunk: int) -> None:
    """Receive `nbytes` on a loopback socket whose port goes back over `conn`, then say done."""
    import socket

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        conn.send(server.getsockname()[1])
        peer, _ = server.accept()
        with peer:
            view, got = memoryview(bytearray(chunk)), 0
            while got < nbytes:
                got += peer.recv_into(view, chunk)
            peer.sendall(b"k")


def tcp_ceiling(ctx, nbytes: int = 512 << 20, chunk: int = 4 << 20, repeats: int = 3) -> tuple[float, float]:
    """(GB/s of raw TCP over loopback between two processes, GB/s of a 1-thread CPU copy of as many bytes),
    best of `repeats` each: what gloo, whose only transport is TCP, could move at most, beside memcpy."""
    import socket

    best_tcp = 0.0
    for _ in range(repeats):
        a, b = ctx.Pipe()
        sink = ctx.Process(target=_tcp_sink, args=(b, nbytes, chunk))
        sink.start()
        data = memoryview(bytearray(os.urandom(chunk)))
        with socket.create_connection(("127.0.0.1", a.recv())) as sock:
            t0 = time.perf_counter()
            for _ in range(nbytes // chunk):
                sock.sendall(data)
            sock.recv(1)
            best_tcp = max(best_tcp, nbytes / (time.perf_counter() - t0))
        sink.join()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best_copy = max(nbytes / _copy_time(nbytes, "cpu") for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
        _COPY_BUFFERS.clear()
    return best_tcp / 1e9, best_copy / 1e9
