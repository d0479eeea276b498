"""Hybrid Mamba2 + attention + MLP (NemotronH) against `transformers` built from a small
random config: greedy tokens identical over 32 new tokens for a mixed-length batch,
log-probs within 1e-4 (fp32); chunked prefill and prefix caching (KV + recurrent
state at block boundaries) on or off give the same tokens."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.fixtures.models import build_hybrid_checkpoint

torch.set_num_threads(1)

GEN = 32
OPTIONS = dict(block_size_tokens=8, num_blocks=256)


def _prompts(vocab=512):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (1, 7, 33, 90)]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h")
    model = build_hybrid_checkpoint(path)
    refs = []
    for prompt in _prompts():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=GEN, do_sample=False, eos_token_id=None,
            output_logits=True, return_dict_in_generate=True,
        )
        logprobs = torch.stack([torch.log_softmax(s[0].float(), -1) for s in out.logits])
        refs.append((out.sequences[0, len(prompt):].tolist(), logprobs))
    return str(path), _prompts(), refs


def test_greedy_tokens_and_logprobs_match_transformers(case):
    path, prompts, refs = case
    llm = LLM(path, max_tokens=48, **OPTIONS)
    params = SamplingParams(num_tokens_to_generate=GEN, temperature=0.0, ignore_eos=True, return_log_probs=True,
                            skip_prompt_log_probs=True)
    results = llm.generate(prompts, params)
    for res, (tokens, logprobs) in zip(results, refs, strict=True):
        assert res.generated_tokens == tokens
        ours = torch.tensor(res.generated_log_probs)
        theirs = logprobs.gather(1, torch.tensor(tokens)[:, None]).squeeze(1)
        assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()
    llm.engine.check_integrity()
    assert llm.engine.runner.states.pool.num_free_slots == llm.engine.runner.states.pool.num_slots


@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_chunked_prefill_and_prefix_caching_do_not_change_tokens(case, chunked, caching):
    path, prompts, refs = case
    shared = [prompts[3][:40] + prompts[1], prompts[3]]  # a 40-token shared prefix, and a repeat
    llm = LLM(path, max_tokens=16 if chunked else 256, enable_chunked_prefill=chunked,
              enable_prefix_caching=caching, **OPTIONS)
    params = SamplingParams(num_tokens_to_generate=GEN, temperature=0.0, ignore_eos=True)
    first = llm.generate(prompts, params)
    assert [r.generated_tokens for r in first] == [t for t, _ in refs]
    second = llm.generate(shared + prompts, params)
    assert [r.generated_tokens for r in second[2:]] == [t for t, _ in refs]
    assert second[1].generated_tokens == refs[3][0]
    if caching:  # every full prompt block's boundary has its recurrent state cached
        assert second[1].num_cached_tokens == 88
        assert second[0].num_cached_tokens == 40
    else:
        assert all(r.num_cached_tokens == 0 for r in second)
    llm.engine.check_integrity()


def test_small_state_budget_limits_hits_to_cached_states_not_tokens(case):
    """A prefix store of 3 states: the KV of a repeated prompt is all cached, but only the
    boundaries whose state survived LRU eviction can be resumed from."""
    path, prompts, refs = case
    llm = LLM(path, max_tokens=256, **OPTIONS)
    states = llm.engine.runner.states
    per_state = sum(layer.prefix_conv[0].nbytes + layer.prefix_ssm[0].nbytes for layer in states.layers)
    llm = LLM(path, max_tokens=256, prefix_caching_mamba_gb=3 * per_state / 1024**3, **OPTIONS)
    assert llm.engine.runner.states.pool.prefix.capacity == 3
    params = SamplingParams(num_tokens_to_generate=GEN, temperature=0.0, ignore_eos=True)
    llm.generate([prompts[3]], params)
    # 90 prompt + 31 processed generated tokens: boundaries 8..120 saved; 104, 112, 120 survive.
    again = llm.generate([prompts[3]], params)[0]
    assert again.generated_tokens == refs[3][0]
    assert again.num_cached_tokens == 0  # no surviving state inside the 88 reusable prompt tokens
    # The prompt continued by 30 generated tokens: KV hits 14 blocks, the state at 112 is cached
    # (saved during decode), so the request resumes there and continues the reference.
    longer = llm.generate([prompts[3] + refs[3][0][:30]], params)[0]
    assert longer.num_cached_tokens == 112
    assert longer.generated_tokens[:2] == refs[3][0][30:]
    llm.engine.check_integrity()


@pytest.mark.parametrize("state_dtype", ["float16", "bfloat16"])
def test_state_dtypes_are_configurable(case, state_dtype):
    path, prompts, refs = case
    llm = LLM(path, max_tokens=48, mamba_state_dtype=state_dtype, conv_state_dtype=state_dtype, **OPTIONS)
    layer = llm.engine.runner.states.layers[0]
    assert layer.ssm.dtype == layer.conv.dtype == layer.prefix_ssm.dtype == getattr(torch, state_dtype)
    params = SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True)
    out = llm.generate(prompts[2:3], params)[0]
    assert len(out.generated_tokens) == 8
    assert out.generated_tokens[:2] == refs[2][0][:2]  # rounding the state moves logits a little, not the argmax early
    llm.engine.check_integrity()


def test_config_errors_quote_the_value(tmp_path):
    from splitserve.engine.config import CacheConfig
    from splitserve.engine.models.config import ModelConfig

    with pytest.raises(ValueError, match="'float64'"):
        CacheConfig(mamba_state_dtype="float64")
    with pytest.raises(ValueError, match="-1"):
        CacheConfig(prefix_caching_mamba_gb=-1)
    cfg = dict(architectures=["NemotronHForCausalLM"], layers_block_type=["linear_attention", "moe"],
               vocab_size=8, hidden_size=8, num_attention_heads=2, intermediate_size=8,
               mamba_num_heads=2, mamba_head_dim=4, ssm_state_size=4)
    with pytest.raises(ValueError, match="'moe'"):
        ModelConfig.from_dict(cfg)
    cfg["hybrid_override_pattern"], cfg["layers_block_type"] = "M*-", None
    assert ModelConfig.from_dict(cfg).layer_types == ("mamba", "attention", "mlp")
