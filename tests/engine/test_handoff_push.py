"""The torch_dist handoff between two real processes — a prefill engine and a decode engine,
each with its real worker hooks — over gloo. Only the PushKV RPC is replaced, by a pipe (the
prefill side answers through the same waiter future its gRPC handler uses).

One pair, five requests in order:

    r0 ok       new pair group                    groups joined: decode 1, prefill 1
    r1 ok       the cached group is reused        1, 1
    r2 refused  (its pins were released)          nothing sent, group kept
    r3 lost     granted but never sent            decode times out and drops its group
    r4 ok       a new group replaces both sides'  2, 2
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing as mp
import queue
import time
import traceback

import pytest

from splitserve import LLM, SamplingParams

OPTIONS = dict(block_size_tokens=4, num_blocks=64, max_tokens=64)
PARAMS = SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True, return_log_probs=True)
PROMPTS = [list(range(10, 27)), list(range(30, 52)), list(range(60, 71)), list(range(80, 93)), list(range(100, 119))]
TIMEOUT_S = 30.0
LOST_TIMEOUT_S = 1.0


def _report(results, side: str, body) -> None:
    try:
        results.put((side, body()))
    except BaseException:
        results.put((side, "ERROR\n" + traceback.format_exc()))


def _prefill_side(ckpt: str, conn, results) -> None:
    def body():
        from splitserve.engine.handoff import RankEndpoint
        from splitserve.engine.handoff_push import PushRefusedError, TorchDistTransport
        from splitserve.engine.serving import Command
        from splitserve.prefill_worker.hooks import prefill_hooks

        engine = LLM(ckpt, role="prefill", **OPTIONS).engine
        transport = TorchDistTransport()
        hooks = prefill_hooks(engine, transport, {0: RankEndpoint(0, "pipe", transport.expose(engine.kv_caches))})
        state, push = hooks["state"], hooks["handlers"]["push"]
        joined = []
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{i}"
            state.waiters[rid] = outcome = concurrent.futures.Future()
            engine.add_request(rid, prompt, PARAMS)
            while engine.has_unfinished():
                hooks["after_step"](engine, engine.step())
            conn.send(outcome.result(timeout=0).descriptor)
            if rid == "r2":  # the lease ran out before the decode side asked
                assert engine.release_handoff(rid)
            request = conn.recv()
            if rid == "r3":  # granted, then the prefill never gets to send
                conn.send(transport.grant(engine, request))
            else:
                state.push_waiters["p"] = waiter = concurrent.futures.Future()
                waiter.add_done_callback(lambda f: conn.send(f.result()))
                if rid == "r2":
                    with pytest.raises(PushRefusedError, match="no pinned handoff"):
                        push(engine, Command("push", rid, ("p", request)))
                else:
                    stats = push(engine, Command("push", rid, ("p", request)))
                    assert stats.num_bytes > 0
            engine.release_handoff(rid)
            joined.append(transport.groups.num_created)
            assert conn.recv() == "next"
        engine.check_integrity()
        transport.close()
        return joined

    _report(results, "prefill", body)


def _decode_side(ckpt: str, conn, results) -> None:
    def body():
        from splitserve.decode_worker.hooks import decode_hooks
        from splitserve.engine.handoff import RankEndpoint
        from splitserve.engine.handoff_push import PushGrant, PushRefusedError, TorchDistTransport
        from splitserve.engine.serving import Command
        from splitserve.engine.transfer.transport import TransferTimeout

        expected = LLM(ckpt, **OPTIONS).generate(PROMPTS, PARAMS)
        engine = LLM(ckpt, role="decode", **OPTIONS).engine
        transport = TorchDistTransport()
        hooks = decode_hooks(engine, transport, {0: RankEndpoint(0, "pipe", transport.expose(engine.kv_caches))})
        grants = []

        def ask(address: str, request):
            assert address == "prefill:0"
            conn.send(request)
            answer = conn.recv()
            if not isinstance(answer, PushGrant):
                raise PushRefusedError(answer)
            grants.append(answer.is_new_group)
            return answer

        hooks["state"].ask_push = ask
        joined = []
        for i, prompt in enumerate(PROMPTS):
            rid = f"r{i}"
            desc = conn.recv()
            timeout = LOST_TIMEOUT_S if rid == "r3" else TIMEOUT_S
            command = Command("import", rid, (prompt, PARAMS, desc, timeout, "prefill:0"))
            if rid == "r2":
                with pytest.raises(PushRefusedError, match="no pinned handoff"):
                    hooks["handlers"]["import"](engine, command)
                assert transport.groups.key_for(transport_peer(desc)) is not None  # kept
            elif rid == "r3":
                start = time.monotonic()
                with pytest.raises(TransferTimeout, match="transferring failed"):
                    hooks["handlers"]["import"](engine, command)
                assert time.monotonic() - start < LOST_TIMEOUT_S + 5
                assert transport.groups.key_for(transport_peer(desc)) is None  # dropped
            else:
                outcome = hooks["handlers"]["import"](engine, command)
                assert outcome.stats.num_bytes == _kv_bytes(engine, len(desc.rank_block_ids[0]))
                result = _finish(engine)
                assert result.generated_tokens == expected[i].generated_tokens
                assert result.generated_log_probs == pytest.approx(expected[i].generated_log_probs, abs=1e-5)
            assert engine.pool.stats().num_in_use == 0
            engine.check_integrity()
            joined.append(transport.groups.num_created)
            conn.send("next")
        assert grants == [True, False, False, True]  # r0 new, r1 reused, r3 (lost) reused, r4 new
        transport.close()
        return joined

    _report(results, "decode", body)


def transport_peer(desc) -> str:
    from splitserve.engine.handoff_push import TorchDistEndpoint

    return TorchDistEndpoint.from_bytes(desc.endpoints[0].agent_metadata).worker_id


def _kv_bytes(engine, num_blocks: int) -> int:
    cfg = engine.model_config
    return cfg.num_layers * 2 * num_blocks * cfg.num_kv_heads * engine.block_size * cfg.head_dim * 4  # fp32


def _finish(engine):
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out.result
    return final


def test_pair_group_is_cached_kept_after_a_refusal_and_replaced_after_a_lost_push(llama_ckpt, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    prefill_conn, decode_conn = ctx.Pipe()
    procs = [
        ctx.Process(target=_prefill_side, args=(str(llama_ckpt), prefill_conn, results), daemon=True),
        ctx.Process(target=_decode_side, args=(str(llama_ckpt), decode_conn, results), daemon=True),
    ]
    for p in procs:
        p.start()
    got = {}
    try:
        for _ in procs:
            try:
                side, value = results.get(timeout=120)
            except queue.Empty:
                pytest.fail(f"no result in 120 s; exit codes {[p.exitcode for p in procs]}; got {got}")
            got[side] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = {side: v for side, v in got.items() if isinstance(v, str)}
    assert not errors, "\n".join(f"--- {side} ---\n{v}" for side, v in errors.items())
    assert got["decode"] == [1, 1, 1, 1, 2]
    assert got["prefill"] == [1, 1, 1, 1, 2]


def test_ranks_sharing_a_gpu_are_refused_before_asking(llama_ckpt):
    """NCCL refuses a group with two ranks on one GPU ("Duplicate GPU detected"): the decode
    side sees it in the endpoints and refuses without calling PushKV; nothing is kept."""
    from splitserve.decode_worker.hooks import decode_hooks
    from splitserve.engine.handoff import RankEndpoint, build_descriptor, group_block_checksums
    from splitserve.engine.handoff_push import PushRefusedError, TorchDistEndpoint, shared_gpus
    from splitserve.engine.serving import Command

    gpu = lambda worker, uuid: TorchDistEndpoint(worker, "gloo", uuid)  # noqa: E731 - a fake GPU id on CPU KV
    assert shared_gpus([gpu("p", "GPU-a"), gpu("p", "GPU-b")], [gpu("d", "GPU-b")]) == {"GPU-b"}
    assert shared_gpus([gpu("p", "")], [gpu("d", "")]) == set()  # CPU ranks share nothing
    assert TorchDistEndpoint.from_bytes(gpu("p", "GPU-a").to_bytes()) == gpu("p", "GPU-a")

    prefill = LLM(str(llama_ckpt), role="prefill", **OPTIONS).engine
    decode = LLM(str(llama_ckpt), role="decode", **OPTIONS).engine
    prefill.add_request("r", PROMPTS[0], PARAMS)
    while prefill.has_unfinished():
        prefill.step()
    h = prefill.handoffs["r"]
    endpoint = RankEndpoint(0, "x", gpu("prefill-worker", "GPU-a").to_bytes())
    desc = build_descriptor(prefill, h, {0: endpoint}, "torch_dist", group_block_checksums(prefill, h.block_ids))

    from splitserve.engine.handoff_push import TorchDistTransport

    transport = TorchDistTransport()
    transport.expose(decode.kv_caches)
    hooks = decode_hooks(decode, transport, {0: RankEndpoint(0, "y", gpu(transport.worker_id, "GPU-a").to_bytes())})
    hooks["state"].ask_push = lambda address, push: pytest.fail("PushKV must not be called")
    with pytest.raises(PushRefusedError, match=r"share GPU \['GPU-a'\]"):
        hooks["handlers"]["import"](decode, Command("import", "r", (PROMPTS[0], PARAMS, desc, 5.0, "prefill:0")))
    assert decode.pool.stats().num_in_use == 0 and transport.groups.num_created == 0
    decode.check_integrity()
