"""`text_offset` of echoed log-probs: each entry's offset points at its token's text in the
returned text (echoed prompt + output); special tokens (the BOS a tokenizer adds, an EOS), which
the decoded text leaves out, take no characters."""

from splitserve.client import StreamChunk
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.choice_output import ChoiceOutput, TokenTexts
from splitserve.gateway.responses import echoed_logprobs
from tests.fixtures.models import build_tokenizer


def test_echoed_offsets_point_at_each_tokens_text(tmp_path):
    build_tokenizer(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    prompt = tokenizer.encode("the quick brown fox")
    assert prompt[0] == tokenizer.bos_token_id  # the tokenizer adds a BOS the echoed text leaves out
    generated = tokenizer.encode(" jumps over", add_bos=False) + [tokenizer.eos_token_id]
    output = ChoiceOutput(tokenizer, TokenTexts(tokenizer), prompt, (), True)
    n = len(prompt) - 1
    delta = output.add(StreamChunk("r", tuple(generated), logprobs=(-0.5,) * len(generated),
                                   prompt_log_probs=(-1.0,) * n, prompt_top_logprobs=({},) * n))
    echo = tokenizer.decode(prompt)
    text = echo + delta.text
    assert text == "the quick brown fox jumps over"
    lp = echoed_logprobs(delta.prompt_logprobs, delta.logprobs, len(echo))
    assert len(lp["text_offset"]) == len(prompt) + len(generated)
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    for token_id, token, offset in zip(prompt + generated, lp["tokens"], lp["text_offset"], strict=True):
        if token_id in special:
            assert token in ("<s>", "</s>") and offset in (0, len(text))
        else:
            assert text[offset : offset + len(token)] == token, (token, offset)
