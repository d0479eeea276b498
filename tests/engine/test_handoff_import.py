"""The decode-side import, in process: a corrupted byte is caught by the block
checksums (and the blocks are given back), and a prefix already cached on the
decode side is not transferred again (exact byte count)."""

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.handoff import (
    ChecksumMismatchError,
    build_descriptor,
    group_block_checksums,
    make_importer,
)
from splitserve.engine.transfer.inproc import InProcTransport

OPTIONS = dict(block_size_tokens=4, num_blocks=64, max_tokens=64)
PARAMS = SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True)


class CorruptingTransport(InProcTransport):
    """Flips one byte of the destination after a correct pull (a bad wire)."""

    def __init__(self, times: int):
        super().__init__()
        self.times = times

    def pull(self, plan, dst_rank, remote, kv_tensors, timeout_s=30.0):
        stats = super().pull(plan, dst_rank, remote, kv_tensors, timeout_s)
        if self.times:
            self.times -= 1
            op = plan.ops_for_dst(dst_rank)[0]
            block = op.dst_blocks()[0]
            kv_tensors[0].view(torch.uint8)[0, block, 0, 0, 0] ^= 0x10
        return stats


def _handoff(prefill, transport, rid, prompt):
    prefill.add_request(rid, prompt, PARAMS)
    while prefill.has_unfinished():
        prefill.step()
    h = prefill.handoffs[rid]
    meta = transport.expose(prefill.kv_caches)
    from splitserve.engine.handoff import RankEndpoint

    return build_descriptor(prefill, h, {0: RankEndpoint(0, "local", meta)}, "inproc", group_block_checksums(prefill, h.block_ids))


def _decode_all(engine):
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            final = out.result
    return final


def test_corrupted_byte_is_caught_and_nothing_is_kept(llama_ckpt):
    prefill = LLM(str(llama_ckpt), role="prefill", **OPTIONS).engine
    decode = LLM(str(llama_ckpt), role="decode", **OPTIONS).engine
    prompt = list(range(10, 27))
    transport = CorruptingTransport(times=1)
    desc = _handoff(prefill, transport, "r", prompt)
    with pytest.raises(ChecksumMismatchError, match="verifying failed: pulled blocks \\[0\\]"):
        decode.add_imported_request("r", prompt, PARAMS, desc.first_token_id, None, make_importer(decode, transport, desc))
    assert decode.pool.stats().num_in_use == 0 and not decode.has_unfinished()
    decode.check_integrity()
    # A retry from the pinned copy succeeds and continues like aggregated serving.
    decode.add_imported_request("r", prompt, PARAMS, desc.first_token_id, None, make_importer(decode, transport, desc))
    expected = LLM(str(llama_ckpt), **OPTIONS).generate([prompt], PARAMS)[0]
    assert _decode_all(decode).generated_tokens == expected.generated_tokens
    assert prefill.release_handoff("r")
    prefill.check_integrity()
    decode.check_integrity()


def test_decode_prefix_hit_moves_only_the_missing_blocks(llama_ckpt):
    prefill = LLM(str(llama_ckpt), role="prefill", **OPTIONS).engine
    decode = LLM(str(llama_ckpt), role="decode", **OPTIONS).engine
    transport = InProcTransport()
    first = list(range(10, 27))  # 17 tokens: 5 blocks, 4 full
    desc = _handoff(prefill, transport, "a", first)
    stats: list = []
    decode.add_imported_request("a", first, PARAMS, desc.first_token_id, None, make_importer(decode, transport, desc, stats_out=stats))
    _decode_all(decode)
    layers, heads, bs, hd = 4, 2, 4, 16  # the tiny test model (fp32)
    block_bytes = layers * 2 * heads * bs * hd * 4
    assert stats[0].num_bytes == 5 * block_bytes

    second = first[:12] + [99, 98, 97, 96, 95]  # shares 3 full blocks
    desc2 = _handoff(prefill, transport, "b", second)
    stats.clear()
    reused = decode.add_imported_request(
        "b", second, PARAMS, desc2.first_token_id, None, make_importer(decode, transport, desc2, stats_out=stats)
    )
    assert reused == 3
    assert stats[0].num_bytes == 2 * block_bytes  # blocks 3 and 4 only
    expected = LLM(str(llama_ckpt), **OPTIONS).generate([second], PARAMS)[0]
    assert _decode_all(decode).generated_tokens == expected.generated_tokens
    decode.check_integrity()
