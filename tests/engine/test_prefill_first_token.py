"""The prefill worker's engine hook hands each request's first token to its waiting call before the
handoff is published (block checksums, descriptor), so PrefillStream's first event is not held
back by the publication; a first token that ends the request says how it ended."""

from __future__ import annotations

import concurrent.futures

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.handoff import RankEndpoint
from splitserve.engine.transfer.inproc import InProcTransport
from splitserve.prefill_worker import hooks as prefill_hooks_module
from splitserve.prefill_worker.hooks import prefill_hooks

PROMPT = list(range(10, 27))


@pytest.fixture(scope="module")
def engine():
    return LLM(role="prefill", block_size_tokens=4, num_blocks=64, max_tokens=64).engine


def _run(engine, request_id: str, params: SamplingParams, monkeypatch):
    """(first-token future, outcome future, whether the token was out at each checksum call)."""
    transport = InProcTransport()
    hooks = prefill_hooks(
        engine, transport, {0: RankEndpoint(0, "inproc", transport.expose(engine.kv_caches))}
    )
    state, seen = hooks["state"], []
    state.first_tokens[request_id] = first = concurrent.futures.Future()
    state.waiters[request_id] = outcome = concurrent.futures.Future()
    checksums = prefill_hooks_module.group_block_checksums

    def recording(engine, block_ids):
        seen.append(first.done())
        return checksums(engine, block_ids)

    monkeypatch.setattr(prefill_hooks_module, "group_block_checksums", recording)
    engine.add_request(request_id, PROMPT, params)
    while engine.has_unfinished():
        hooks["after_step"](engine, engine.step())
    return first.result(timeout=0), outcome.result(timeout=0), seen


def test_first_token_is_out_before_the_handoff_is_published(engine, monkeypatch):
    params = SamplingParams(
        num_tokens_to_generate=4, temperature=0.0, return_log_probs=True, top_n_logprobs=2
    )
    first, outcome, seen = _run(engine, "h", params, monkeypatch)
    assert seen == [True]  # checksummed once, after the first token was handed over
    desc = outcome.descriptor
    assert (first.token_id, first.logprob) == (desc.first_token_id, desc.first_token_logprob)
    assert first.top_logprobs == desc.first_token_top_logprobs and len(first.top_logprobs) == 2
    assert first.finished_as is None
    assert engine.release_handoff("h")


def test_a_first_token_that_ends_the_request_says_so(engine, monkeypatch):
    first, outcome, seen = _run(
        engine, "one", SamplingParams(num_tokens_to_generate=1, temperature=0.0), monkeypatch
    )
    assert seen == [] and outcome.descriptor is None  # nothing to publish
    assert first.finished_as == "length" and first.logprob is None and first.top_logprobs == {}
    assert first.token_id == outcome.result.generated_tokens[0]
    engine.check_integrity()
