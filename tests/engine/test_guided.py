"""Structured output (engine/guided.py): tokens sampled under a JSON schema's mask."""

import json

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.guided import compile_schema
from tests.fixtures.engine_batch import run_batch as _batch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
PROMPTS = ["Give me a person as JSON:", "def main():\n", "x"]


@pytest.fixture(scope="module")
def llm():
    return LLM(block_size_tokens=16, num_blocks=256)  # the embedded model: it has a tokenizer


def _follows(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"name", "age", "tags", "ok"} and isinstance(value["name"], str) and len(value["name"]) <= 8
            and isinstance(value["age"], int) and 0 <= value["age"] <= 150 and isinstance(value["ok"], bool)
            and all(t in ("a", "b", "c") for t in value["tags"]) and len(value["tags"]) <= 3)  # fmt: skip


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_follow_the_schema_and_stop_when_it_is_complete(llm, temperature):
    params = SamplingParams(num_tokens_to_generate=80, temperature=temperature, seed=5, json_schema=json.dumps(SCHEMA),
                            return_log_probs=True)  # fmt: skip
    for result in llm.generate(PROMPTS, params):
        assert result.status == "stopped", result.generated_text  # the grammar completed: EOS was all it allowed
        assert _follows(result.generated_text), result.generated_text
        assert len(result.generated_log_probs) == len(result.generated_tokens)
    # the same draws again: seeded per position as any sampled row
    again = llm.generate(PROMPTS, params)
    assert [r.generated_tokens for r in again] == [r.generated_tokens for r in llm.generate(PROMPTS, params)]
    llm.engine.check_integrity()


def _batches(rows):
    """`rows` as one batch on a plain engine and on one scheduling ahead: results of each, and
    per step of the latter whether it ran ahead."""
    plain, _ = _batch(LLM(block_size_tokens=16, num_blocks=256, async_scheduling=False).engine, rows)
    ahead_results, ahead = _batch(LLM(block_size_tokens=16, num_blocks=256, async_scheduling=True).engine, rows)
    return plain, ahead_results, ahead


def test_guided_greedy_rows_run_ahead_with_the_plain_engines_tokens():
    """A guided row that wants only its token does not stop its batch from running ahead: its
    token is taken (mask filled, masked argmax queued) before the next step is launched, and every
    row's tokens are those of an engine that never runs ahead."""
    plain = SamplingParams(num_tokens_to_generate=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(num_tokens_to_generate=24, temperature=0.9, seed=7, ignore_eos=True)
    guided = SamplingParams(num_tokens_to_generate=40, temperature=0.0, json_schema=json.dumps(SCHEMA))
    rows = [(PROMPTS[0], plain), (PROMPTS[1], seeded), (PROMPTS[2], guided), (PROMPTS[0], guided)]
    want, got, ahead = _batches(rows)
    assert [r.generated_tokens for r in got] == [r.generated_tokens for r in want]
    assert all(g.status == "stopped" and _follows(g.generated_text) for g in got[2:])
    running = min(len(g.generated_tokens) for g in got[2:])  # both guided rows in every one of these steps
    assert sum(ahead[: running - 1]) >= running - 3, ahead  # (the first step is a prefill, the last waits)


@pytest.mark.parametrize("guided", [
    SamplingParams(num_tokens_to_generate=40, temperature=0.0, json_schema=json.dumps(SCHEMA), return_log_probs=True),
    SamplingParams(num_tokens_to_generate=40, temperature=0.0, json_schema=json.dumps(SCHEMA), logit_bias={25: 1.0}),
    SamplingParams(num_tokens_to_generate=40, temperature=0.8, seed=3, json_schema=json.dumps(SCHEMA)),
], ids=["log-probs", "bias", "sampled-on-cpu"])
def test_guided_rows_the_host_samples_never_run_ahead(guided):
    """A guided row sampled on the host (it wants log-probs or a bias, or is sampled where no device
    sampler draws) keeps its batch from running ahead; the rows beside it get their tokens alone."""
    plain = SamplingParams(num_tokens_to_generate=24, temperature=0.0, ignore_eos=True)
    seeded = SamplingParams(num_tokens_to_generate=24, temperature=0.9, seed=7, ignore_eos=True)
    want, got, ahead = _batches([(PROMPTS[0], plain), (PROMPTS[1], seeded), (PROMPTS[2], guided)])
    assert [r.generated_tokens for r in got] == [r.generated_tokens for r in want]
    alone, _ = _batch(LLM(block_size_tokens=16, num_blocks=256, async_scheduling=True).engine,
                      [(PROMPTS[0], plain), (PROMPTS[1], seeded)])
    assert [r.generated_tokens for r in got[:2]] == [r.generated_tokens for r in alone]
    g = got[2]
    assert g.status == "stopped" and _follows(g.generated_text)
    assert not any(ahead[: len(g.generated_tokens) - 1]), ahead


def test_bad_schemas_and_models_without_a_tokenizer_are_refused(llm, llama_ckpt):
    with pytest.raises(ValueError, match="json_schema must be the JSON text of a schema"):
        SamplingParams(json_schema="{nope")
    with pytest.raises(ValueError, match="json_schema must be a JSON object"):
        SamplingParams(json_schema="[1, 2]")
    with pytest.raises(ValueError, match="json_schema cannot be compiled: Invalid type: nonsense"):
        llm.generate(["x"], SamplingParams(json_schema='{"type": "nonsense"}'))
    with pytest.raises(ValueError, match="cannot be compiled"):
        compile_schema('{"type": "object", "minProperties": 3, "maxProperties": 1}')
    llm.engine.check_integrity()  # nothing held by the refused requests
    bare = LLM(str(llama_ckpt), block_size_tokens=8, num_blocks=64)  # token ids only: no tokenizer.json
    with pytest.raises(ValueError, match="need the model.s tokenizer.json"):
        bare.generate([[5, 6, 7]], SamplingParams(json_schema='{"type": "object"}'))


def test_a_lark_grammar_guides_as_a_schema_does(llm):
    """`grammar` (llguidance Lark, as the gateway's forced tool calls use): only its sentences come
    out, with a schema embedded by `%json`."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"],
              "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}
    grammar = f'start: ("yes" | "no") " " %json {json.dumps(schema)}'
    params = SamplingParams(num_tokens_to_generate=40, temperature=1.0, seed=3, grammar=grammar)
    for result in llm.generate(PROMPTS, params):
        word, _, rest = result.generated_text.partition(" ")
        assert result.status == "stopped" and word in ("yes", "no") and isinstance(json.loads(rest)["n"], int)
    with pytest.raises(ValueError, match="excludes json_schema"):
        SamplingParams(grammar="start: \"a\"", json_schema="{}")
    with pytest.raises(ValueError, match="grammar cannot be compiled"):
        llm.generate(["x"], SamplingParams(grammar="start: undefined_rule"))
    llm.engine.check_integrity()


def _own_mask(matcher, vocab: int) -> torch.Tensor:
    """One matcher's mask as llguidance fills it alone, unpacked bit by bit."""
    import llguidance.torch as llg_torch

    bits = llg_torch.allocate_token_bitmask(1, vocab)
    llg_torch.fill_next_token_bitmask(matcher, bits)
    return torch.tensor([bool((int(bits[0, t // 32]) >> (t % 32)) & 1) for t in range(vocab)])


def test_a_steps_masks_are_each_matchers_own(llm):
    """StepMasks fills a step's rows together: each row = its matcher's own mask (matchers at
    different points of the JSON), a completed grammar's = the end-of-sequence tokens only, a
    broken matcher's = every token (sampling never sees an empty distribution)."""
    from splitserve.engine.guided import StepMasks

    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(json_schema=json.dumps(SCHEMA))
    text = json.dumps({"name": "ab", "age": 7, "tags": ["a"], "ok": True})
    ids = engine.tokenizer.encode(text, add_bos=False)
    matchers = {i: engine.guides.matcher(params, ids[:n]) for i, n in enumerate((0, 3, len(ids) // 2, len(ids)))}
    broken = engine.guides.matcher(params, [])
    assert not broken.consume_token(engine.tokenizer.encode("zzz", add_bos=False)[0]) and broken.is_error()
    matchers[7] = broken
    rows = StepMasks(matchers, vocab).rows(torch.device("cpu"))
    parallel = StepMasks(matchers, vocab).rows(torch.device("cpu"), parallel=True)  # as a GPU engine fills them
    assert all(torch.equal(parallel[i], rows[i]) for i in rows)
    assert sorted(rows) == [0, 1, 2, 3, 7]
    for i in (0, 1, 2):
        assert torch.equal(rows[i], _own_mask(matchers[i], vocab)), i
        assert 0 < int(rows[i].sum()) < vocab
    assert rows[3].nonzero().flatten().tolist() == [engine.tokenizer.eos_token_id]  # complete: EOS only
    assert bool(rows[7].all())
    # Matchers are copies of one fresh matcher per grammar: what the others consumed left it fresh.
    assert torch.equal(_own_mask(engine.guides.matcher(params, []), vocab), rows[0])
    masks = StepMasks(matchers, vocab)
    masks.rows(torch.device("cpu"))
    assert torch.equal(masks.stacked, torch.stack([rows[i] for i in (0, 1, 2, 3, 7)]))


class _Bits:
    """A stand-in matcher whose mask is the bytes `fill` (llguidance writes a row through this call)."""

    def __init__(self, fill):
        self.fill = fill

    def unsafe_compute_mask_ptr(self, ptr: int, size: int) -> None:
        import ctypes

        ctypes.memmove(ptr, self.fill(size), size)

    def is_error(self) -> bool:
        return False


def test_an_empty_mask_lets_every_token_through_and_no_bit_past_the_vocabulary_counts():
    from splitserve.engine.guided import StepMasks

    vocab = 3 * 32 + 5  # the last word holds 5 tokens' bits and 27 past the vocabulary
    only_past = _Bits(lambda n: bytes(n - 4) + (0xFFFFFFE0).to_bytes(4, "little"))  # bits 5..31 of the last word
    one = _Bits(lambda n: bytes(4) + (1 << 3).to_bytes(4, "little") + bytes(n - 8))  # token 35
    masks = StepMasks({0: _Bits(bytes), 1: only_past, 2: one}, vocab)
    rows = masks.rows(torch.device("cpu"))
    assert masks.stacked.shape == (3, vocab)
    assert bool(rows[0].all()) and bool(rows[1].all())  # nothing allowed: everything is
    assert rows[2].nonzero().flatten().tolist() == [35]


def test_guided_greedy_rows_take_one_masked_argmax(llm, monkeypatch):
    """Guided greedy rows that want only their tokens are sampled together (one masked argmax);
    their tokens = those of the row-by-row sampler, which rows wanting log-probs still take."""
    from splitserve.engine.step_sampling import StepSampling

    taken = []
    batched = StepSampling._guided_tokens  # rows taken together (at collect, or settled ahead)
    monkeypatch.setattr(StepSampling, "_guided_tokens", lambda *a: taken.append((r := batched(*a))[0]) or r)
    bare = SamplingParams(num_tokens_to_generate=60, temperature=0.0, json_schema=json.dumps(SCHEMA))
    fast = llm.generate(PROMPTS, bare)
    assert sum(len(t) for t in taken) >= sum(len(r.generated_tokens) for r in fast) > 0
    taken.clear()
    slow = llm.generate(PROMPTS, SamplingParams(num_tokens_to_generate=60, temperature=0.0,
                                                json_schema=json.dumps(SCHEMA), return_log_probs=True))
    assert not any(taken)  # log-probs: the row-by-row sampler
    assert [r.generated_tokens for r in fast] == [r.generated_tokens for r in slow]
    assert all(r.status == "stopped" and _follows(r.generated_text) for r in fast)
    llm.engine.check_integrity()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the device paths (graphs, device sampler, run-ahead) need a GPU")
def test_on_the_gpu_guided_rows_match_the_cpu_and_leave_the_batch_alone(monkeypatch):
    """On a GPU a guided row skips the launch-time argmax, draws and adjustments and keeps its logits
    in the decode graphs; in fp32 its greedy JSON is the CPU engine's, its batch's other rows (a
    biased greedy one, a seeded one) get the tokens they get alone, and prompt log-probs agree."""
    gpu = LLM(block_size_tokens=16, num_blocks=256, device="cuda", enable_cuda_graphs=True, dtype="float32")
    cpu = LLM(block_size_tokens=16, num_blocks=256, dtype="float32")
    guided = SamplingParams(num_tokens_to_generate=60, temperature=0.0, json_schema=json.dumps(SCHEMA),
                            return_log_probs=True, top_n_logprobs=2)  # fmt: skip
    want = cpu.generate(PROMPTS, guided)
    got = gpu.generate(PROMPTS, guided)
    assert [r.generated_tokens for r in got] == [r.generated_tokens for r in want]
    bare = SamplingParams(num_tokens_to_generate=60, temperature=0.0, json_schema=json.dumps(SCHEMA))
    assert [r.generated_tokens for r in gpu.generate(PROMPTS, bare)] == [r.generated_tokens for r in want]
    # Sampled guided rows that want only their tokens: masked in place, drawn by the device sampler together.
    from splitserve.engine.step_sampling import StepSampling

    taken = []
    batched = StepSampling._guided_tokens  # rows taken together (at collect, or settled ahead)
    monkeypatch.setattr(StepSampling, "_guided_tokens", lambda *a: taken.append((r := batched(*a))[0]) or r)
    sampled = SamplingParams(num_tokens_to_generate=80, temperature=1.0, top_p=0.95, seed=11, json_schema=json.dumps(SCHEMA))
    first = gpu.generate(PROMPTS * 4, sampled)
    assert all(r.status == "stopped" and _follows(r.generated_text) for r in first), [r.generated_text for r in first]
    assert sum(len(t) for t in taken) >= sum(len(r.generated_tokens) for r in first)
    assert [r.generated_tokens for r in gpu.generate(PROMPTS * 4, sampled)] == [r.generated_tokens for r in first]
    monkeypatch.undo()
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(torch.tensor(g.prompt_log_probs), torch.tensor(w.prompt_log_probs), atol=1e-4)
        assert [list(t) for t in g.prompt_top_logprobs] == [list(t) for t in w.prompt_top_logprobs]
    biased = SamplingParams(num_tokens_to_generate=24, temperature=0.0, ignore_eos=True, logit_bias={25: 2.0})
    seeded = SamplingParams(num_tokens_to_generate=24, temperature=0.9, seed=7, ignore_eos=True)
    (a, b), _ = _batch(gpu.engine, [(PROMPTS[0], biased), (PROMPTS[1], seeded)])
    (a2, b2, g), ahead = _batch(gpu.engine, [(PROMPTS[0], biased), (PROMPTS[1], seeded), (PROMPTS[2], guided)])
    assert (a2.generated_tokens, b2.generated_tokens) == (a.generated_tokens, b.generated_tokens)
    assert g.generated_tokens == want[2].generated_tokens and _follows(g.generated_text)
    assert not any(ahead[: len(g.generated_tokens) - 1])
    # Guided rows that want only their tokens (greedy, and sampled: the device sampler) run ahead,
    # with the tokens of an engine that never does.
    rows = [(PROMPTS[0], seeded), (PROMPTS[1], bare), (PROMPTS[2], sampled), (PROMPTS[0], sampled)]
    never = LLM(block_size_tokens=16, num_blocks=256, device="cuda", enable_cuda_graphs=True, dtype="float32",
                async_scheduling=False)
    plain_rows, never_ahead = _batch(never.engine, rows)
    ahead_rows, ahead = _batch(gpu.engine, rows)
    assert not any(never_ahead)
    assert [r.generated_tokens for r in ahead_rows] == [r.generated_tokens for r in plain_rows]
    assert all(r.status == "stopped" and _follows(r.generated_text) for r in ahead_rows[1:])
    running = min(len(r.generated_tokens) for r in ahead_rows[1:])
    assert sum(ahead[: running - 1]) >= running - 3, ahead


def test_matchers_consume_a_steps_tokens_alike_together_or_one_by_one(llm):
    """`consume_tokens` (apply_results): llguidance's executor (GPU engines) leaves every matcher where
    consuming one by one does, a refused token included (the matcher is then in error)."""
    from splitserve.engine.guided import StepMasks, consume_tokens

    engine = llm.engine
    params = SamplingParams(json_schema=json.dumps(SCHEMA))
    ids = engine.tokenizer.encode(json.dumps({"name": "ab", "age": 7, "tags": ["a"], "ok": True}), add_bos=False)
    bad = engine.tokenizer.encode("zzz", add_bos=False)[0]
    cuts = (0, 2, 5, len(ids) // 2, len(ids) - 2)
    states = []
    for parallel in (False, True):
        matchers = [engine.guides.matcher(params, ids[:n]) for n in cuts] + [engine.guides.matcher(params, [])]
        consume_tokens([(m, ids[n]) for m, n in zip(matchers, cuts, strict=False)] + [(matchers[-1], bad)], parallel)
        assert matchers[-1].is_error() and not any(m.is_error() for m in matchers[:-1])
        states.append(StepMasks(dict(enumerate(matchers)), engine.model_config.vocab_size).rows(torch.device("cpu")))
    serial, together = states
    assert all(torch.equal(serial[i], together[i]) for i in serial)
    assert not torch.equal(serial[0], serial[1])
