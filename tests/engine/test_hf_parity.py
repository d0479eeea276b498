"""Our engine against Hugging Face `transformers` built from small random configs:
greedy tokens identical for 32+ new tokens over a mixed-length batch, log-probs
(hence logits up to a shared constant) within 1e-4 in fp32."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.fixtures.models import build_hf_checkpoint

torch.set_num_threads(1)

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope-scaling": (
        "llama",
        dict(
            rope_scaling=dict(
                rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
            )
        ),
    ),
    "llama-linear-rope": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=2.0), num_key_value_heads=1)),
    "qwen2-qkv-bias": ("qwen2", dict(num_key_value_heads=2)),
}

GEN = 32


def _prompts(vocab=512):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 7, 33, 90)]


def _hf_reference(model, prompt):
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=GEN,
        do_sample=False,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logprobs = torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.logits])  # [GEN, vocab]
    with torch.no_grad():
        prompt_lp = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    return tokens, logprobs, prompt_lp


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    family, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    model = build_hf_checkpoint(path, family, **overrides)
    prompts = _prompts()
    return str(path), prompts, [_hf_reference(model, p) for p in prompts]


def test_greedy_tokens_and_logprobs_match_transformers(case):
    path, prompts, refs = case
    llm = LLM(path, block_size_tokens=8, num_blocks=256, max_tokens=48)
    params = SamplingParams(
        num_tokens_to_generate=GEN, temperature=0.0, ignore_eos=True, return_log_probs=True, top_n_logprobs=5
    )
    results = llm.generate(prompts, params)
    for prompt, res, (tokens, logprobs, prompt_lp) in zip(prompts, results, refs, strict=True):
        assert res.generated_tokens == tokens
        ours = torch.tensor(res.generated_log_probs)
        theirs = logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
        for step, top in enumerate(res.top_n_logprobs):
            for token_id, value in top.items():
                assert abs(value - float(logprobs[step, token_id])) < 1e-4
        expected_prompt = prompt_lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(res.prompt_log_probs), expected_prompt, atol=1e-4)
        assert len(res.prompt_log_probs) == len(prompt) - 1
        # Each prompt position's top 5 (max_tokens=48 cuts the longer prompts into chunks).
        assert len(res.prompt_top_logprobs) == len(prompt) - 1
        values, ids = prompt_lp[:-1].topk(5)
        for pos, top in enumerate(res.prompt_top_logprobs):
            assert list(top) == ids[pos].tolist()
            assert torch.allclose(torch.tensor(list(top.values())), values[pos], atol=1e-4)
    llm.engine.check_integrity()


def test_prompt_log_probs_are_computed_a_bounded_number_of_rows_at_a_time(case, monkeypatch):
    """A long prompt's echo must not allocate a whole chunk's logits: with room for 5 rows of the
    vocabulary the prompt log-probs and top N come from blocks of at most 5 rows, equal to
    transformers' as before."""
    from splitserve.engine import step_sampling

    path, prompts, refs = case
    llm = LLM(path, block_size_tokens=8, num_blocks=256, max_tokens=48)
    vocab = llm.engine.runner.logit_slots.vocab
    monkeypatch.setattr(step_sampling, "PROMPT_LOGITS_ELEMENTS", 5 * vocab + vocab // 2)
    model = llm.engine.runner.model
    widest = []
    compute = model.compute_logits
    monkeypatch.setattr(model, "compute_logits", lambda h: (widest.append(h.shape[0]), compute(h))[1])
    params = SamplingParams(num_tokens_to_generate=2, temperature=0.0, ignore_eos=True, return_log_probs=True,
                            top_n_logprobs=3)
    for prompt, res, (_, _, prompt_lp) in zip(prompts, llm.generate(prompts, params), refs, strict=True):
        expected = prompt_lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(res.prompt_log_probs), expected, atol=1e-4)
        values, ids = prompt_lp[:-1].topk(3)
        assert [list(top) for top in res.prompt_top_logprobs] == ids.tolist()
    assert widest and max(widest) == 5, widest


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_and_prefix_caching_do_not_change_tokens(case, chunked, caching):
    path, prompts, refs = case
    # Prompts sharing a 40-token prefix with the 90-token one exercise cache hits.
    shared = [prompts[3][:40] + prompts[1], prompts[3]]
    llm = LLM(
        path,
        block_size_tokens=8,
        num_blocks=256,
        max_tokens=16 if chunked else 256,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
    )
    params = SamplingParams(num_tokens_to_generate=GEN, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params)
    assert [r.generated_tokens for r in first] == [t for t, _, _ in refs]
    second = llm.generate(shared + prompts, params)
    assert [r.generated_tokens for r in second[2:]] == [t for t, _, _ in refs]
    assert second[1].generated_tokens == refs[3][0]
    if caching:
        assert second[1].num_cached_tokens == 88  # all full blocks but the one holding the last token
        assert second[0].num_cached_tokens == 40
    else:
        assert all(r.num_cached_tokens == 0 for r in second)
    llm.engine.check_integrity()


def test_sharded_safetensors_checkpoint_loads(tmp_path):
    model = build_hf_checkpoint(tmp_path / "one", "llama")
    model.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="100KB")
    shards = sorted(p.name for p in (tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) > 1 and (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    params = SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True)
    prompt = [[3, 14, 15, 92, 65]]
    one = LLM(str(tmp_path / "one"), num_blocks=64).generate(prompt, params)[0]
    many = LLM(str(tmp_path / "sharded"), num_blocks=64).generate(prompt, params)[0]
    assert many.generated_tokens == one.generated_tokens
