"""Suspend frees KV memory and resume brings it back; reload swaps weights."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine import lifecycle
from splitserve.engine.transfer.graph_copy import PoolPairKeys, pools_token
from tests.fixtures.models import build_hf_checkpoint, build_hybrid_checkpoint

OPTIONS = dict(block_size_tokens=4, num_blocks=64, max_tokens=32)
PARAMS = SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True)


def test_suspend_resume_and_reload(tmp_path, llama_ckpt):
    llm = LLM(str(llama_ckpt), **OPTIONS)
    engine = llm.engine
    before = llm.generate([[5, 6, 7, 8, 9]], PARAMS)[0].generated_tokens
    engine.add_request("inflight", [11, 12, 13], PARAMS)
    engine.step()
    keys = PoolPairKeys()  # what a GPU handoff remembers of (peer pool, own pool)
    peer = tuple(torch.zeros_like(kv) for kv in engine.kv_caches)
    remembered = keys.key(peer, engine.kv_caches)
    lifecycle.suspend(engine)
    assert all(kv.untyped_storage().nbytes() == 0 for kv in engine.kv_caches)
    assert engine.pool.stats().num_in_use == 0 and engine.pool.stats().num_cached == 0
    engine.check_integrity()
    lifecycle.resume(engine)
    assert all(kv.untyped_storage().nbytes() == kv.numel() * 4 for kv in engine.kv_caches)
    # the same tensor objects over new memory: the remembered pool pair is worked out again
    assert keys.key(peer, engine.kv_caches) == pools_token(peer, engine.kv_caches) != remembered
    # The preempted request is recomputed and finishes like an uninterrupted one.
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    resumed = [o.result for o in outs if o.request_id == "inflight" and o.result.is_finished][0]
    assert resumed.generated_tokens == llm.generate([[11, 12, 13]], PARAMS)[0].generated_tokens
    assert llm.generate([[5, 6, 7, 8, 9]], PARAMS)[0].generated_tokens == before

    other = tmp_path / "v2"
    hf = build_hf_checkpoint(other, "llama", seed=123)
    lifecycle.suspend(engine)
    lifecycle.reload_weights(engine, str(other))
    lifecycle.resume(engine)
    after = llm.generate([[5, 6, 7, 8, 9]], PARAMS)[0].generated_tokens
    ref = hf.generate(torch.tensor([[5, 6, 7, 8, 9]]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    assert after == ref[0, 5:].tolist() and after != before
    engine.check_integrity()


def test_suspend_frees_a_hybrid_models_state_memory_and_resume_recomputes(tmp_path):
    """Mamba2 + attention: suspend gives the recurrent-state memory back with the KV's (slots,
    prefix-cache states); after resume a request preempted mid-generation finishes as an
    uninterrupted one, and new requests are unchanged."""
    build_hybrid_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), **OPTIONS)
    engine = llm.engine
    pool = engine.runner.states.pool
    sizes = [t.untyped_storage().nbytes() for t in pool.tensors()]
    assert all(sizes)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    before = llm.generate([prompt], PARAMS)[0].generated_tokens
    engine.add_request("inflight", [11, 12, 13, 14, 15], PARAMS)
    for _ in range(3):
        engine.step()
    lifecycle.suspend(engine)
    assert all(t.untyped_storage().nbytes() == 0 for t in pool.tensors())
    engine.check_integrity()
    lifecycle.resume(engine)
    assert [t.untyped_storage().nbytes() for t in pool.tensors()] == sizes
    assert all(not t.any() for t in pool.tensors())
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    resumed = [o.result for o in outs if o.request_id == "inflight" and o.result.is_finished][0]
    assert resumed.generated_tokens == llm.generate([[11, 12, 13, 14, 15]], PARAMS)[0].generated_tokens
    assert llm.generate([prompt], PARAMS)[0].generated_tokens == before
    engine.check_integrity()


def test_reload_refuses_another_architecture(tmp_path, llama_ckpt):
    engine = LLM(str(llama_ckpt), **OPTIONS).engine
    build_hf_checkpoint(tmp_path, "llama", hidden_size=32)
    with pytest.raises(ValueError, match="differs in \\['hidden_size'"):
        lifecycle.reload_weights(engine, str(tmp_path))
