"""Layer-wise streaming through the engine's handoff path: a prefill engine with
`transfer.layerwise` publishes its layers on the transport's progress board and names the slot
in the descriptor; a decode engine with it pulls layer by layer, verifies each (layer, kv head)
unit, then the block checksums, and generates exactly what a non-streamed handoff (and the
aggregated engine) does — in process, and between real worker processes (same layout and
reshards, NIXL and shm)."""

import importlib.util
import time

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.handoff import RankEndpoint, build_descriptor, group_block_checksums, make_importer
from splitserve.engine.handoff_layerwise import close_released, publish_layers
from splitserve.engine.transfer import streaming
from splitserve.engine.transfer.inproc import InProcTransport
from tests.fixtures.models import build_hf_checkpoint
from tests.fixtures.workers import disagg_generate, running_worker, streamed_generate

OPTIONS = dict(block_size_tokens=4, num_blocks=64, max_tokens=64)
PARAMS = SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True)
HAS_NIXL = importlib.util.find_spec("nixl_cu13") is not None


def _prefill(engine, transport, rid, prompt):
    engine.add_request(rid, prompt, PARAMS)
    while engine.has_unfinished():
        engine.step()
    h = engine.handoffs[rid]
    slot = publish_layers(engine, transport.board, h)
    meta = transport.expose(engine.kv_caches)
    checksums = group_block_checksums(engine, h.block_ids)
    return build_descriptor(engine, h, {0: RankEndpoint(0, "local", meta)}, "inproc", checksums, progress_slot=slot)


def _decode_all(engine):
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out.result
    return final


@pytest.mark.parametrize("layerwise", [True, False], ids=["streamed", "all-at-once"])
def test_streamed_import_generates_what_aggregated_serving_does(llama_ckpt, monkeypatch, layerwise):
    prefill = LLM(str(llama_ckpt), role="prefill", layerwise=True, **OPTIONS).engine
    decode = LLM(str(llama_ckpt), role="decode", layerwise=layerwise, **OPTIONS).engine
    transport = InProcTransport()
    transport.expose(prefill.kv_caches)
    prompt = list(range(10, 31))  # 21 tokens: 6 blocks
    desc = _prefill(prefill, transport, "r", prompt)
    assert desc.progress_slot == 0 and transport.board.open_requests() == ["r"]
    calls = []
    real = streaming.streamed_pull
    monkeypatch.setattr(streaming, "streamed_pull", lambda *a, **k: calls.append(a) or real(*a, **k))
    stats = []
    decode.add_imported_request("r", prompt, PARAMS, desc.first_token_id, None,
                                make_importer(decode, transport, desc, stats_out=stats))
    assert len(calls) == (1 if layerwise else 0)  # a decode side without layerwise ignores the slot
    layers, heads, bs, hd = 4, 2, 4, 16  # the tiny test model (fp32)
    assert stats[0].num_bytes == 6 * layers * 2 * heads * bs * hd * 4
    expected = LLM(str(llama_ckpt), **OPTIONS).generate([prompt], PARAMS)[0]
    assert _decode_all(decode).generated_tokens == expected.generated_tokens
    assert prefill.release_handoff("r")
    close_released(prefill, transport.board)  # the slot goes with the pin
    assert transport.board.open_requests() == [] and transport.board.tensor.abs().sum() == 0
    prefill.check_integrity()
    decode.check_integrity()


def test_a_full_board_falls_back_to_an_unstreamed_handoff(llama_ckpt):
    prefill = LLM(str(llama_ckpt), role="prefill", layerwise=True, **OPTIONS).engine
    transport = InProcTransport(num_board_slots=1)
    transport.expose(prefill.kv_caches)
    transport.board.open("someone-else")
    desc = _prefill(prefill, transport, "r", list(range(10, 19)))
    assert desc.progress_slot is None
    decode = LLM(str(llama_ckpt), role="decode", layerwise=True, **OPTIONS).engine
    decode.add_imported_request("r", list(range(10, 19)), PARAMS, desc.first_token_id, None,
                                make_importer(decode, transport, desc))
    assert _decode_all(decode).generated_tokens == LLM(str(llama_ckpt), **OPTIONS).generate(
        [list(range(10, 19))], PARAMS)[0].generated_tokens


def test_layerwise_must_be_a_bool():
    from splitserve.engine.config import TransferConfig

    with pytest.raises(ValueError, match="layerwise must be a bool, got 'yes'"):
        TransferConfig(layerwise="yes")
    with pytest.raises(ValueError, match="num_progress_slots must be a positive number, got 0"):
        TransferConfig(num_progress_slots=0)


# ---- real worker processes ---------------------------------------------------------------------

ENGINE_FLAGS = ["--block-size", "8", "--num-blocks", "256", "--max-tokens", "64", "--layerwise"]
WORKER_PARAMS = SamplingParams(num_tokens_to_generate=12, temperature=0.0, return_log_probs=True)
SHAPES = {"tp1": ["--tp", "1"], "tp2": ["--tp", "2"], "pp2": ["--pp", "2"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("layerwise")
    build_hf_checkpoint(path, "llama", num_hidden_layers=2)
    return str(path)


def _prompts():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in (5, 29, 40)]


@pytest.fixture(scope="module")
def expected(model_dir):
    return LLM(model_dir, block_size_tokens=8, num_blocks=256).generate(_prompts(), WORKER_PARAMS)


def _cases():
    # Worker processes take 30-60 s a pair here: all slow; the default stage streams between real
    # processes in tests/engine/transfer/test_transfer_streaming.py.
    for transport, src, dst in (("shm", "tp1", "tp2"), ("nixl", "tp2", "tp1"), ("nixl", "tp1", "tp1"),
                                ("shm", "tp2", "pp2")):
        marks = [pytest.mark.slow]
        if transport == "nixl":
            marks.append(pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed"))
        yield pytest.param(transport, src, dst, id=f"{transport}-{src}-to-{dst}", marks=marks)


@pytest.mark.parametrize("transport, src, dst", list(_cases()))
def test_streamed_handoff_between_worker_processes_matches_aggregated(model_dir, expected, transport, src, dst):
    flags = [*ENGINE_FLAGS, "--transport", transport]
    with (
        running_worker("prefill-worker", model_dir, *SHAPES[src], *flags) as pw,
        running_worker("decode-worker", model_dir, *SHAPES[dst], *flags) as dw,
    ):
        results, _ = disagg_generate(pw.address, dw.address, _prompts(), WORKER_PARAMS)
    for (tokens, logprobs, resp), ref in zip(results, expected, strict=True):
        assert resp.handoff.HasField("progress_slot")  # published on the board, pulled layer by layer
        assert tokens == ref.generated_tokens
        assert logprobs == pytest.approx(ref.generated_log_probs, abs=1e-5)


def _served_cases():
    # One pair in the default stage (shm, the cheapest); the rest with the slow ones.
    for transport, src, dst in (("shm", "tp1", "tp1"), ("nixl", "tp2", "tp1"), ("shm", "tp1", "tp2")):
        marks = [] if (transport, src, dst) == ("shm", "tp1", "tp1") else [pytest.mark.slow]
        if transport == "nixl":
            marks.append(pytest.mark.skipif(not HAS_NIXL, reason="NIXL (nixl-cu13) is not installed"))
        yield pytest.param(transport, src, dst, id=f"{transport}-{src}-to-{dst}", marks=marks)


@pytest.mark.parametrize("transport, src, dst", list(_served_cases()))
def test_served_prefetch_overlaps_prefill_and_matches_aggregated(
    model_dir, expected, transport, src, dst, tmp_path, monkeypatch
):
    """The served path: PrefillStream previews each handoff before its forward pass, the decode
    worker prefetches from the preview, and Decode imports what it pulled — the aggregated engine's
    tokens and log-probs; a prefetch whose request is aborted or never decoded leaves nothing held;
    a decode worker in a long engine step still answers Prefetch at once."""
    flags = [*ENGINE_FLAGS, "--transport", transport]
    faults = tmp_path / "decode-faults"  # engine/fault_injection.py, the decode worker's only
    with running_worker("prefill-worker", model_dir, *SHAPES[src], *flags) as pw:
        monkeypatch.setenv("SPLITSERVE_FAULT_DELAY_FILE", str(faults))
        with running_worker("decode-worker", model_dir, *SHAPES[dst], *flags) as dw:
            monkeypatch.delenv("SPLITSERVE_FAULT_DELAY_FILE")
            _served_checks(pw.address, dw.address, expected, faults)


def _served_checks(prefill_address, decode_address, expected, faults):
    results = streamed_generate(prefill_address, decode_address, _prompts(), WORKER_PARAMS)
    for (tokens, logprobs, kinds, prefetch, timing), ref in zip(results, expected, strict=True):
        assert kinds == ["handoff_started", "first_token", "response"]
        assert prefetch.accepted, prefetch.reason
        assert timing.prefetched and timing.transfer_bytes > 0
        assert tokens == ref.generated_tokens
        assert logprobs == pytest.approx(ref.generated_log_probs, abs=1e-5)
    _prefetch_then_abort(prefill_address, decode_address, _prompts()[2])
    _prefetch_during_a_long_step(prefill_address, decode_address, _prompts()[1], expected[1], faults)


def _prefetch_during_a_long_step(prefill_address, decode_address, prompt, ref, faults):
    """The router reads a Prefetch without an answer within its control timeout as a hung worker:
    a decode worker whose engine thread is in a long step answers "queued" within PREFETCH_ANSWER_S,
    and the queued prefetch still serves the import that follows."""
    import grpc

    from splitserve.decode_worker.service import PREFETCH_ANSWER_S
    from splitserve.engine.wire import sampling_to_proto
    from splitserve.proto.v1 import decode_worker_pb2, decode_worker_pb2_grpc, prefill_worker_pb2
    from splitserve.proto.v1 import prefill_worker_pb2_grpc as prefill_grpc

    sp = sampling_to_proto(WORKER_PARAMS)
    with grpc.insecure_channel(prefill_address) as pc, grpc.insecure_channel(decode_address) as dc:
        prefill, decode = prefill_grpc.PrefillWorkerStub(pc), decode_worker_pb2_grpc.DecodeWorkerStub(dc)
        events = list(prefill.PrefillStream(
            prefill_worker_pb2.PrefillRequest(request_id="long", token_ids=prompt, sampling_params=sp), timeout=60))
        preview, response = events[0].handoff_started, events[-1].response
        faults.write_text("step=4000")
        busy = decode.Decode(decode_worker_pb2.DecodeRequest(
            request_id="busy", token_ids=_prompts()[0], sampling_params=sampling_to_proto(
                SamplingParams(num_tokens_to_generate=3, temperature=0.0))), timeout=60)
        next(busy)  # its first step is done: the engine thread now sleeps 4 s before the next one
        started = time.monotonic()
        reply = decode.Prefetch(decode_worker_pb2.PrefetchRequest(
            request_id="long", token_ids=prompt, handoff=preview), timeout=10)
        answered_s = time.monotonic() - started
        faults.write_text("")
        assert reply.accepted and reply.reason == "queued behind a running step", reply
        assert PREFETCH_ANSWER_S <= answered_s < PREFETCH_ANSWER_S + 1.5
        chunks = list(decode.Decode(decode_worker_pb2.DecodeRequest(
            request_id="long", token_ids=prompt, sampling_params=sp, handoff=response.handoff,
            prefill_address=prefill_address), timeout=60))
        assert [t for c in chunks for t in c.token_ids] == ref.generated_tokens
        assert chunks[-1].timing.prefetched  # the queued prefetch ran before the import
        assert len([t for c in busy for t in c.token_ids]) == 2


def _prefetch_then_abort(prefill_address, decode_address, prompt):
    import grpc

    from splitserve.engine.wire import sampling_to_proto
    from splitserve.proto.v1 import common_pb2, decode_worker_pb2, decode_worker_pb2_grpc, prefill_worker_pb2
    from splitserve.proto.v1 import prefill_worker_pb2_grpc as prefill_grpc

    with grpc.insecure_channel(prefill_address) as pc, grpc.insecure_channel(decode_address) as dc:
        prefill, decode = prefill_grpc.PrefillWorkerStub(pc), decode_worker_pb2_grpc.DecodeWorkerStub(dc)
        request = prefill_worker_pb2.PrefillRequest(request_id="gone", token_ids=prompt,
                                                    sampling_params=sampling_to_proto(WORKER_PARAMS))
        stream = prefill.PrefillStream(request, timeout=60)
        started = next(stream)
        assert started.WhichOneof("event") == "handoff_started"
        reply = decode.Prefetch(decode_worker_pb2.PrefetchRequest(
            request_id="gone", token_ids=prompt, handoff=started.handoff_started), timeout=10)
        assert reply.accepted
        held = decode.CheckIntegrity(common_pb2.IntegrityRequest(), timeout=10)
        assert held.is_ok and held.num_in_use_blocks == -(-len(prompt) // 8)  # reserved for the prefetch
        stream.cancel()  # the client went away: the router aborts both workers
        assert prefill.Abort(common_pb2.AbortRequest(request_id="gone"), timeout=10) is not None
        assert decode.Abort(common_pb2.AbortRequest(request_id="gone"), timeout=10).was_found
        for stub in (prefill, decode):
            report = stub.CheckIntegrity(common_pb2.IntegrityRequest(), timeout=10)
            assert report.is_ok and report.num_in_use_blocks == 0 and report.num_requests == 0, report
        # The router's Abort can overtake its Prefetch (a background call): the late Prefetch is
        # declined, so no reservation waits out the lease (it held blocks ~25 s before).
        request = prefill_worker_pb2.PrefillRequest(request_id="overtaken", token_ids=prompt,
                                                    sampling_params=sampling_to_proto(WORKER_PARAMS))
        stream = prefill.PrefillStream(request, timeout=60)
        late = next(stream)
        stream.cancel()
        prefill.Abort(common_pb2.AbortRequest(request_id="overtaken"), timeout=10)
        assert not decode.Abort(common_pb2.AbortRequest(request_id="overtaken"), timeout=10).was_found
        reply = decode.Prefetch(decode_worker_pb2.PrefetchRequest(
            request_id="overtaken", token_ids=prompt, handoff=late.handoff_started), timeout=10)
        assert not reply.accepted and "was aborted here" in reply.reason, reply
        report = decode.CheckIntegrity(common_pb2.IntegrityRequest(), timeout=10)
        assert report.is_ok and report.num_in_use_blocks == 0, report
        bad = decode_worker_pb2.DecodeRequest(request_id="x", token_ids=prompt, handoff=started.handoff_started,
                                              sampling_params=sampling_to_proto(WORKER_PARAMS))
        with pytest.raises(grpc.RpcError) as err:  # a preview is for Prefetch, never for Decode
            list(decode.Decode(bad, timeout=10))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.skipif(not torch.cuda.is_available(), reason="per-layer CUDA events need a GPU")
def test_gpu_layers_are_marked_in_order_each_after_its_kv_is_written(llama_ckpt, monkeypatch):
    """On a GPU the prompt's layers are marked one by one while the step finishes
    (handoff_layerwise.DeviceLayerMarks), each only once its KV is written: a copy taken on a side
    stream at mark time already holds the layer's final KV. A decode engine streaming from those
    marks generates what aggregated serving does."""
    from splitserve.engine.handoff_layerwise import DeviceLayerMarks, LayerPublisher

    prefill = LLM(str(llama_ckpt), role="prefill", layerwise=True, device="cuda", **OPTIONS).engine
    transport = InProcTransport()
    transport.expose(prefill.kv_caches)
    board = transport.board
    listener = LayerPublisher(prefill, lambda: board)
    prefill.runner.layer_listener = listener
    made = []
    real_started = listener.forward_started
    monkeypatch.setattr(listener, "forward_started", lambda out: made.append(real_started(out)) or made[-1])
    side = torch.cuda.Stream()
    marks, snapshots = [], {}
    real_mark = board.mark

    def mark(slot, layer, kv_layer, block_ids, num_tokens):
        with torch.cuda.stream(side):  # not queued behind the step's later layers
            snapshots[layer] = prefill.kv_caches[layer].clone()
        side.synchronize()
        marks.append((slot, layer, num_tokens))
        real_mark(slot, layer, kv_layer, block_ids, num_tokens)

    monkeypatch.setattr(board, "mark", mark)
    prompt = list(range(10, 31))
    prefill.add_request("r", prompt, PARAMS)
    while prefill.has_unfinished():
        prefill.step()
    layers = len(prefill.kv_caches)
    assert any(isinstance(m, DeviceLayerMarks) for m in made)
    assert marks == [(0, layer, len(prompt)) for layer in range(layers)]  # each once, in order, in the step
    for layer in range(layers):
        assert torch.equal(snapshots[layer], prefill.kv_caches[layer]), layer

    h = prefill.handoffs["r"]
    slot = publish_layers(prefill, board, h)  # the step's end: marks every layer again (same counts)
    meta = transport.expose(prefill.kv_caches)
    checksums = group_block_checksums(prefill, h.block_ids)
    desc = build_descriptor(prefill, h, {0: RankEndpoint(0, "local", meta)}, "inproc", checksums, progress_slot=slot)
    decode = LLM(str(llama_ckpt), role="decode", layerwise=True, device="cuda", **OPTIONS).engine
    decode.add_imported_request("r", prompt, PARAMS, desc.first_token_id, None, make_importer(decode, transport, desc))
    expected = LLM(str(llama_ckpt), device="cuda", **OPTIONS).generate([prompt], PARAMS)[0]
    assert _decode_all(decode).generated_tokens == expected.generated_tokens
