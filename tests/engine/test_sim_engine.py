"""SimEngine (`--engine sim`): the real block pool, prefix cache and request lifecycle
with a modelled runner — exact pool state, modelled seconds, deterministic tokens,
and a handoff between two sim engines that matches one aggregated sim engine."""

import ast
import inspect
import textwrap

import pytest

from splitserve.engine.block_pool import PoolStats
from splitserve.engine.engine import Engine
from splitserve.engine.handoff import RankEndpoint, build_descriptor, group_block_checksums, make_importer
from splitserve.engine.llm import build_engine_config
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.sim_engine import SIM_MODEL, SimConfig, SimEngine, SimTransport
from splitserve.engine.transfer.transport import TransferError
from splitserve.engine.worker_runtime import WorkerSpec

SIM = SimConfig(prefill_tokens_per_s=1000.0, decode_step_s=0.01, transfer_gbps=2.0, vocab_size=1000)
PARAMS = SamplingParams(num_tokens_to_generate=6, temperature=0.0, return_log_probs=True, skip_prompt_log_probs=True)


def make_engine(role="aggregated", sim=SIM, **options):
    """A sim engine that records what it would sleep instead of sleeping."""
    sleeps: list[float] = []
    config = build_engine_config("sim-test", role=role, **({"block_size_tokens": 8, "num_blocks": 16} | options))
    return SimEngine(config, SIM_MODEL, sim, sleep=sleeps.append), sleeps


def step(engine, seconds: list[float]):
    """One step; appends its modelled duration (the sleep is that minus the step's own run time)."""
    before = engine.runner.busy_s
    outputs = engine.step()
    seconds.append(engine.runner.busy_s - before)
    return outputs


def run(engine, seconds: list[float] | None = None):
    outputs = []
    while engine.has_unfinished():
        outputs += step(engine, [] if seconds is None else seconds)
    return outputs


def test_has_every_attribute_and_method_the_engine_has():
    # `_eos_ids` is a helper of Engine.__init__ (the sim has no EOS).
    public = {n for n in dir(Engine) if not n.startswith("__")} - {"_eos_ids"}
    assert public <= set(dir(SimEngine)), public - set(dir(SimEngine))
    init = ast.parse(textwrap.dedent(inspect.getsource(Engine.__init__)))
    assigned = {
        t.attr
        for node in ast.walk(init)
        for t in getattr(node, "targets", [getattr(node, "target", None)])
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    engine, _ = make_engine()
    missing = {a for a in assigned if not hasattr(engine, a)}
    assert not missing, f"SimEngine lacks Engine attributes {missing}"
    assert engine.kv_caches == () and engine.ps.world_size == 1 and engine.tokenizer is None


def test_prefill_pins_exact_blocks_and_models_its_time():
    engine, sleeps = make_engine("prefill")
    engine.pool.record_events = True  # as a worker with a KV-event publisher does
    seconds = []
    prompt = list(range(1, 21))  # 20 tokens: blocks 0, 1 full, block 2 partial
    engine.add_request("a", prompt, PARAMS)
    [out] = step(engine, seconds)
    assert out.result.status == "handoff" and len(out.new_token_ids) == 1
    assert seconds == [pytest.approx(20 / 1000)] and 0 < sleeps[0] <= seconds[0]
    handoff = engine.handoffs["a"]
    assert handoff.block_ids == (0, 1, 2) and handoff.num_tokens == 20
    assert engine.num_pinned_blocks == 3
    assert engine.pool.stats() == PoolStats(num_blocks=16, num_free=13, num_cached=0, num_in_use=3, num_pinned=3)
    assert [e.kind for e in engine.pool.drain_events()] == ["stored", "stored"]  # KV events of full blocks
    engine.check_integrity()

    # A second prompt sharing the first 16 tokens: 2 blocks from the cache, 4 tokens computed.
    engine.add_request("b", prompt[:16] + [900, 901, 902, 903], PARAMS)
    [out] = step(engine, seconds)
    assert out.result.num_cached_tokens == 16
    assert seconds[-1] == pytest.approx(4 / 1000)
    assert engine.handoffs["b"].block_ids == (0, 1, 3)
    assert engine.pool.ref_count(0) == 2 and engine.pool.ref_count(3) == 1

    assert engine.release_handoff("a") and engine.release_handoff("b")
    assert engine.num_pinned_blocks == 0
    assert engine.pool.stats() == PoolStats(num_blocks=16, num_free=14, num_cached=2, num_in_use=0, num_pinned=0)
    engine.check_integrity()


def test_tokens_depend_on_the_context_only_and_lie_in_the_vocab():
    engine, _ = make_engine(max_tokens=8)  # chunked: a 20-token prompt takes 3 steps
    engine.add_request("a", list(range(1, 21)), PARAMS)
    seconds = []
    chunked = run(engine, seconds)
    assert seconds == [pytest.approx(s) for s in (0.008, 0.008, 0.004, 0.01, 0.01, 0.01, 0.01, 0.01)]
    other, _ = make_engine(max_tokens=64)
    other.add_request("x", list(range(1, 21)), PARAMS)
    whole = run(other)
    assert chunked[-1].result.generated_tokens == whole[-1].result.generated_tokens
    assert chunked[-1].result.generated_log_probs == whole[-1].result.generated_log_probs
    assert len(whole[-1].result.generated_tokens) == 6 and all(0 <= t < 1000 for t in whole[-1].result.generated_tokens)
    assert all(lp <= 0 and lp * 1024 == int(lp * 1024) for lp in whole[-1].result.generated_log_probs)
    other.add_request("y", list(range(2, 22)), PARAMS)
    assert run(other)[-1].result.generated_tokens != whole[-1].result.generated_tokens
    engine.check_integrity()
    other.check_integrity()


def _handoff(prefill, decode, request_id, prompt, stats):
    prefill.add_request(request_id, prompt, PARAMS)
    [out] = prefill.step()
    handoff = prefill.handoffs[request_id]
    checksums = group_block_checksums(prefill, handoff.block_ids)
    assert checksums == (0,) * len(handoff.block_ids)  # no KV, nothing to sum
    desc = build_descriptor(prefill, handoff, {0: RankEndpoint(0, "127.0.0.1:1", b"sim")}, "sim", checksums)
    importer = make_importer(decode, SimTransport(), desc, stats_out=stats)
    decode.add_imported_request(request_id, prompt, PARAMS, desc.first_token_id, desc.first_token_logprob, importer)
    return out


def test_handoff_continues_exactly_like_one_aggregated_engine():
    prompt = list(range(1, 21))
    aggregated, _ = make_engine()
    aggregated.add_request("r", prompt, PARAMS)
    expected = run(aggregated)[-1].result

    prefill, _ = make_engine("prefill")
    decode, decode_sleeps = make_engine("decode")
    decode_seconds = []
    stats = []
    first = _handoff(prefill, decode, "r", prompt, stats)
    # 3 blocks x 32 layers x K,V x 8 kv heads x 8 tokens x 128 dims x 2 bytes, at 2 GB/s
    num_bytes = 3 * 32 * 2 * 8 * 8 * 128 * 2
    assert stats[0].num_bytes == num_bytes and decode_sleeps == [pytest.approx(num_bytes / 2e9)]
    tokens = list(first.new_token_ids) + [t for o in run(decode, decode_seconds) for t in o.new_token_ids]
    assert tokens == expected.generated_tokens
    assert decode_seconds == [pytest.approx(0.01)] * 5
    assert prefill.release_handoff("r")
    for engine in (prefill, decode):
        assert engine.num_pinned_blocks == 0
        engine.check_integrity()

    # The decode side now caches the imported prefix: a second handoff pulls only the new blocks.
    stats.clear()
    _handoff(prefill, decode, "s", prompt[:16] + [7, 7, 7, 7, 7, 7, 7, 7], stats)
    assert stats[0].num_bytes == num_bytes // 3  # block 2 only; blocks 0 and 1 were cache hits
    run(decode)
    decode.check_integrity()


def test_handoff_from_another_model_is_refused_and_rolled_back():
    prefill, _ = make_engine("prefill")
    decode, _ = make_engine("decode", sim=SimConfig(vocab_size=999))
    with pytest.raises(TransferError, match="fingerprint"):
        _handoff(prefill, decode, "r", list(range(1, 21)), [])
    assert not decode.has_unfinished()
    assert decode.pool.stats().num_in_use == 0
    decode.check_integrity()


@pytest.mark.parametrize(
    "decode_options, error",
    [
        (dict(block_size_tokens=16), "planning failed"),  # layouts that no plan connects
        (dict(sim=SimConfig(vocab_size=1000, transfer_gbps=1e-6)), "transferring failed: modelled pull"),
    ],
)
def test_import_failures_name_their_stage_and_roll_back(decode_options, error):
    prefill, _ = make_engine("prefill")
    decode, sleeps = make_engine("decode", **decode_options)
    with pytest.raises(TransferError, match=error):
        _handoff(prefill, decode, "r", list(range(1, 21)), [])
    assert sum(sleeps) <= 30.0  # a modelled pull never outlasts its timeout
    assert not decode.has_unfinished() and decode.pool.stats().num_in_use == 0
    decode.check_integrity()


def test_suspend_and_resume_drop_pins_and_recompute_the_same_tokens():
    from splitserve.engine import lifecycle

    engine, _ = make_engine()
    engine.add_request("r", list(range(1, 21)), PARAMS)
    step(engine, [])
    step(engine, [])  # prefill + one decode: two tokens out, then the KV goes away
    lifecycle.suspend(engine)
    assert engine.pool.stats() == PoolStats(num_blocks=16, num_free=16, num_cached=0, num_in_use=0, num_pinned=0)
    lifecycle.resume(engine)
    result = run(engine)[-1].result
    assert result.num_cached_tokens == 0 and len(result.generated_tokens) == 6
    fresh, _ = make_engine()
    fresh.add_request("r", list(range(1, 21)), PARAMS)
    assert run(fresh)[-1].result.generated_tokens == result.generated_tokens
    engine.check_integrity()


def test_worker_spec_validates_the_engine():
    assert WorkerSpec(model=None, role="decode", engine="sim").engine == "sim"
    with pytest.raises(ValueError, match="engine must be one of"):
        WorkerSpec(model=None, role="decode", engine="jax")
    with pytest.raises(ValueError, match="engine 'sim' runs one rank; got tp=2 x pp=1"):
        WorkerSpec(model=None, role="decode", engine="sim", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="prefill_tokens_per_s must be a positive number, got 0"):
        SimConfig(prefill_tokens_per_s=0)
    with pytest.raises(ValueError, match="vocab_size must be an integer >= 2"):
        SimConfig(vocab_size=1)
