"""Text in, text out: tokenization with BOS, incremental detokenization, stop words,
chat templates, and the async streaming API."""

import asyncio

import pytest

from splitserve import LLM, AsyncLLM, SamplingParams
from splitserve.engine.tokenizer import IncrementalDetokenizer, Tokenizer, _decode_stream

OPTIONS = dict(block_size_tokens=4, num_blocks=128, max_tokens=32)


@pytest.fixture(scope="module")
def llm(text_ckpt):
    return LLM(str(text_ckpt), **OPTIONS)


def test_incremental_detokenization_reassembles_the_text(text_ckpt):
    tok = Tokenizer(text_ckpt)
    text = "def hello(world): return world + 1 — ünïcode ✓"
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok, [])
    assert "".join(detok.add(i) for i in ids) == text
    assert tok.encode("the fox")[0] == tok.bos_token_id == 1
    assert tok.encode("the fox", add_bos=False)[0] != 1


def test_streamed_detokenizer_gives_the_windowed_decoders_deltas_token_by_token(text_ckpt):
    """`tokenizers`' DecodeStream (used where available) against the windowed two-decode
    algorithm it replaced, delta by delta: random ids (special tokens and split UTF-8 pieces
    among them), after a prompt and after none."""
    import random

    tok = Tokenizer(text_ckpt)
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(3000)] + tok.encode("ünïcode ✓ — déjà", add_bos=False)
    for prompt in ([], ids[:9]):
        streamed = IncrementalDetokenizer(tok, prompt)
        windowed = IncrementalDetokenizer(tok, prompt)
        windowed._stream = None
        windowed.add = windowed._add_windowed
        assert streamed._stream is not None or _decode_stream(tok, []) is None  # used wherever it exists
        assert [streamed.add(i) for i in ids] == [windowed.add(i) for i in ids]


def test_text_prompts_and_streamed_deltas(llm):
    params = SamplingParams(num_tokens_to_generate=12, temperature=0.0, ignore_eos=True)
    [r] = llm.generate("the quick brown", params)
    assert r.generated_text == llm.tokenizer.decode(r.generated_tokens)
    assert r.prompt_length == len(llm.tokenizer.encode("the quick brown"))

    async def stream():
        allm = AsyncLLM(llm.engine.config.model, **OPTIONS)
        parts, last = [], None
        async for partial in allm.stream("the quick brown", params):
            parts.append(partial)
            last = partial
        await allm.close()
        return parts, last

    parts, last = asyncio.run(stream())
    assert [len(p.generated_tokens) for p in parts] == list(range(1, 13))
    assert last.is_finished and not any(p.is_finished for p in parts[:-1])
    assert last.generated_tokens == r.generated_tokens and last.generated_text == r.generated_text


def test_stop_words_cut_the_text(llm):
    base = SamplingParams(num_tokens_to_generate=24, temperature=0.0, ignore_eos=True)
    [free] = llm.generate("def hello", base)
    text = free.generated_text
    word = text[len(text) // 2 : len(text) // 2 + 2]
    assert word.strip(), f"need a visible stop word from {text!r}"
    at = text.index(word)
    [cut] = llm.generate("def hello", SamplingParams(num_tokens_to_generate=24, temperature=0.0, stop_words=[word]))
    assert cut.generated_text == text[:at] and cut.status == "stopped"
    kept = SamplingParams(num_tokens_to_generate=24, temperature=0.0, stop_words=[word], detokenize_stop_sequence=True)
    [with_word] = llm.generate("def hello", kept)
    assert with_word.generated_text == text[: at + len(word)]
    llm.engine.check_integrity()


def test_a_stop_word_straddling_a_resumed_streams_break_is_still_found(llm):
    """A stream resumed on another worker (prompt + the tokens sent, `output_offset` = their count)
    stops where the unbroken stream stopped, also when the stop word began before the break."""
    base = dict(temperature=0.0, ignore_eos=True)
    prompt = llm.tokenizer.encode("def hello")
    [free] = llm.generate([prompt], SamplingParams(num_tokens_to_generate=24, **base))
    tokens = free.generated_tokens
    detok = IncrementalDetokenizer(llm.tokenizer, prompt)
    deltas = [detok.add(t) for t in tokens]
    text = "".join(deltas)
    # a break after token k; the stop word = the last characters before it + the first after it
    k, word = next(
        (k, deltas[k - 1][-2:] + deltas[k][:2])
        for k in range(2, len(tokens))
        if deltas[k - 1].strip() and deltas[k].strip()
        and text.find(deltas[k - 1][-2:] + deltas[k][:2]) == len("".join(deltas[:k])) - len(deltas[k - 1][-2:])
    )
    stop = dict(stop_words=[word], **base)
    [unbroken] = llm.generate([prompt], SamplingParams(num_tokens_to_generate=24, **stop))
    assert unbroken.generated_tokens == tokens[: k + 1] and unbroken.status == "stopped"
    rest = SamplingParams(num_tokens_to_generate=24 - k, output_offset=k, **stop)
    [resumed] = llm.generate([prompt + tokens[:k]], rest)
    assert resumed.generated_tokens == [tokens[k]] and resumed.status == "stopped"
    assert resumed.generated_text == ""  # the word began in the text already sent
    [unprimed] = llm.generate([prompt + tokens[:k]], SamplingParams(num_tokens_to_generate=24 - k, **stop))
    assert len(unprimed.generated_tokens) > 1  # without output_offset the break hides the word
    llm.engine.check_integrity()


def test_async_generate_returns_batch_in_order(text_ckpt):
    async def run():
        allm = AsyncLLM(str(text_ckpt), **OPTIONS)
        results = await allm.generate(["the", "def hello(world)", [1, 5, 6]], SamplingParams(num_tokens_to_generate=5, temperature=0.0))
        with pytest.raises(ValueError, match="prompt is empty"):
            await allm.generate(["fine", ""], SamplingParams(num_tokens_to_generate=5))
        await allm.close()
        return allm, results

    allm, results = asyncio.run(run())
    sync = LLM(str(text_ckpt), **OPTIONS).generate(["the", "def hello(world)", [1, 5, 6]], SamplingParams(num_tokens_to_generate=5, temperature=0.0))
    assert [r.generated_tokens for r in results] == [r.generated_tokens for r in sync]
    assert not allm.engine.has_unfinished()
    allm.engine.check_integrity()


def test_abandoned_stream_frees_its_blocks(text_ckpt):
    async def run():
        allm = AsyncLLM(str(text_ckpt), **OPTIONS)
        params = SamplingParams(num_tokens_to_generate=50, temperature=0.0, ignore_eos=True)
        agen = allm.stream("the quick brown fox", params)
        async for partial in agen:
            if len(partial.generated_tokens) == 3:
                break
        await agen.aclose()
        await asyncio.sleep(0.05)
        await allm.close()
        return allm

    allm = asyncio.run(run())
    assert not allm.engine.has_unfinished()
    assert allm.engine.pool.stats().num_in_use == 0
    allm.engine.check_integrity()


def test_chat_template_renders(text_ckpt):
    tok = Tokenizer(text_ckpt)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|user|>hi</s><|assistant|>"
    assert tok.compiled_chat_template() is tok.compiled_chat_template()  # compiled once, not per request
    tok.chat_template = "[{{ messages[0]['content'] }}]"  # replaced: compiled again
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "[hi]"


def test_request_text_appends_in_pieces_and_reads_whole():
    """`Request.append_text` keeps pieces (a token's text is not a copy of all before it);
    `generated_text`, `text_length` and `text_tail` read them as one string."""
    from splitserve.engine.request import Request

    req = Request("r", [1, 2], SamplingParams(), (0,), 500)
    words = [f"w{i}·" for i in range(150)] + ["", "é"]  # past the compaction of pieces
    for i, w in enumerate(words):
        req.append_text(w)
        whole = "".join(words[: i + 1])
        assert req.text_length == len(whole)
        for n in (0, 1, 3, 7, 40, len(whole) + 5):
            assert req.text_tail(n) == whole[len(whole) - min(n, len(whole)):]
    assert req.generated_text == "".join(words)
    req.generated_text = "cut"
    req.append_text("!")
    assert (req.generated_text, req.text_length, req.text_tail(2)) == ("cut!", 4, "t!")
