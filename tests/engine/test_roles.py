"""Prefill and decode roles: pins, leases, and an in-process KV import that
continues generation exactly like the aggregated engine."""

import time

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.block_pool import NoFreeBlocksError

OPTIONS = dict(block_size_tokens=4, num_blocks=64, max_tokens=32)
PARAMS = SamplingParams(num_tokens_to_generate=12, temperature=0.0, ignore_eos=True, return_log_probs=True)


def _copy_kv(src_engine, src_blocks):
    def import_kv(dst_blocks, first_block):
        for src_kv, dst_kv in zip(src_engine.kv_caches, dst_engine_kv[0], strict=True):
            for s, d in zip(src_blocks[first_block:], dst_blocks[first_block:], strict=False):
                dst_kv[:, d] = src_kv[:, s]

    dst_engine_kv = []
    return import_kv, dst_engine_kv


def _prefill(engine, rid, prompt):
    engine.add_request(rid, prompt, PARAMS)
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    [out] = outs
    assert out.result.status == "handoff" and out.result.is_finished
    return engine.handoffs[rid]


def test_prefill_then_decode_matches_aggregated(llama_ckpt):
    prompt = torch.randint(3, 512, (18,), generator=torch.Generator().manual_seed(0)).tolist()
    expected = LLM(str(llama_ckpt), **OPTIONS).generate([prompt], PARAMS)[0]

    prefill = LLM(str(llama_ckpt), role="prefill", **OPTIONS).engine
    decode = LLM(str(llama_ckpt), role="decode", **OPTIONS).engine
    handoff = _prefill(prefill, "r1", prompt)
    assert handoff.num_tokens == 18 and len(handoff.block_ids) == 5
    assert handoff.first_token_id == expected.generated_tokens[0]
    assert prefill.pool.stats().num_pinned == 5
    prefill.check_integrity()

    import_kv, holder = _copy_kv(prefill, list(handoff.block_ids))
    holder.append(decode.kv_caches)
    reused = decode.add_imported_request("r1", prompt, PARAMS, handoff.first_token_id, handoff.first_token_logprob, import_kv)
    assert reused == 0
    prefill.release_handoff("r1")
    assert prefill.pool.stats().num_pinned == 0 and prefill.pool.stats().num_in_use == 0
    prefill.check_integrity()

    final = None
    while decode.has_unfinished():
        for out in decode.step():
            final = out.result
    assert final.generated_tokens == expected.generated_tokens
    assert final.generated_log_probs == pytest.approx(expected.generated_log_probs, abs=1e-5)
    decode.check_integrity()

    # A second request sharing the first 16 tokens: decode reuses 4 cached blocks.
    prompt2 = prompt[:16] + [7, 8, 9]
    handoff2 = _prefill(prefill, "r2", prompt2)
    import_kv, holder = _copy_kv(prefill, list(handoff2.block_ids))
    holder.append(decode.kv_caches)
    assert decode.add_imported_request("r2", prompt2, PARAMS, handoff2.first_token_id, None, import_kv) == 4
    expected2 = LLM(str(llama_ckpt), **OPTIONS).generate([prompt2], PARAMS)[0]
    final = None
    while decode.has_unfinished():
        for out in decode.step():
            final = out.result
    assert final.generated_tokens == expected2.generated_tokens
    decode.check_integrity()


def test_pins_expire_with_their_lease(llama_ckpt):
    engine = LLM(str(llama_ckpt), role="prefill", handoff_lease_s=0.05, **OPTIONS).engine
    _prefill(engine, "r", [5, 6, 7, 8, 9])
    assert engine.pool.stats().num_pinned == 2
    time.sleep(0.1)
    engine.step()  # every step reaps expired leases
    assert engine.pool.stats().num_pinned == 0 and not engine.handoffs
    engine.check_integrity()


def test_abort_releases_a_pinned_handoff(llama_ckpt):
    engine = LLM(str(llama_ckpt), role="prefill", **OPTIONS).engine
    _prefill(engine, "r", [5, 6, 7, 8, 9])
    assert engine.abort("r") is True
    assert engine.abort("r") is False
    assert engine.pool.stats().num_in_use == 0
    engine.check_integrity()


def test_failed_import_gives_every_block_back(llama_ckpt):
    decode = LLM(str(llama_ckpt), role="decode", **OPTIONS).engine

    def broken(block_ids, first_block):
        raise ConnectionError("peer went away")

    with pytest.raises(ConnectionError):
        decode.add_imported_request("x", list(range(3, 20)), PARAMS, 5, None, broken)
    assert decode.pool.stats().num_in_use == 0 and not decode.has_unfinished()
    decode.check_integrity()
    with pytest.raises(NoFreeBlocksError):
        small = LLM(str(llama_ckpt), role="decode", block_size_tokens=4, num_blocks=8, max_tokens=32).engine
        small.add_imported_request("y", list(range(3, 20)), PARAMS, 5, None, lambda b, f: None)
        small.add_imported_request("z", list(range(30, 47)), PARAMS, 5, None, lambda b, f: None)


def test_a_request_id_holding_a_pinned_handoff_is_refused_until_released(llama_ckpt):
    """One handoff per id: a second request under the id would orphan the first's pins."""
    prefill = LLM(str(llama_ckpt), role="prefill", **OPTIONS).engine
    _prefill(prefill, "dup", [5, 6, 7, 8, 9])
    with pytest.raises(ValueError, match="holds a pinned handoff; release it first"):
        prefill.add_request("dup", [5, 6, 7], PARAMS)
    assert prefill.release_handoff("dup")
    _prefill(prefill, "dup", [5, 6, 7])
    prefill.check_integrity()
