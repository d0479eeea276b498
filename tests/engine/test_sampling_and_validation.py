"""Sampling parameters, stop conditions, and bad input (clear errors, nothing left in the pool)."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.sampler import process_logits

OPTIONS = dict(block_size_tokens=4, num_blocks=64, max_tokens=32, max_sequence_length=100)


@pytest.fixture(scope="module")
def llm(llama_ckpt):
    return LLM(str(llama_ckpt), **OPTIONS)


def test_seeded_sampling_is_reproducible_and_varies_with_the_seed(llm):
    prompt = [5, 6, 7, 8]
    p = dict(num_tokens_to_generate=16, temperature=1.0, ignore_eos=True)
    a = llm.generate([prompt], SamplingParams(seed=1, **p))[0].generated_tokens
    b = llm.generate([prompt], SamplingParams(seed=1, **p))[0].generated_tokens
    c = llm.generate([prompt], SamplingParams(seed=2, **p))[0].generated_tokens
    assert a == b and a != c


def test_a_continuation_counting_on_past_the_sent_tokens_draws_what_the_unbroken_run_drew(llm):
    """A stream resumed elsewhere (router: prompt + the tokens sent, `output_offset` = their count)
    samples each later token with the seed of its position in the whole output."""
    prompt = [5, 6, 7, 8, 9]
    p = dict(temperature=1.5, seed=3, ignore_eos=True)
    full = llm.generate([prompt], SamplingParams(num_tokens_to_generate=14, **p))[0].generated_tokens
    sent = full[:6]
    rest = llm.generate([prompt + sent], SamplingParams(num_tokens_to_generate=8, output_offset=6, **p))[0]
    assert rest.generated_tokens == full[6:]
    restarted = llm.generate([prompt + sent], SamplingParams(num_tokens_to_generate=8, **p))[0]
    assert restarted.generated_tokens != full[6:]  # positions from 0: other seeds, other draws


def test_top_k_1_and_tiny_top_p_are_greedy(llm):
    prompt = [9, 10, 11]
    greedy = llm.generate([prompt], SamplingParams(num_tokens_to_generate=10, temperature=0.0, ignore_eos=True))[0]
    k1 = llm.generate([prompt], SamplingParams(num_tokens_to_generate=10, top_k=1, ignore_eos=True, seed=4))[0]
    p0 = llm.generate([prompt], SamplingParams(num_tokens_to_generate=10, top_p=1e-6, ignore_eos=True, seed=4))[0]
    assert greedy.generated_tokens == k1.generated_tokens == p0.generated_tokens


@pytest.mark.parametrize("kwargs,argmax_only", [
    (dict(temperature=0.0), True),
    (dict(temperature=0.7, top_k=1), True),  # top-k 1 is greedy
    (dict(temperature=0.7), False),
    (dict(temperature=0.0, return_log_probs=True), False),
    (dict(temperature=0.0, top_n_logprobs=2), False),
    (dict(temperature=0.0, logit_bias={5: 1.0}), False),
    (dict(temperature=0.0, frequency_penalty=0.3), False),
])
def test_argmax_only_rows_are_greedy_with_nothing_else_reading_their_logits(kwargs, argmax_only):
    """The rows whose logits a decode graph may leave unstored (engine/cuda_graphs.py)."""
    assert SamplingParams(num_tokens_to_generate=4, **kwargs).argmax_only is argmax_only


def test_process_logits_masks_exactly():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0])
    x = process_logits(logits, SamplingParams(top_k=2))
    assert torch.isinf(x[2:]).all() and torch.equal(x[:2], logits[:2])
    # softmax([4,3,2,1]) = [.644, .237, .087, .032]: top_p=0.8 keeps two, 0.9 keeps three.
    assert torch.isinf(process_logits(logits, SamplingParams(top_p=0.8))).tolist() == [False, False, True, True]
    assert torch.isinf(process_logits(logits, SamplingParams(top_p=0.9))).tolist() == [False, False, False, True]
    assert torch.allclose(process_logits(logits, SamplingParams(temperature=2.0)), logits / 2)


def test_processed_logprobs_differ_from_raw(llama_ckpt):
    params = SamplingParams(num_tokens_to_generate=5, top_k=2, seed=3, return_log_probs=True, ignore_eos=True)
    raw = LLM(str(llama_ckpt), **OPTIONS).generate([[4, 5]], params)[0]
    processed = LLM(str(llama_ckpt), logprobs_mode="processed_logprobs", **OPTIONS).generate([[4, 5]], params)[0]
    assert raw.generated_tokens == processed.generated_tokens
    # top_k=2 renormalises over two tokens: the chosen one is strictly likelier.
    assert all(p > r for p, r in zip(processed.generated_log_probs, raw.generated_log_probs, strict=True))


def test_termination_id_and_token_limits(llm):
    prompt = [5, 6, 7, 8]
    free = llm.generate([prompt], SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True))[0]
    stop_at = free.generated_tokens[3]
    cut = llm.generate([prompt], SamplingParams(num_tokens_to_generate=8, temperature=0.0, termination_id=stop_at))[0]
    assert cut.generated_tokens == free.generated_tokens[: free.generated_tokens.index(stop_at) + 1]
    assert cut.status == "stopped"
    total = llm.generate([prompt], SamplingParams(num_tokens_to_generate=None, num_tokens_total=10, temperature=0.0))[0]
    assert len(total.generated_tokens) == 6 and total.status in ("length", "stopped")
    assert free.status == "length" and free.prompt_length == 4 and free.prompt_tokens is None
    echoed = llm.generate([prompt], SamplingParams(num_tokens_to_generate=1, return_prompt_tokens=True))[0]
    assert echoed.prompt_tokens == prompt and echoed.ttft is not None and echoed.ttft >= 0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(temperature=-1.0), "temperature must be a finite number >= 0, got -1.0"),
        (dict(top_p=1.5), "top_p must be in \\[0, 1\\], got 1.5"),
        (dict(top_k=-2), "top_k must be an integer >= 0, got -2"),
        (dict(num_tokens_to_generate=0), "num_tokens_to_generate must be a positive integer, got 0"),
        (dict(num_tokens_total=5), "mutually exclusive"),
        (dict(seed=-1), "seed must be a non-negative integer"),
        (dict(output_offset=-1), "output_offset must be an integer >= 0, got -1"),
        (dict(top_n_logprobs=50), "top_n_logprobs must be an integer in \\[0, 20\\]"),
        (dict(stop_words=[""]), "stop_words must be non-empty strings"),
        (dict(temperature=float("nan")), "temperature must be a finite number"),
    ],
)
def test_invalid_sampling_values_are_rejected(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_nothing_in_the_pool(llm):
    engine = llm.engine
    params = SamplingParams(num_tokens_to_generate=4)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate([[1, 2, 3], []], params)
    with pytest.raises(ValueError, match="prompt has 150 tokens; the limit is 99"):
        llm.generate([[1, 2], [3] * 150], params)
    with pytest.raises(ValueError, match="token id 9999 is outside the vocabulary"):
        llm.generate([[1, 9999]], params)
    with pytest.raises(ValueError, match="leaves no room"):
        llm.generate([[1] * 20], SamplingParams(num_tokens_to_generate=None, num_tokens_total=20))
    with pytest.raises(ValueError, match="no tokenizer.json"):
        llm.generate("text needs a tokenizer", params)
    with pytest.raises(ValueError, match="must be a string or a list of token ids"):
        llm.generate([1.5], params)
    assert not engine.has_unfinished()
    assert engine.pool.stats().num_in_use == 0
    engine.check_integrity()


def test_the_sdks_sampling_params_are_taken_field_by_field(llm):
    """Code moves between `Client.generate` and `LLM.generate` unchanged: the SDK's SamplingParams
    (a subset of the engine's fields) gives the same tokens; anything else is a TypeError naming it."""
    from splitserve.client import SamplingParams as ClientSamplingParams

    prompt = [[5, 17, 33, 2]]
    fields = dict(num_tokens_to_generate=6, temperature=0.7, top_k=5, seed=11, return_log_probs=True)
    mine = llm.generate(prompt, SamplingParams(**fields))[0]
    sdks = llm.generate(prompt, ClientSamplingParams(**fields))[0]
    assert sdks.generated_tokens == mine.generated_tokens and sdks.generated_log_probs == mine.generated_log_probs
    with pytest.raises(TypeError, match="sampling params must be splitserve.SamplingParams .*got dict"):
        llm.generate(prompt, {"num_tokens_to_generate": 3})
    assert llm.engine.pool.stats().num_in_use == 0


def test_loading_weights_shows_a_progress_bar_where_asked(llama_ckpt, monkeypatch, capsys):
    """engine/models/loader.py: a bar in checkpoint bytes on stderr (by default for checkpoints of
    1 GiB or more on a terminal; SPLITSERVE_PROGRESS=1 / 0 forces it), ending at 100%."""
    monkeypatch.setenv("SPLITSERVE_PROGRESS", "1")
    LLM(str(llama_ckpt), **OPTIONS)
    shown = capsys.readouterr().err.replace("\r", "\n").splitlines()
    assert any(line.startswith("loading weights: 100%") for line in shown), shown
    monkeypatch.delenv("SPLITSERVE_PROGRESS")  # small checkpoint, stderr no terminal: quiet
    LLM(str(llama_ckpt), **OPTIONS)
    assert "loading weights" not in capsys.readouterr().err


def test_missing_or_unsupported_checkpoints_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError, match="no config.json"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        LLM(str(tmp_path))
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        LLM(str(tmp_path))


def test_pickle_checkpoints_are_refused(tmp_path, llama_ckpt):
    (tmp_path / "config.json").write_text((llama_ckpt / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(FileNotFoundError, match="pickle checkpoints are not loaded"):
        LLM(str(tmp_path))


def test_engine_option_errors_quote_the_value(llama_ckpt):
    with pytest.raises(ValueError, match="prefix_caching_eviction_policy must be 'lru' or 'ref_zero', got 'fifo'"):
        LLM(str(llama_ckpt), prefix_caching_eviction_policy="fifo")
    with pytest.raises(ValueError, match="block_size_tokens must be a positive number, got 0"):
        LLM(str(llama_ckpt), block_size_tokens=0)
    with pytest.raises(TypeError, match="unknown engine option 'blok_size'"):
        LLM(str(llama_ckpt), blok_size=3)
