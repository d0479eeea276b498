"""Bodies of the processes of the hybrid disaggregation tests: a prefill engine group and a
decode engine group, each its own TP × PP world (one process per rank, gloo), handing off
KV + recurrent state per request over real NIXL (pull) or a gloo pair group (push).

Queues stand in for the gRPC hops: the descriptor (prefill rank 0 → every decode rank) and,
for the push, what the decode side asks for (decode rank 0 → every prefill rank).
"""

from __future__ import annotations

import dataclasses
import os
import traceback

SEND_TIMEOUT_S = 60.0


def _init(rank: int, world: int, rendezvous: str) -> None:
    import torch
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)


def _pair_group(case: dict, pair_rank: int):
    import torch

    from splitserve.engine.transfer.pair_group import PairGroupSpec, create_pair_group

    world = case["src_world"] + case["dst_world"]
    spec = PairGroupSpec(key="hybrid", store_path=case["pair_store"], rank=pair_rank, world_size=world, backend="gloo")
    return create_pair_group(spec, torch.device("cpu"), SEND_TIMEOUT_S)


def _llm(case: dict, role: str, tp: int, pp: int):
    from splitserve import LLM

    return LLM(case["model"], role=role, tensor_parallel_size=tp, pipeline_parallel_size=pp, **case["options"])


def prefill_main(rank: int, case: dict, desc_queues, ask_queues, done, results) -> None:
    try:
        _prefill(rank, case, desc_queues, ask_queues, done)
        results.put(("prefill", rank, None))
    except BaseException:  # noqa: BLE001 - the parent must hear about any failure
        results.put(("prefill", rank, traceback.format_exc()))


def _prefill(rank, case, desc_queues, ask_queues, done) -> None:
    from splitserve.engine.handoff import RankEndpoint, build_descriptor, engine_layout, group_block_checksums
    from splitserve.engine.state_handoff import build_state_handoff, engine_state_layout, state_tensors
    from splitserve.engine.transfer.plan import build_plan
    from splitserve.engine.transfer.state_plan import build_state_plan, state_regions
    from splitserve.engine.transfer.state_transport import pack, register_nixl, send_packed
    from splitserve.engine.transfer.torch_dist import send_plan

    tp, pp = case["src"]
    _init(rank, tp * pp, case["src_rdzv"])
    engine = _llm(case, "prefill", tp, pp).engine
    transport, group = None, None
    kv_ep = state_ep = b""
    if case["transport"] == "nixl":
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        transport = NixlTransport(f"hybrid-prefill-{case['tag']}-{rank}")
        state_ep = register_nixl(transport, state_tensors(engine))  # before expose: the metadata covers it
        kv_ep = transport.expose(engine.kv_caches)
    endpoints = engine.ps.broadcast_from_first(engine.ps.gather_to_first((kv_ep, state_ep)))
    for i, prompt in enumerate(case["prompts"]):
        engine.add_request(f"r{i}", prompt, case["params"])
    while engine.has_unfinished():
        engine.step()
    for i in range(len(case["prompts"])):
        rid = f"r{i}"
        h = engine.handoffs[rid]
        checksums = group_block_checksums(engine, h.block_ids)
        state = build_state_handoff(engine, rid, {r: e[1] for r, e in enumerate(endpoints)})
        if engine.ps.rank == 0:
            desc = build_descriptor(engine, h, {r: RankEndpoint(r, "local", e[0]) for r, e in enumerate(endpoints)},
                                    case["transport"], checksums)
            for q in desc_queues:
                q.put(dataclasses.replace(desc, state=state))
    if case["transport"] == "torch_dist":
        group = _pair_group(case, rank)
        peers = {d: case["src_world"] + d for d in range(case["dst_world"])}
        for _ in range(2 * len(case["prompts"])):  # per request: a KV push, then a state push
            kind, rid, *args = ask_queues[rank].get(timeout=SEND_TIMEOUT_S * 4)
            h = engine.handoffs[rid]
            if kind == "kv":
                dst_layout, dst_blocks, first_block = args
                plan = build_plan(engine_layout(engine), dst_layout, {r: h.block_ids for r in range(tp * pp)},
                                  {r: dst_blocks for r in range(dst_layout.world_size)}, first_block)
                send_plan(plan, rank, engine.kv_caches, peers, group, SEND_TIMEOUT_S)
            else:
                dst_layout, dst_slot = args
                src_layout = engine_state_layout(engine)
                ops = [op for op in build_state_plan(src_layout, dst_layout) if op.src_rank == rank]
                slot = engine.runner.states.pool.slot_of(rid)
                bufs = {peers[d]: pack(state_regions([o for o in ops if o.dst_rank == d], src_layout, dst_layout,
                                                     slot, dst_slot), state_tensors(engine))
                        for d in sorted({o.dst_rank for o in ops})}
                send_packed(bufs, group, SEND_TIMEOUT_S)
    done.wait(timeout=SEND_TIMEOUT_S * 6)
    for i in range(len(case["prompts"])):
        engine.release_handoff(f"r{i}")
    engine.check_integrity()
    if transport is not None:
        transport.close()


def decode_main(rank: int, case: dict, desc_queues, ask_queues, done, results) -> None:
    try:
        tokens = _decode(rank, case, desc_queues[rank], ask_queues)
        results.put(("decode", rank, tokens))
    except BaseException:  # noqa: BLE001
        results.put(("decode", rank, traceback.format_exc()))


def _decode(rank, case, desc_queue, ask_queues):
    from splitserve.engine.handoff import engine_layout, make_importer
    from splitserve.engine.state_handoff import engine_state_layout, state_tensors
    from splitserve.engine.transfer.state_plan import state_regions
    from splitserve.engine.transfer.state_transport import recv_packed, unpack
    from splitserve.engine.transfer.torch_dist import recv_plan

    tp, pp = case["dst"]
    _init(rank, tp * pp, case["dst_rdzv"])
    engine = _llm(case, "decode", tp, pp).engine
    transport = transfer = state_step = group = None
    if case["transport"] == "nixl":
        from splitserve.engine.transfer.nixl_transport import NixlTransport

        transport = NixlTransport(f"hybrid-decode-{case['tag']}-{rank}")
    else:
        group = _pair_group(case, case["src_world"] + rank)
    peers = {s: s for s in range(case["src_world"])}  # prefill ranks come first in the pair group
    tokens = []
    for prompt in case["prompts"]:
        desc = desc_queue.get(timeout=SEND_TIMEOUT_S * 4)
        if group is not None:

            def transfer(plan, dst_blocks, rid=desc.request_id):
                if engine.ps.rank == 0:
                    for q in ask_queues:
                        q.put(("kv", rid, engine_layout(engine), list(dst_blocks), plan.first_block))
                return recv_plan(plan, engine.ps.rank, engine.kv_caches, peers, group, SEND_TIMEOUT_S)

            def state_step(handoff, ops, dst_slot, rid=desc.request_id):
                dst_layout = engine_state_layout(engine)
                if engine.ps.rank == 0:
                    for q in ask_queues:
                        q.put(("state", rid, dst_layout, dst_slot))
                mine = [op for op in ops if op.dst_rank == engine.ps.rank]
                regions = {s: state_regions([o for o in mine if o.src_rank == s], handoff.layout, dst_layout,
                                            handoff.slot, dst_slot) for s in sorted({o.src_rank for o in mine})}
                bufs = recv_packed({peers[s]: r.bytes_total for s, r in regions.items()}, group,
                                   state_tensors(engine)[0].device, SEND_TIMEOUT_S)
                for s, r in regions.items():
                    unpack(bufs[peers[s]], r, state_tensors(engine))

        importer = make_importer(engine, transport, desc, SEND_TIMEOUT_S, transfer=transfer, state_step=state_step)
        engine.add_imported_request(desc.request_id, prompt, case["params"], desc.first_token_id,
                                    desc.first_token_logprob, importer)
        final = None
        while engine.has_unfinished():
            for out in engine.step():
                if out.result is not None and out.result.is_finished:
                    final = out.result
        tokens.append((final.generated_tokens, final.generated_log_probs) if final is not None else None)
    engine.check_integrity()
    if transport is not None:
        transport.close()
    return tokens if engine.ps.is_driver else None


def run_disaggregated(case: dict, timeout_s: float = 300.0):
    """Start both groups; return the decode driver's [(tokens, logprobs)] per prompt."""
    import multiprocessing as mp
    import queue as queue_mod
    import tempfile
    import time

    ctx = mp.get_context("spawn")
    src_world, dst_world = case["src"][0] * case["src"][1], case["dst"][0] * case["dst"][1]
    with tempfile.TemporaryDirectory(prefix="hybrid-disagg-") as tmp:
        case = dict(case, src_world=src_world, dst_world=dst_world, src_rdzv=f"{tmp}/src", dst_rdzv=f"{tmp}/dst",
                    pair_store=f"{tmp}/pair")
        desc_queues = [ctx.Queue() for _ in range(dst_world)]
        ask_queues = [ctx.Queue() for _ in range(src_world)]
        done, results = ctx.Event(), ctx.Queue()
        procs = [ctx.Process(target=prefill_main, args=(r, case, desc_queues, ask_queues, done, results), daemon=True)
                 for r in range(src_world)]
        procs += [ctx.Process(target=decode_main, args=(r, case, desc_queues, ask_queues, done, results), daemon=True)
                  for r in range(dst_world)]
        for p in procs:
            p.start()
        got: dict = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < len(procs):
                try:
                    side, rank, value = results.get(timeout=1.0)
                except queue_mod.Empty:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"only {sorted(got)} finished in {timeout_s} s") from None
                    dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                    if dead:
                        raise RuntimeError(f"a process died with exit code {dead[0]}") from None
                    continue
                if isinstance(value, str):
                    raise RuntimeError(f"{side} rank {rank} failed:\n{value}")
                got[(side, rank)] = value
                if sum(1 for s, _ in got if s == "decode") == dst_world:
                    done.set()
        finally:
            done.set()
            for p in procs:
                p.join(timeout=20)
                if p.is_alive():
                    p.kill()
                    p.join()
    driver = (case["dst"][1] - 1) * case["dst"][0]
    return got[("decode", driver)]
