"""Hybrid (Mamba2 + attention) handoff in one process: the recurrent state travels with the KV
in the same descriptor, is verified by its own layout-independent checksum, and decode
continues exactly like the aggregated engine; a corrupted state is caught and rolled back."""

import dataclasses

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.handoff import (
    ChecksumMismatchError,
    RankEndpoint,
    build_descriptor,
    group_block_checksums,
    make_importer,
)
from splitserve.engine.state_handoff import build_state_handoff, state_tensors
from splitserve.engine.transfer.inproc import InProcTransport
from splitserve.engine.transfer.state_transport import expose_inproc
from splitserve.engine.transfer.transport import TransferError
from tests.fixtures.models import build_hybrid_checkpoint

OPTIONS = dict(block_size_tokens=4, num_blocks=64, max_tokens=64)
PARAMS = SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def hybrid_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("hybrid_handoff")
    build_hybrid_checkpoint(path)
    return str(path)


def _handoff(prefill, transport, rid, prompt):
    prefill.add_request(rid, prompt, PARAMS)
    while prefill.has_unfinished():
        prefill.step()
    h = prefill.handoffs[rid]
    kv_meta = transport.expose(prefill.kv_caches)
    state = build_state_handoff(prefill, rid, {0: expose_inproc(transport, state_tensors(prefill))})
    desc = build_descriptor(prefill, h, {0: RankEndpoint(0, "local", kv_meta)}, "inproc",
                            group_block_checksums(prefill, h.block_ids))
    return dataclasses.replace(desc, state=state)


def _import_matches_aggregated(ckpt, prefill, decode, transport, desc, prompt) -> None:
    """Import `desc` (request "r") on `decode`, decode it to the end: the aggregated engine's tokens;
    then release the pin, and both pools are whole."""
    decode.add_imported_request("r", prompt, PARAMS, desc.first_token_id, None, make_importer(decode, transport, desc))
    expected = LLM(ckpt, **OPTIONS).generate([prompt], PARAMS)[0]
    assert _decode_all(decode).generated_tokens == expected.generated_tokens
    assert prefill.release_handoff("r")
    prefill.check_integrity()
    decode.check_integrity()


def _decode_all(engine):
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out.result
    return final


class CorruptingStateStep:
    """Pulls correctly, then flips a bit of the SSM state it wrote (a bad wire)."""

    def __init__(self, engine, transport, desc):
        from splitserve.engine.state_handoff import pull_state_step

        self.inner = pull_state_step(engine, transport, desc)
        self.engine = engine

    def __call__(self, handoff, ops, dst_slot):
        stats = self.inner(handoff, ops, dst_slot)
        self.engine.runner.states.layers[-1].ssm.view(torch.uint8)[dst_slot, 0, 0, 0] ^= 0x10
        return stats


def test_state_travels_with_the_kv_and_decode_matches_aggregated(hybrid_ckpt):
    prefill = LLM(hybrid_ckpt, role="prefill", **OPTIONS).engine
    decode = LLM(hybrid_ckpt, role="decode", **OPTIONS).engine
    transport = InProcTransport()
    prompts = [list(range(10, 27)), list(range(10, 22)) + [99, 98, 97, 96, 95]]  # share 3 full blocks
    expected = LLM(hybrid_ckpt, **OPTIONS).generate(prompts, PARAMS)
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        desc = _handoff(prefill, transport, rid, prompt)
        assert desc.state.slot == prefill.runner.states.pool.slot_of(rid)
        stats: list = []
        reused = decode.add_imported_request(rid, prompt, PARAMS, desc.first_token_id, None,
                                             make_importer(decode, transport, desc, stats_out=stats))
        assert reused == (3 if i else 0)  # KV prefix hit on the decode side; the state moves whole
        assert _decode_all(decode).generated_tokens == expected[i].generated_tokens
        assert prefill.release_handoff(rid)
        assert prefill.runner.states.pool.slot_of(rid) is None
    prefill.check_integrity()
    decode.check_integrity()
    assert decode.runner.states.pool.num_free_slots == decode.runner.states.pool.num_slots


def test_corrupted_state_is_caught_and_nothing_is_kept(hybrid_ckpt):
    prefill = LLM(hybrid_ckpt, role="prefill", **OPTIONS).engine
    decode = LLM(hybrid_ckpt, role="decode", **OPTIONS).engine
    transport = InProcTransport()
    prompt = list(range(30, 49))
    desc = _handoff(prefill, transport, "r", prompt)
    bad = make_importer(decode, transport, desc, state_step=CorruptingStateStep(decode, transport, desc))
    with pytest.raises(ChecksumMismatchError, match="recurrent state does not match"):
        decode.add_imported_request("r", prompt, PARAMS, desc.first_token_id, None, bad)
    assert decode.pool.stats().num_in_use == 0 and decode.runner.states.pool.slot_of("r") is None
    decode.check_integrity()
    with pytest.raises(TransferError, match="carries no recurrent state"):
        no_state = dataclasses.replace(desc, state=None)
        decode.add_imported_request("r", prompt, PARAMS, desc.first_token_id, None,
                                    make_importer(decode, transport, no_state))
    _import_matches_aggregated(hybrid_ckpt, prefill, decode, transport, desc, prompt)


def test_state_handoff_after_both_sides_suspended_and_resumed(hybrid_ckpt):
    """Suspend frees both engines' state memory (engine/lifecycle.py); after resume the state is
    exposed again from the new memory and a handoff still decodes as the aggregated engine."""
    from splitserve.engine import lifecycle

    prefill = LLM(hybrid_ckpt, role="prefill", **OPTIONS).engine
    decode = LLM(hybrid_ckpt, role="decode", **OPTIONS).engine
    transport = InProcTransport()
    prompt = list(range(40, 57))
    _handoff(prefill, transport, "pinned", prompt)  # a pin that the suspend drops
    for engine in (prefill, decode):
        lifecycle.suspend(engine)
        assert all(t.untyped_storage().nbytes() == 0 for t in engine.runner.states.pool.tensors())
        lifecycle.resume(engine)
    assert "pinned" not in prefill.handoffs and prefill.runner.states.pool.slot_of("pinned") is None
    desc = _handoff(prefill, transport, "r", prompt)
    _import_matches_aggregated(hybrid_ckpt, prefill, decode, transport, desc, prompt)
