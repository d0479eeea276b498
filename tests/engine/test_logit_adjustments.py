"""Logit bias and presence / frequency penalties (OpenAI's definitions): the engine's tokens equal a
greedy loop over the Hugging Face model that applies them by hand, in a batch beside a plain request
(which keeps its shared argmax), and a resumed request (`output_offset`) counts its earlier output."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.wire import sampling_from_proto, sampling_to_proto
from tests.fixtures.models import build_hf_checkpoint

PROMPT = [7, 99, 23, 311, 23, 5, 141, 77]
NEW = 20
ADJUSTED = dict(presence_penalty=0.7, frequency_penalty=1.3, logit_bias={23: 2.5, 300: -1.0})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("adjust")
    return path, build_hf_checkpoint(path, "llama")


@pytest.fixture(scope="module")
def model(checkpoint):
    path, hf = checkpoint
    return LLM(str(path), block_size_tokens=8, num_blocks=64), hf


def reference(hf, prompt, new, presence=0.0, frequency=0.0, bias=(), earlier=()):
    """Greedy over HF logits: logit[j] - frequency * count[j] - presence * (count[j] > 0) + bias[j],
    counts over the output so far (`earlier` = generated before the prompt's end)."""
    ids, out, generated = list(prompt), list(earlier), []
    for _ in range(new):
        token = int(adjusted_logits(hf, ids, out, presence, frequency, bias).argmax())
        ids.append(token), out.append(token), generated.append(token)
    return generated


def adjusted_logits(hf, ids, out, presence, frequency, bias) -> torch.Tensor:
    """HF's next-token logits after `ids`, adjusted by hand for the output `out` so far."""
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].float()
    counts = torch.zeros_like(logits)
    for t in out:
        counts[t] += 1
    logits = logits - frequency * counts - presence * (counts > 0).float()
    for t, b in bias:
        logits[t] += b
    return logits


def params(**extra):
    return SamplingParams(num_tokens_to_generate=NEW, temperature=0.0, ignore_eos=True, **extra)


def run_batch(llm, rows) -> tuple[dict, list[bool]]:
    """Each of `rows` (params) on PROMPT as one engine batch: tokens per row, and per step
    whether the engine left a step in flight (ran ahead)."""
    results, ahead = _results(llm, rows)
    return {i: list(r.generated_tokens) for i, r in enumerate(results)}, ahead


def sampled(**extra):
    return SamplingParams(**{"num_tokens_to_generate": NEW, "temperature": 0.9, "seed": 11, "ignore_eos": True, **extra})


@pytest.mark.parametrize("ahead", [False, True], ids=["in_step", "run_ahead"])
def test_greedy_with_penalties_and_bias_equals_the_hand_loop_beside_a_plain_request(checkpoint, ahead):
    """run_ahead: steps kept in flight (the CUDA default), the adjusted rows adjusted in the step's
    logits at launch with their previous token still on the device — and the batch keeps running
    ahead with them."""
    path, hf = checkpoint
    adjusted = params(**ADJUSTED)
    plain_ref = reference(hf, PROMPT, NEW)
    adjusted_ref = reference(hf, PROMPT, NEW, 0.7, 1.3, adjusted.logit_bias)
    assert adjusted_ref != plain_ref  # the adjustments change this output
    llm = LLM(str(path), block_size_tokens=8, num_blocks=64, async_scheduling=ahead)
    done, ran_ahead = run_batch(llm, [params(), adjusted])
    assert done == {0: plain_ref, 1: adjusted_ref}
    assert sum(ran_ahead) >= (NEW - 4 if ahead else 0) and (ahead or not any(ran_ahead))


def test_sampled_and_log_prob_rows_with_adjustments_draw_alike_run_ahead_or_not(checkpoint):
    """Seeded draws from adjusted rows (and an adjusted row that wants log-probs: sampled from a
    copy on the host, which keeps the batch from running ahead only while it runs) are the
    same whether steps run ahead or not; the greedy adjusted row still equals the hand loop."""
    path, hf = checkpoint
    rows = [sampled(), sampled(**ADJUSTED), params(**ADJUSTED), sampled(presence_penalty=-1.0, top_k=20, seed=5)]
    runs = {}
    for ahead in (False, True):
        llm = LLM(str(path), block_size_tokens=8, num_blocks=64, async_scheduling=ahead)
        runs[ahead] = run_batch(llm, rows)
        assert llm.engine.runner.logit_slots.num_held == 0  # freed with their finished requests, no gc needed
    assert runs[True][0] == runs[False][0] and sum(runs[True][1]) >= NEW - 4
    assert runs[True][0][2] == reference(hf, PROMPT, NEW, 0.7, 1.3, params(**ADJUSTED).logit_bias)
    assert runs[True][0][1] != runs[True][0][0]  # the adjustments change the draws
    with_log_probs = rows + [params(return_log_probs=True, **ADJUSTED)]
    done, ahead = run_batch(LLM(str(path), block_size_tokens=8, num_blocks=64, async_scheduling=True), with_log_probs)
    assert done[4] == done[2] and sum(ahead) >= NEW - 4  # its raw log-probs taken at launch (next test)


def _results(llm, rows) -> tuple[list, list[bool]]:
    """Each of `rows` on PROMPT as one engine batch: final results, and per step whether a
    step was left in flight."""
    engine, done, ahead = llm.engine, {}, []
    for i, p in enumerate(rows):
        engine.add_request(f"r{i}", PROMPT, p)
    while engine.has_unfinished():
        for out in engine.step():
            if out.result is not None and out.result.is_finished:
                done[int(out.request_id[1:])] = out.result
        ahead.append(engine._inflight is not None)
    assert engine.pool.num_available == engine.pool.num_blocks
    return [done[i] for i in range(len(rows))], ahead


@pytest.mark.parametrize("ahead", [False, True], ids=["in_step", "run_ahead"])
def test_adjusted_rows_that_want_log_probs_get_the_raw_log_probs_and_run_ahead(checkpoint, ahead):
    """`raw_logprobs`: a decode step takes an adjusted row's log-softmax before adjusting it in
    place for its token (engine/step_logprobs.py), so the batch runs ahead; the log-probs are
    the model's own (HF's, teacher-forced on our tokens), the tokens those of the adjusted logits."""
    path, hf = checkpoint
    rows = [params(return_log_probs=True, top_n_logprobs=2, **ADJUSTED), sampled(return_log_probs=True, **ADJUSTED),
            params(), sampled(**ADJUSTED)]
    llm = LLM(str(path), block_size_tokens=8, num_blocks=64, async_scheduling=ahead)
    (greedy, drawn, _, drawn_plain), ran_ahead = _results(llm, rows)
    assert list(greedy.generated_tokens) == reference(hf, PROMPT, NEW, 0.7, 1.3, rows[0].logit_bias)
    assert drawn.generated_tokens == drawn_plain.generated_tokens  # wanting log-probs changes no draw
    for res in (greedy, drawn):
        with torch.no_grad():
            logits = hf(torch.tensor([PROMPT + list(res.generated_tokens)])).logits[0, len(PROMPT) - 1 : -1].float()
        raw = torch.log_softmax(logits, dim=-1)
        want = raw.gather(1, torch.tensor(res.generated_tokens)[:, None]).squeeze(1)
        assert torch.allclose(torch.tensor(res.generated_log_probs), want, atol=1e-4, rtol=0)
    for step, top in enumerate(greedy.top_n_logprobs):  # the top 2 of the raw distribution
        values, ids = torch.log_softmax(hf(torch.tensor([PROMPT + list(greedy.generated_tokens[:step])])).logits[0, -1]
                                        .float(), dim=-1).topk(2)
        assert list(top) == ids.tolist() and torch.allclose(torch.tensor(list(top.values())), values, atol=1e-4)
    assert sum(ran_ahead) >= (NEW - 4 if ahead else 0) and (ahead or not any(ran_ahead))


def test_adjusted_rows_with_processed_log_probs_keep_the_host_sampler(checkpoint):
    """`processed_logprobs`: an adjusted row's log-probs are those of its adjusted logits, taken on
    the host at collect — such a step is not run ahead."""
    path, hf = checkpoint
    llm = LLM(str(path), block_size_tokens=8, num_blocks=64, async_scheduling=True, logprobs_mode="processed_logprobs")
    (res,), ran_ahead = _results(llm, [params(return_log_probs=True, **ADJUSTED)])
    assert list(res.generated_tokens) == reference(hf, PROMPT, NEW, 0.7, 1.3, ADJUSTED["logit_bias"].items())
    assert not any(ran_ahead)
    tokens = list(res.generated_tokens)
    want = [torch.log_softmax(adjusted_logits(hf, PROMPT + tokens[:i], tokens[:i], 0.7, 1.3,
                                              ADJUSTED["logit_bias"].items()), dim=-1)[tokens[i]] for i in range(NEW)]
    assert torch.allclose(torch.tensor(res.generated_log_probs), torch.tensor(want), atol=1e-4, rtol=0)


def test_a_resumed_request_counts_the_output_it_carries_in_its_prompt(model):
    llm, hf = model
    whole = reference(hf, PROMPT, NEW, 0.7, 1.3, params(**ADJUSTED).logit_bias)
    first = llm.generate([PROMPT], SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True,
                                                  **ADJUSTED))[0].generated_tokens  # fmt: skip
    assert list(first) == whole[:6]
    rest = llm.generate([PROMPT + list(first)], SamplingParams(num_tokens_to_generate=NEW - 6, temperature=0.0,
                                                               ignore_eos=True, output_offset=6, **ADJUSTED))  # fmt: skip
    assert list(rest[0].generated_tokens) == whole[6:]


def test_a_sampled_request_obeys_its_bias():
    """+100 leaves one token possible, -100 on the greedy choice forbids it."""
    llm = LLM(block_size_tokens=8, num_blocks=64)  # the embedded default model
    forced = llm.generate(["def f(x):"], SamplingParams(num_tokens_to_generate=8, temperature=1.0, seed=3,
                                                        logit_bias={17: 100.0}, ignore_eos=True))  # fmt: skip
    assert list(forced[0].generated_tokens) == [17] * 8
    greedy = llm.generate(["def f(x):"], SamplingParams(num_tokens_to_generate=1, temperature=0.0))[0].generated_tokens[0]
    banned = llm.generate(["def f(x):"], SamplingParams(num_tokens_to_generate=8, temperature=0.0, ignore_eos=True,
                                                        logit_bias={greedy: -100.0}))  # fmt: skip
    assert greedy not in banned[0].generated_tokens


@pytest.mark.parametrize(("options", "message"), [
    ({"logit_bias": {"5": 1.0}}, "logit_bias keys must be token ids"),
    ({"logit_bias": {5: 101}}, r"logit_bias values must be numbers in \[-100, 100\]"),
    ({"logit_bias": [(5,)]}, "pairs"),
    ({"presence_penalty": 2.5}, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": "1"}, "frequency_penalty"),
])  # fmt: skip
def test_bad_adjustments_are_refused_naming_the_value(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**options)


def test_a_bias_outside_the_vocabulary_is_refused_and_the_wire_keeps_the_numbers(model):
    llm, _ = model
    with pytest.raises(ValueError, match="logit_bias token id 512 is outside the vocabulary"):
        llm.generate([PROMPT], SamplingParams(logit_bias={512: 1.0}))
    sent = SamplingParams(num_tokens_to_generate=4, presence_penalty=0.1, frequency_penalty=-0.3,
                          logit_bias={9: 0.1, 2: -7.0})  # fmt: skip
    back = sampling_from_proto(sampling_to_proto(sent))
    assert (back.logit_bias, back.presence_penalty, back.frequency_penalty) == (((2, -7.0), (9, 0.1)), 0.1, -0.3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_a_gpu_with_graphs_and_run_ahead_the_tokens_equal_the_cpu_engine(checkpoint):
    """fp32: the CUDA engine (decode graphs, steps run ahead with the adjusted rows adjusted in the
    graph's logits, sampled ones drawn by the device sampler) gives each greedy row the CPU
    engine's tokens, and keeps running ahead."""
    path, _ = checkpoint
    rows = [params(), params(**ADJUSTED), sampled(**ADJUSTED), sampled()]
    gpu = LLM(str(path), device="cuda", enable_cuda_graphs=True, block_size_tokens=8, num_blocks=64)
    assert gpu.engine.async_scheduling
    cpu, _ = run_batch(LLM(str(path), block_size_tokens=8, num_blocks=64), rows)
    on_gpu, ahead = run_batch(gpu, rows)
    assert (on_gpu[0], on_gpu[1]) == (cpu[0], cpu[1]) and sum(ahead) >= NEW - 4
    assert len(on_gpu[2]) == NEW and on_gpu[2] != on_gpu[3]  # drawn from adjusted logits (another RNG than the CPU's)


class _Req:
    """What engine/logit_slots.py reads of a request."""

    def __init__(self, params, output):
        self.params, self.output = params, output

    def output_so_far(self):
        return list(self.output)


def test_slots_count_incrementally_recount_a_shorter_output_and_are_freed_with_their_request():
    import gc

    from splitserve.engine.logit_slots import LogitSlots

    vocab, p = 50, SamplingParams(frequency_penalty=1.0, logit_bias={4: 3.0})
    slots = LogitSlots(vocab, torch.device("cpu"))
    reqs = [_Req(p, [1, 1, 2]) for _ in range(6)]  # more than the first allocation's 4 slots
    logits = torch.zeros(6, vocab)
    slots.adjust(logits, [(i, r, -1, -1) for i, r in enumerate(reqs)], None)
    assert slots.num_held == 6 and logits[0, 1].item() == -2.0 and logits[5, 4].item() == 3.0
    reqs[0].output += [2, -1]  # one more id on the host, one still on the device (fed: 9)
    logits = torch.zeros(1, vocab)
    slots.adjust(logits, [(0, reqs[0], 0, -1)], torch.tensor([9]))
    assert (logits[0, 2].item(), logits[0, 9].item(), logits[0, 1].item()) == (-2.0, -1.0, -2.0)
    with pytest.raises(RuntimeError, match="not fed"):
        reqs[1].output += [-1]
        slots.adjust(torch.zeros(1, vocab), [(0, reqs[1], 0, -1)], None)
    logits = torch.zeros(1, vocab)
    slots.adjust(logits, [(0, reqs[1], 0, -1)], torch.tensor([1]))  # the refused step marked nothing counted
    assert logits[0, 1].item() == -3.0
    reqs[2].output = [7]  # shorter than what its slot counted: counted again from zero
    logits = torch.zeros(1, vocab)
    slots.adjust(logits, [(0, reqs[2], -1, -1)], None)
    assert logits[0].nonzero().flatten().tolist() == [4, 7] and logits[0, 7].item() == -1.0
    del reqs
    gc.collect()
    assert slots.num_held == 0 and sorted(slots._free) == list(range(8))
