"""Async scheduling (engine/step_pipeline.py): a decode step stays in flight while
the next is scheduled and fed its tokens on the device. Forced on here (on CPU the
"device" is the CPU, but the bookkeeping is the same as on a GPU); every result
must equal the plain engine's, and nothing may be left in the pool."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine import step_pipeline

OPTIONS = dict(device="cpu", block_size_tokens=4, num_blocks=96, max_tokens=64)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (int(torch.randint(1, 23, (1,), generator=g)),), generator=g).tolist() for _ in range(n)]


def _count_run_ahead(engine) -> list[bool]:
    """Wrap `engine.step` to record, per step, whether it left a step in flight."""
    seen: list[bool] = []
    step = engine.step

    def counted():
        outputs = step()
        seen.append(engine._inflight is not None)
        return outputs

    engine.step = counted
    return seen


def _run(ckpt, prompts, params, **options):
    """Each prompt with its own params through `Engine.step`; (tokens, status) per request.
    `llm.ahead_steps`: per step, whether it left a step in flight."""
    llm, results = _results(ckpt, prompts, params, **options)
    return llm, [(r.generated_tokens, r.status) for r in results]


def _results(ckpt, prompts, params, **options):
    """`_run`'s engine and each request's final result."""
    sampler_graphs = options.pop("sampler_graphs", True)
    llm = LLM(str(ckpt), **{**OPTIONS, **options})
    engine = llm.engine
    if engine.runner.graphs is not None:
        engine.runner.graphs.sampler_graphs = sampler_graphs
    llm.ahead_steps = _count_run_ahead(engine)
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", prompt, p)
    final = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None and out.result.is_finished:
                final[out.request_id] = out.result
    engine.check_integrity()
    assert engine.pool.num_available == engine.pool.num_blocks  # every block back
    return llm, [final[f"r{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize(
    "params",
    [
        [SamplingParams(num_tokens_to_generate=n, temperature=0.0, ignore_eos=True) for n in (1, 5, 17, 9, 2, 30)],
        "eos",  # requests ending on their termination id at different steps (see below)
        # a sampled request among greedy ones: drawn at launch, it runs ahead with them
        [SamplingParams(num_tokens_to_generate=12, temperature=0.8, seed=4, ignore_eos=True)]
        + [SamplingParams(num_tokens_to_generate=12, temperature=0.0, ignore_eos=True)] * 5,
        # a sampled request with log-probs among sampled ones (engine/step_logprobs.py)
        [SamplingParams(num_tokens_to_generate=7, temperature=0.8, seed=5, ignore_eos=True, return_log_probs=True)]
        + [SamplingParams(num_tokens_to_generate=9, temperature=0.7, top_k=20, seed=6, ignore_eos=True)] * 5,
    ],
    ids=["lengths", "eos", "mixed-sampling", "logprobs"],
)
def test_async_scheduling_matches_plain(llama_ckpt, params):
    prompts = _prompts(6)
    if params == "eos":  # termination id = the token each request produces at step 2 + i
        probe = SamplingParams(num_tokens_to_generate=24, temperature=0.0, ignore_eos=True)
        _, free = _run(llama_ckpt, prompts, [probe] * 6, async_scheduling=False)
        params = [
            SamplingParams(num_tokens_to_generate=24, temperature=0.0, termination_id=tokens[2 + i])
            for i, (tokens, _) in enumerate(free)
        ]
    _, plain = _run(llama_ckpt, prompts, params, async_scheduling=False)
    llm, ahead = _run(llama_ckpt, prompts, params, async_scheduling=True)
    assert ahead == plain
    if any(p.termination_id is not None for p in params):
        assert sum(status == "stopped" for _, status in plain) >= 4
    assert llm.engine.async_scheduling


@pytest.mark.parametrize("top_k,top_p", [(0, 0.0), (30, 0.9), (0, 0.8)])
def test_sampled_requests_run_ahead_with_the_plain_engines_tokens(llama_ckpt, top_k, top_p):
    prompts = _prompts(4, seed=2)
    params = [SamplingParams(num_tokens_to_generate=10 + i, temperature=0.9, top_k=top_k, top_p=top_p, seed=10 + i,
                             ignore_eos=True) for i in range(4)]
    _, plain = _run(llama_ckpt, prompts, params, async_scheduling=False)
    llm, ahead = _run(llama_ckpt, prompts, params, async_scheduling=True)
    assert ahead == plain
    assert sum(llm.ahead_steps) >= 8, llm.ahead_steps  # sampled decode steps stayed in flight
    assert len({tuple(tokens) for tokens, _ in plain}) == 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device sampler and CUDA graphs need a GPU")
def test_sampled_decode_runs_ahead_on_the_gpu_with_the_plain_engines_tokens(llama_ckpt):
    prompts = _prompts(5, seed=3)
    params = [SamplingParams(num_tokens_to_generate=24, temperature=0.8, top_k=(0, 40)[i % 2], top_p=(0.0, 0.9)[i % 2],
                             seed=i, ignore_eos=True) for i in range(4)]
    params.append(SamplingParams(num_tokens_to_generate=24, temperature=0.0, ignore_eos=True))
    gpu = dict(device="cuda", enable_cuda_graphs=True, block_size_tokens=16, num_blocks=64)
    _, plain = _run(llama_ckpt, prompts, params, async_scheduling=False, sampler_graphs=False, **gpu)
    llm, ahead = _run(llama_ckpt, prompts, params, async_scheduling=True, **gpu)
    assert ahead == plain  # run ahead with graphed draws = plain steps with eager draws
    assert llm.engine.runner.graphs._last.sampler._draws  # the draws did come from sampler graphs
    assert sum(llm.ahead_steps) >= 16, llm.ahead_steps
    assert llm.engine.runner.graphs is not None


def _log_prob_params(n: int = 11) -> list[SamplingParams]:
    return [
        SamplingParams(num_tokens_to_generate=n, temperature=0.0, ignore_eos=True, return_log_probs=True),
        SamplingParams(num_tokens_to_generate=n + 2, temperature=0.0, ignore_eos=True, top_n_logprobs=3),
        SamplingParams(num_tokens_to_generate=n - 1, temperature=0.9, top_k=40, seed=7, ignore_eos=True,
                       return_log_probs=True, top_n_logprobs=2),
        SamplingParams(num_tokens_to_generate=n, temperature=0.0, ignore_eos=True),
    ]


def _log_probs_run(ckpt, prompts, params, **options):
    """Tokens, log-probs and top-N of each request; `llm.ahead_steps` as in `_run`."""
    llm, results = _results(ckpt, prompts, params, **options)
    return llm, [(r.generated_tokens, r.generated_log_probs, r.top_n_logprobs) for r in results]


def _assert_same(ahead, plain, atol: float = 1e-5) -> None:
    """Same tokens and top-N ids; log-probs within 1e-5 (a step run ahead still computes a row
    that finished a step earlier, and a CPU matmul over more rows may round its last bit
    differently)."""
    for (tokens, lps, tops), (tokens_p, lps_p, tops_p) in zip(ahead, plain, strict=True):
        assert tokens == tokens_p
        assert (lps is None) == (lps_p is None) and (tops is None) == (tops_p is None)
        if lps is not None:
            assert torch.allclose(torch.tensor(lps), torch.tensor(lps_p), atol=atol, rtol=0)
        for top, top_p in zip(tops or (), tops_p or (), strict=True):
            assert list(top) == list(top_p)
            assert torch.allclose(torch.tensor(list(top.values())), torch.tensor(list(top_p.values())), atol=atol, rtol=0)


def test_log_prob_requests_run_ahead_with_the_plain_engines_log_probs(llama_ckpt):
    """Greedy rows and device-drawn sampled rows (raw log-probs) have their log-probs computed at
    launch, so their decode steps stay in flight; every value equals the plain engine's."""
    prompts, params = _prompts(4, seed=4), _log_prob_params()
    _, plain = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=False)
    llm, ahead = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=True)
    _assert_same(ahead, plain)
    assert sum(llm.ahead_steps) >= 8, llm.ahead_steps
    greedy_lp, top3, sampled, _ = plain
    assert len(greedy_lp[1]) == 11 and all(lp < 0 for lp in greedy_lp[1])
    assert top3[1] is None and len(top3[2]) == 13 and all(len(t) == 3 for t in top3[2])
    for tokens, log_probs, tops in [sampled]:  # the drawn token's log-prob, and its top-2 beside it
        assert len(log_probs) == len(tokens) == len(tops) == 10
        assert all(lp <= max(top.values()) + 1e-6 for lp, top in zip(log_probs, tops, strict=True))
    # a greedy token is the top-1 entry, with the same log-prob
    assert all(max(top, key=top.get) == tok for tok, top in zip(top3[0], top3[2], strict=True))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device sampler and CUDA graphs need a GPU")
def test_log_prob_requests_run_ahead_on_the_gpu(llama_ckpt):
    """Decode graphs, the device sampler and its graphs: log-probs at launch equal the plain
    engine's, and the greedy rows' equal the CPU engine's (fp32)."""
    prompts, params = _prompts(4, seed=4), _log_prob_params(20)
    gpu = dict(device="cuda", enable_cuda_graphs=True, block_size_tokens=16, num_blocks=64, dtype="float32")
    _, plain = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=False, **gpu)
    llm, ahead = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=True, **gpu)
    _assert_same(ahead, plain)
    assert sum(llm.ahead_steps) >= 16, llm.ahead_steps
    _, cpu = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=False)
    greedy = [0, 1, 3]
    _assert_same([ahead[i] for i in greedy], [cpu[i] for i in greedy], atol=1e-4)  # GPU vs CPU sums


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_unread_logits_left_unstored_change_no_result(llama_ckpt, monkeypatch):
    """bf16 decode graphs leave the logits of argmax-only rows unstored (engine/cuda_graphs.py):
    in a batch that mixes them with rows that read their logits (log-probs, a draw, a penalty),
    every token, log-prob and top-N equals a run that stores every row."""
    from splitserve.engine import cuda_graphs

    prompts = _prompts(6, seed=9)
    params = [*_log_prob_params(16),
              SamplingParams(num_tokens_to_generate=16, temperature=0.0, ignore_eos=True, presence_penalty=0.5),
              SamplingParams(num_tokens_to_generate=18, temperature=0.0, ignore_eos=True)]
    assert [p.argmax_only for p in params] == [False, False, False, True, False, True]
    gpu = dict(device="cuda", enable_cuda_graphs=True, block_size_tokens=16, num_blocks=64, dtype="bfloat16")
    _, skipped = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=True, **gpu)
    monkeypatch.setattr(cuda_graphs, "SKIP_UNREAD_LOGITS", False)
    _, stored = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=True, **gpu)
    _assert_same(skipped, stored, atol=0.0)


def test_processed_log_probs_of_sampled_rows_keep_the_host_sampler(llama_ckpt):
    """Processed log-probs of a sampled row come from the host sampler at collect: such a
    request's steps are not run ahead, and results equal the plain engine's."""
    prompts, params = _prompts(4, seed=4), _log_prob_params(6)
    options = dict(logprobs_mode="processed_logprobs")
    _, plain = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=False, **options)
    llm, ahead = _log_probs_run(llama_ckpt, prompts, params, async_scheduling=True, **options)
    _assert_same(ahead, plain)
    assert not any(llm.ahead_steps[:5])  # while the sampled request runs (4 decode steps): none ahead
    without = [p for i, p in enumerate(params) if i != 2]
    llm, _ = _log_probs_run(llama_ckpt, [p for i, p in enumerate(prompts) if i != 2], without,
                            async_scheduling=True, **options)
    assert sum(llm.ahead_steps) >= 4  # greedy rows' log-probs are raw = processed: run ahead


def test_async_scheduling_keeps_steps_in_flight_and_aborts_cleanly(llama_ckpt):
    llm = LLM(str(llama_ckpt), **OPTIONS, async_scheduling=True)
    engine = llm.engine
    params = SamplingParams(num_tokens_to_generate=20, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(_prompts(3, seed=1)):
        engine.add_request(f"r{i}", prompt, params)
    seen: dict[str, list[int]] = {}
    in_flight_steps = 0
    for _ in range(6):
        for out in engine.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        in_flight_steps += engine._inflight is not None
        for req in engine.scheduler.running:  # a placeholder only while a step is in flight
            assert (step_pipeline.PLACEHOLDER in req.output_token_ids) == (engine._inflight is not None)
    assert in_flight_steps >= 3
    assert engine.abort("r1")  # mid-flight: its row is dropped, its blocks freed
    while engine.has_unfinished():
        for out in engine.step():
            seen.setdefault(out.request_id, []).extend(out.new_token_ids)
    engine.check_integrity()
    assert engine.pool.num_available == engine.pool.num_blocks
    plain = LLM(str(llama_ckpt), **OPTIONS, async_scheduling=False).generate(_prompts(3, seed=1), params)
    assert seen["r0"] == plain[0].generated_tokens and seen["r2"] == plain[2].generated_tokens
    assert seen["r1"] == plain[1].generated_tokens[: len(seen["r1"])]
    assert all(t != step_pipeline.PLACEHOLDER for toks in seen.values() for t in toks)


def test_async_scheduling_defaults_off_without_cuda_graphs(llama_ckpt):
    assert not LLM(str(llama_ckpt), **OPTIONS).engine.async_scheduling
