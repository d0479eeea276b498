"""Shared helpers for the transfer tests: random logical KV, scattering it onto a layout's ranks,
and exact (bitwise) checks of what a destination holds. Also the bodies of spawned processes.

Logical KV of a request: `[num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim]`,
block j = tokens [j*block_size, (j+1)*block_size).
"""

from __future__ import annotations

import random

import torch

from splitserve.engine.transfer.kv_tensors import torch_dtype
from splitserve.engine.transfer.layout import KVLayout

SENTINEL = -7.25


def layout(tp: int, pp: int, kv_heads: int, *, num_layers: int = 3, head_dim: int = 4, block_size: int = 2,
           dtype: str = "float32", layer_ranges: tuple = ()) -> KVLayout:
    return KVLayout(dtype=dtype, block_size=block_size, tp=tp, pp=pp, num_layers=num_layers,
                    num_kv_heads=kv_heads, head_dim=head_dim, layer_ranges=layer_ranges)


def random_logical(lay: KVLayout, num_blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (lay.num_layers, 2, num_blocks, lay.num_kv_heads, lay.block_size, lay.head_dim)
    return torch.randn(shape, generator=g).to(torch_dtype(lay))


def block_tables(lay: KVLayout, num_blocks: int, pool: int, seed: int, contiguous: bool = False
                 ) -> dict[int, list[int]]:
    """Per-rank block ids: distinct per rank; random unless `contiguous` (then a shifted range)."""
    rng = random.Random(seed)
    tables = {}
    for rank in range(lay.world_size):
        if contiguous:
            start = rng.randrange(0, pool - num_blocks + 1)
            tables[rank] = list(range(start, start + num_blocks))
        else:
            tables[rank] = rng.sample(range(pool), num_blocks)
    return tables


def scatter(logical: torch.Tensor, lay: KVLayout, tables: dict[int, list[int]], pool: int,
            first_block: int = 0) -> dict[int, list[torch.Tensor]]:
    """Per-rank KV pools (filled with SENTINEL) holding logical blocks [first_block, n) at `tables`."""
    out = {}
    n = logical.shape[2]
    for rank in range(lay.world_size):
        tp_rank, pp_rank = lay.tp_rank(rank), lay.pp_rank(rank)
        h0, h1 = lay.heads_of(tp_rank)
        start, end = lay.layer_ranges[pp_rank]
        tensors = []
        for layer in range(start, end):
            t = torch.full(lay.kv_shape(pool), SENTINEL, dtype=logical.dtype)
            for j in range(first_block, n):
                t[:, tables[rank][j]] = logical[layer, :, j, h0:h1]
            tensors.append(t)
        out[rank] = tensors
    return out


def gather(kv: dict[int, list[torch.Tensor]], lay: KVLayout, tables: dict[int, list[int]], num_blocks: int
           ) -> torch.Tensor:
    """Rebuild logical KV from each head's primary holder."""
    shape = (lay.num_layers, 2, num_blocks, lay.num_kv_heads, lay.block_size, lay.head_dim)
    out = torch.full(shape, float("nan"), dtype=kv[0][0].dtype)
    for rank, tensors in kv.items():
        tp_rank, pp_rank = lay.tp_rank(rank), lay.pp_rank(rank)
        h0, h1 = lay.heads_of(tp_rank)
        if not lay.is_primary(tp_rank, h0):
            continue
        start = lay.layer_ranges[pp_rank][0]
        idx = torch.tensor(tables[rank][:num_blocks])
        for i, t in enumerate(tensors):
            out[start + i, :, :, h0:h1] = t.index_select(1, idx)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view for exact comparison (NaN-safe)."""
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32 if t.element_size() == 4
                               else torch.uint8)


def assert_same_bits(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, what
    diff = (bits(actual) != bits(expected)).nonzero()
    assert diff.numel() == 0, f"{what}: {diff.shape[0]} elements differ, first at {diff[0].tolist()}"


def assert_pools_equal(actual: dict[int, list[torch.Tensor]], expected: dict[int, list[torch.Tensor]],
                       what: str) -> None:
    assert sorted(actual) == sorted(expected)
    for rank in expected:
        for i, (a, e) in enumerate(zip(actual[rank], expected[rank], strict=True)):
            assert_same_bits(a, e, f"{what}: rank {rank} local layer {i}")


# ---- bodies of spawned processes (must be importable by name) -----------------------------------

def _report(results, key, body) -> None:
    """Run `body`, put (key, None) or (key, traceback text) on the results queue."""
    import traceback

    torch.set_num_threads(1)
    try:
        body()
        results.put((key, None))
    except BaseException:  # noqa: B036 - the parent must hear about any failure
        results.put((key, traceback.format_exc()))


def handoff_case(case: dict):
    """Everything both sides derive from a shared description: layouts, tables, logical KV, plan."""
    from splitserve.engine.transfer.plan import build_plan

    src_lay, dst_lay = layout(**case["src"]), layout(**case["dst"])
    n, pool, seed = case["num_blocks"], case["pool"], case["seed"]
    logical = random_logical(src_lay, n, seed)
    src_tables = case.get("src_tables") or block_tables(src_lay, n, pool, seed)
    dst_tables = case.get("dst_tables") or block_tables(dst_lay, n, pool, seed + 1,
                                                        contiguous=case.get("dst_contiguous", False))
    plan = build_plan(src_lay, dst_lay, src_tables, dst_tables, case["first_block"])
    return src_lay, dst_lay, logical, src_tables, dst_tables, plan


def check_destination(case: dict, dst_rank: int, kv: list[torch.Tensor]) -> None:
    """Assert dst rank's pool holds exactly the transferred logical blocks, sentinel elsewhere."""
    _, dst_lay, logical, _, dst_tables, _ = handoff_case(case)
    expected = logical.clone()
    expected[:, :, :case["first_block"]] = SENTINEL
    want = scatter(expected, dst_lay, dst_tables, case["pool"])[dst_rank]
    for i, (a, e) in enumerate(zip(kv, want, strict=True)):
        assert_same_bits(a, e, f"dst rank {dst_rank} local layer {i}")


def _ucx_env(case: dict) -> None:
    """`case["ucx_tls"]`: the UCX transports of this process (before its first agent)."""
    if case.get("ucx_tls"):
        import os

        os.environ["UCX_TLS"] = case["ucx_tls"]


def _on_device(case: dict, kv: dict[int, list[torch.Tensor]]) -> dict[int, list[torch.Tensor]]:
    """`case["cuda"]`: the pools in VRAM."""
    return {r: [t.cuda() for t in ts] for r, ts in kv.items()} if case.get("cuda") else kv


def nixl_source_process(case: dict, conn, results) -> None:
    """Hosts every source rank of `case` (one NIXL agent each); sends endpoints, waits for 'done'."""
    def body():
        from splitserve.engine.transfer.checksum import unit_checksums
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        _ucx_env(case)
        src_lay, _, logical, src_tables, _, _ = handoff_case(case)
        kv = _on_device(case, scatter(logical, src_lay, src_tables, case["pool"]))
        transports = [NixlTransport(f"src-{rank}-{case['seed']}") for rank in range(src_lay.world_size)]
        remote = {rank: transports[rank].expose(kv[rank]) for rank in kv}
        checksums = {}
        for rank in kv:
            checksums |= unit_checksums([t.cpu() for t in kv[rank]], src_lay, rank, src_tables[rank],
                                        case["first_block"])
        conn.send((remote, checksums))
        assert conn.poll(60), "destination never finished"
        assert conn.recv() == "done"
        for t in transports:
            t.close()
    _report(results, "source", body)


def nixl_destination_process(case: dict, conn, results) -> None:
    """Every destination rank of `case` pulls through its own agent, then verifies bytes + checksums."""
    def body():
        from splitserve.engine.transfer.checksum import verify_unit_checksums
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        _ucx_env(case)
        _, dst_lay, logical, _, dst_tables, plan = handoff_case(case)
        kv = _on_device(case, scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_tables, case["pool"]))
        assert conn.poll(60), "source never sent its endpoints"
        remote, checksums = conn.recv()
        try:
            for rank in range(dst_lay.world_size):
                with NixlTransport(f"dst-{rank}-{case['seed']}", progress_thread=case.get("dst_progress_thread", True)) as t:
                    stats = t.pull(plan, rank, remote, kv[rank], timeout_s=30)
                    if "same_host" in case:  # VRAM on one host: mapped over CUDA IPC, or NIXL when off
                        assert t._same_host.pulls == int(case["same_host"]), t._same_host.pulls
                assert stats.num_bytes == sum(n for (_, d), n in plan.bytes_by_pair().items() if d == rank)
                landed = [x.cpu() for x in kv[rank]]
                check_destination(case, rank, landed)
                assert verify_unit_checksums(landed, dst_lay, rank, dst_tables[rank], checksums,
                                             case["first_block"]) == []
        finally:
            conn.send("done")
    _report(results, "destination", body)


def gloo_process(cases: list[dict], roles: list[dict], pg_rank: int, world: int, init_file: str, results) -> None:
    """One torch.distributed rank; for each case, `roles[i]` maps pg rank -> ("src"|"dst", plan rank)."""
    def body():
        from datetime import timedelta

        import torch.distributed as dist

        from splitserve.engine.transfer import p2p_messages
        from splitserve.engine.transfer.torch_dist import recv_plan, send_plan

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=pg_rank, world_size=world,
                                timeout=timedelta(seconds=60))
        default_chunk, default_direct = p2p_messages.CHUNK_BYTES, p2p_messages.DIRECT_BYTES
        try:
            for case, role in zip(cases, roles, strict=True):
                src_lay, dst_lay, logical, src_tables, dst_tables, plan = handoff_case(case)
                peers_src = {r: g for g, (side, r) in role.items() if side == "src"}
                peers_dst = {r: g for g, (side, r) in role.items() if side == "dst"}
                side, rank = role[pg_rank]
                p2p_messages.CHUNK_BYTES = case.get("chunk_bytes", default_chunk)  # both sides alike
                p2p_messages.DIRECT_BYTES = case.get("direct_bytes", default_direct)
                if side == "src":
                    kv = scatter(logical, src_lay, src_tables, case["pool"])[rank]
                    if case.get("layerwise"):
                        stats = layerwise_send(plan, rank, kv, peers_dst)
                    else:
                        stats = send_plan(plan, rank, kv, peers_dst, timeout_s=30)
                    assert stats.num_bytes == sum(n for (s, _), n in plan.bytes_by_pair().items() if s == rank)
                else:
                    kv = scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_tables, case["pool"])[rank]
                    stats = recv_plan(plan, rank, kv, peers_src, timeout_s=30, by_layer=case.get("layerwise", False))
                    assert stats.num_bytes == sum(n for (_, d), n in plan.bytes_by_pair().items() if d == rank)
                    check_destination(case, rank, kv)
        finally:
            dist.destroy_process_group()
    _report(results, pg_rank, body)


def layerwise_send(plan, rank: int, kv: list[torch.Tensor], peers: dict[int, int]):
    """`send_plan` as a layer-wise push from a rank still "prefilling": its pool holds SENTINEL,
    and a thread writes each layer the push reads only once the push asks for it (`layer_ready`),
    so a layer packed or sent early arrives as SENTINEL. Asserts that each layer's messages were
    posted before the push asked for the next layer, i.e. while the "prefill" was still going."""
    import threading

    from splitserve.engine.transfer import torch_dist
    from splitserve.engine.transfer.p2p_messages import layer_groups

    final = [t.clone() for t in kv]
    for t in kv:
        t.fill_(SENTINEL)
    asked = {layer for d in {op.dst_rank for op in plan.ops_for_src(rank)}
             for layer, _ in layer_groups(plan.ops_for_pair(rank, d), by_layer=True)}
    ask = [threading.Event() for _ in kv]
    written = [threading.Event() for _ in kv]
    log: list[tuple[str, int]] = []

    def writer() -> None:
        for layer, t in enumerate(kv):
            if layer in asked and not ask[layer].wait(30):
                return
            t.copy_(final[layer])
            written[layer].set()

    def ready(layer: int, seconds_left: float) -> None:
        log.append(("ready", layer))
        ask[layer].set()
        assert written[layer].wait(seconds_left), f"layer {layer} never written"

    real_post = torch_dist._post

    def post(group, ops):
        log.append(("post", len(ops)))
        return real_post(group, ops)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    torch_dist._post = post
    try:
        stats = torch_dist.send_plan(plan, rank, kv, peers, timeout_s=30, layer_ready=ready)
    finally:
        torch_dist._post = real_post
    thread.join(5)
    readies = [i for i, (what, _) in enumerate(log) if what == "ready"]
    assert [log[i][1] for i in readies] == sorted(asked), log
    for i, j in zip(readies, readies[1:] + [len(log)], strict=True):
        assert any(what == "post" for what, _ in log[i + 1:j]), f"layer {log[i][1]} sent nothing before the next: {log}"
    return stats


def run_processes(targets: list[tuple], timeout_s: float = 90) -> None:
    """Spawn one process per (function, args...), wait, and fail with every child's traceback."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=fn, args=(*args, results), daemon=True) for fn, *args in targets]
    for p in procs:
        p.start()
    errors = {}
    try:
        for _ in procs:
            try:
                key, error = results.get(timeout=timeout_s)
            except queue.Empty:
                errors["parent"] = f"no result within {timeout_s}s; exit codes {[p.exitcode for p in procs]}"
                break
            if error:
                errors[key] = error
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    assert not errors, "\n".join(f"--- {key} ---\n{err}" for key, err in errors.items())
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


def gloo_silent_peer_process(pg_rank: int, init_file: str, results) -> None:
    """Rank 0 receives a plan that rank 1 never sends: it must raise TransferTimeout promptly."""
    def body():
        import time
        from datetime import timedelta

        import pytest
        import torch.distributed as dist

        from splitserve.engine.transfer.plan import build_plan
        from splitserve.engine.transfer.torch_dist import recv_plan
        from splitserve.engine.transfer.transport import TransferTimeout

        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=pg_rank, world_size=2,
                                timeout=timedelta(seconds=60))
        try:
            lay = layout(1, 1, 2)
            plan = build_plan(lay, lay, {0: [0]}, {0: [1]})
            if pg_rank == 0:
                start = time.monotonic()
                with pytest.raises(TransferTimeout, match=r"source ranks \[0\] timed out after 0.5s"):
                    recv_plan(plan, 0, [torch.zeros(lay.kv_shape(2)) for _ in range(3)], {0: 1}, timeout_s=0.5)
                assert time.monotonic() - start < 5
            else:
                time.sleep(1.5)
        finally:
            dist.destroy_process_group()
    _report(results, pg_rank, body)
