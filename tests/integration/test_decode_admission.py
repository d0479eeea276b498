"""A decode worker at its `--max-requests` or out of free KV blocks makes a burst of handoffs wait
for room (back-pressure) instead of failing them: a client streaming from a disaggregated request already
has its first token (from prefill) when Decode is called, so a refusal there breaks a stream the
client saw start. Real worker processes; tokens equal the aggregated engine's."""

import asyncio
import threading
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.wire import sampling_to_proto
from splitserve.proto.v1 import (
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
)
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import running_worker

FLAGS = ["--block-size", "8", "--num-blocks", "256", "--max-tokens", "64"]
PARAMS = SamplingParams(num_tokens_to_generate=24, temperature=0.0, ignore_eos=True)
BURST = 6


@pytest.mark.parametrize("limit", [["--max-requests", "2"], ["--num-blocks", "14"]], ids=["slots", "blocks"])
def test_a_burst_past_the_decode_worker_s_capacity_waits_and_every_request_completes(tmp_path, limit):
    """slots: `--max-requests 2`; blocks: a pool of 14 blocks of 8 tokens, each request needing 3–6."""
    build_hf_checkpoint(tmp_path, "llama", num_hidden_layers=2)
    model = str(tmp_path)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (9 + 3 * i,), generator=g).tolist() for i in range(BURST)]
    expected = LLM(model, block_size_tokens=8, num_blocks=256).generate(prompts, PARAMS)
    sp = sampling_to_proto(PARAMS)
    with (
        running_worker("prefill-worker", model, *FLAGS, "--transport", "nixl") as prefill,
        running_worker("decode-worker", model, *FLAGS, "--transport", "nixl", *limit) as decode,
        grpc.insecure_channel(prefill.address) as pc,
        grpc.insecure_channel(decode.address) as dc,
    ):
        prefill_stub = prefill_worker_pb2_grpc.PrefillWorkerStub(pc)
        decode_stub = decode_worker_pb2_grpc.DecodeWorkerStub(dc)
        handoffs = [prefill_stub.Prefill(prefill_worker_pb2.PrefillRequest(request_id=f"b{i}", token_ids=p,
                                                                           sampling_params=sp), timeout=60).handoff
                    for i, p in enumerate(prompts)]  # fmt: skip
        results: dict[int, object] = {}

        def stream(i):
            try:
                request = decode_worker_pb2.DecodeRequest(request_id=f"b{i}", token_ids=prompts[i], sampling_params=sp,
                                                          handoff=handoffs[i], prefill_address=prefill.address)
                results[i] = [t for chunk in decode_stub.Decode(request, timeout=60) for t in chunk.token_ids]
            except grpc.RpcError as e:
                results[i] = e

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(BURST)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(90)
        errors = {i: r for i, r in results.items() if isinstance(r, grpc.RpcError)}
        assert not errors, {i: (e.code(), e.details()) for i, e in errors.items()}  # was: RESOURCE_EXHAUSTED "decode engine is full"
        assert [results[i] for i in range(BURST)] == [list(e.generated_tokens) for e in expected]


def test_no_slot_within_the_lease_is_resource_exhausted_naming_the_wait():
    """The wait is bounded by the handoff's lease (its pins), less a margin."""
    from splitserve.decode_worker.admission import LEASE_MARGIN_S, DecodeAdmission

    class Aborted(Exception):
        pass

    class Context:
        async def abort(self, code, details):
            raise Aborted(code, details)

    counted = []
    metrics = SimpleNamespace(rejections=SimpleNamespace(labels=lambda *a: SimpleNamespace(
        inc=lambda: counted.append(a))))  # fmt: skip
    desc = SimpleNamespace(lease_deadline_unix_ms=int((time.time() + LEASE_MARGIN_S + 0.3) * 1000))

    async def main():
        admission = DecodeAdmission(1, metrics)
        await admission.take_slot(desc, Context())  # free: taken at once
        started = time.monotonic()
        with pytest.raises(Aborted) as refused:
            await admission.take_slot(desc, Context())
        return time.monotonic() - started, refused.value.args

    waited, (code, details) = asyncio.run(main())
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "no slot freed within 0.3 s" in details
    assert 0.2 < waited < 2.0 and counted == [("decode", "full")]


def test_an_import_waiting_for_blocks_tries_again_as_soon_as_a_request_ends(monkeypatch):
    """Woken by `release` (a request here ended, its blocks freed), not by its next poll."""
    import asyncio
    import time

    from splitserve.decode_worker import admission as adm
    from splitserve.engine.block_pool import NoFreeBlocksError

    monkeypatch.setattr(adm, "ROOM_POLL_S", 5.0)
    room = adm.DecodeAdmission(4, metrics=None)
    freed = []

    async def submit():
        if not freed:
            raise NoFreeBlocksError("no free block")
        return "imported"

    async def main():
        waiting = asyncio.create_task(room.import_when_room(submit, None))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        freed.append(True)
        released = time.monotonic()
        room.release()
        assert await waiting == "imported"
        return time.monotonic() - released

    assert asyncio.run(main()) < 0.5


def test_a_stream_cut_short_gives_its_slot_back_once_the_abort_freed_its_blocks():
    """The woken imports must find the blocks free: the slot waits for the engine's abort."""
    import concurrent.futures

    from splitserve.decode_worker import admission as adm

    room = adm.DecodeAdmission(1, metrics=None)

    async def main():
        await room._slots.acquire()  # the one slot: held by the stream being cut short
        woken = asyncio.get_running_loop().create_future()
        room._room_waiters.add(woken)
        abort = concurrent.futures.Future()
        room.release_after(abort)
        await asyncio.sleep(0.1)
        before = (woken.done(), room._slots.locked())
        threading.Thread(target=abort.set_result, args=(None,)).start()  # the engine thread's abort ran
        await asyncio.wait_for(woken, 2.0)
        return before, room._slots.locked()

    assert asyncio.run(main()) == ((False, True), False)
