"""Served layer-wise streaming, engine side: a prefill engine marks each layer on its board as
its forward pass writes it (`LayerPublisher`) and publishes a preview first; a decode engine
prefetches from that preview on a background thread (engine/prefetch.py), and the import of the
full descriptor uses the prefetched blocks — same tokens as aggregated serving, nothing leaked
on abort, expiry or a preview that does not match its handoff."""

import dataclasses
import threading
import time

import pytest

from splitserve import LLM, SamplingParams
from splitserve.decode_worker.hooks import decode_hooks
from splitserve.engine import handoff
from splitserve.engine.handoff import (
    ChecksumMismatchError,
    RankEndpoint,
    build_descriptor,
    build_preview,
    group_block_checksums,
)
from splitserve.engine.handoff_layerwise import LayerPublisher, close_released, publish_layers
from splitserve.engine.serving import Command
from splitserve.engine.transfer.inproc import InProcTransport

OPTIONS = dict(block_size_tokens=4, num_blocks=64, max_tokens=64)
PARAMS = SamplingParams(num_tokens_to_generate=6, temperature=0.0, ignore_eos=True)
PROMPT = list(range(10, 31))  # 21 tokens: 6 blocks


class Prefill:
    """A prefill engine whose forward pass publishes a preview, then one layer at a time."""

    def __init__(self, ckpt, layer_delay_s: float = 0.0, **options):
        self.engine = LLM(str(ckpt), role="prefill", layerwise=True, **(OPTIONS | options)).engine
        self.transport = InProcTransport()
        self.endpoints = {0: RankEndpoint(0, "local", self.transport.expose(self.engine.kv_caches))}
        self.previews = []
        self.on_preview = None
        self.on_layer = None
        self.layers_marked = []
        publisher = LayerPublisher(self.engine, lambda: self.transport.board, self._started)
        delay = layer_delay_s

        class Slow:  # the same listener, with time between layers for a reader to get in
            def forward_started(_, out):
                marks = publisher.forward_started(out)
                if marks is None:
                    return None

                def layer_written(i):
                    marks(i)
                    self.layers_marked.append((i, time.monotonic()))
                    time.sleep(delay)
                    if self.on_layer is not None:
                        self.on_layer(i)

                return layer_written

        self.engine.runner.layer_listener = Slow()

    def _started(self, request_id, slot, block_ids, num_tokens):
        preview = build_preview(self.engine, request_id, slot, block_ids, num_tokens, self.endpoints, "inproc")
        self.previews.append(preview)
        if self.on_preview is not None:
            self.on_preview(preview)

    def run(self, rid, prompt):
        self.engine.add_request(rid, prompt, PARAMS)
        while self.engine.has_unfinished():
            self.engine.step()
        h = self.engine.handoffs[rid]
        slot = publish_layers(self.engine, self.transport.board, h)
        checksums = group_block_checksums(self.engine, h.block_ids)
        return build_descriptor(self.engine, h, self.endpoints, "inproc", checksums, progress_slot=slot)


class Decode:
    def __init__(self, ckpt):
        self.engine = LLM(str(ckpt), role="decode", layerwise=True, **OPTIONS).engine
        self.hooks = decode_hooks(self.engine, InProcTransport(), None)
        self.handlers = self.hooks["handlers"]
        self.verified_at_import = []  # block checksums computed on the engine thread at import
        self.importing = False
        real = handoff.partial_block_checksums

        def spy(*args, **kwargs):
            if self.importing and threading.current_thread() is threading.main_thread():
                self.verified_at_import.append(args[3])
            return real(*args, **kwargs)

        handoff.partial_block_checksums = spy  # the importer's name for it (restored by the fixture)

    def prefetch(self, preview, prompt=PROMPT):
        self.handlers["prefetch"](self.engine, Command("prefetch", preview.request_id, (prompt, preview)))

    def import_(self, desc, prompt=PROMPT):
        self.importing = True
        try:
            return self.handlers["import"](self.engine, Command("import", desc.request_id, (prompt, PARAMS, desc, 30.0, "")))
        finally:
            self.importing = False

    def finish(self):
        final = None
        while self.engine.has_unfinished():
            for out in self.engine.step():
                final = out.result
        return final.generated_tokens


@pytest.fixture(autouse=True)
def _restore_checksums():
    real = handoff.partial_block_checksums
    yield
    handoff.partial_block_checksums = real


@pytest.fixture(scope="module")
def expected(llama_ckpt):
    return LLM(str(llama_ckpt), **OPTIONS).generate([PROMPT], PARAMS)[0].generated_tokens


def test_prefetch_pulls_layers_while_the_forward_pass_runs(llama_ckpt, expected):
    prefill, decode = Prefill(llama_ckpt, layer_delay_s=0.05), Decode(llama_ckpt)
    pulls = []
    real_pull = InProcTransport.pull

    def spy(self, plan, *args, **kwargs):
        pulls.append(([op.layer_start for op in plan.ops], time.monotonic()))
        return real_pull(self, plan, *args, **kwargs)

    InProcTransport.pull = spy
    try:
        prefill.on_preview = decode.prefetch  # as the router does, as soon as the preview exists
        desc = prefill.run("r", PROMPT)
        forward_end = prefill.layers_marked[-1][1]
        outcome = decode.import_(desc)
    finally:
        InProcTransport.pull = real_pull
    assert len(prefill.previews) == 1 and prefill.previews[0].is_preview
    assert decode.verified_at_import == []  # the thread summed the checksums as layers arrived
    assert outcome.prefetched and outcome.stats.num_bytes == 6 * 4 * 2 * 2 * 4 * 16 * 4  # 6 blocks, 4 layers fp32
    early = [layers for layers, at in pulls if at < forward_end]
    assert early and len(pulls) >= 2, pulls  # layers arrived one batch at a time, during the forward pass
    assert decode.finish() == expected
    assert prefill.engine.release_handoff("r")
    close_released(prefill.engine, prefill.transport.board)
    assert prefill.transport.board.open_requests() == []
    prefill.engine.check_integrity()
    decode.engine.check_integrity()
    assert decode.engine.reserved == {}


def test_abort_and_expiry_give_the_reserved_blocks_back(llama_ckpt):
    prefill, decode = Prefill(llama_ckpt), Decode(llama_ckpt)
    free = decode.engine.pool.num_available
    prefill.engine.add_request("a", PROMPT, PARAMS)
    block_ids = tuple(range(6))
    preview = build_preview(prefill.engine, "a", prefill.transport.board.open("a"), block_ids, len(PROMPT),
                            prefill.endpoints, "inproc")  # a slot nobody marks: the prefetch waits
    decode.prefetch(preview)
    assert decode.engine.pool.num_available == free - 6 and "a" in decode.engine.reserved
    decode.engine.check_integrity()  # reserved blocks are owned
    assert decode.handlers["abort"](decode.engine, Command("abort", "a"))
    assert decode.engine.pool.num_available == free and decode.engine.reserved == {}

    short = build_preview(prefill.engine, "b", prefill.transport.board.open("b"), block_ids, len(PROMPT),
                          prefill.endpoints, "inproc")
    short = dataclasses.replace(short, lease_deadline_unix_ms=int((time.time() + 0.3) * 1000))
    decode.prefetch(short)
    assert decode.hooks["housekeeping"]() == []
    time.sleep(0.4)
    (drop,) = decode.hooks["housekeeping"]()
    assert drop.kind == "drop_prefetch" and drop.request_id == "b"
    decode.handlers["drop_prefetch"](decode.engine, drop)
    assert decode.engine.pool.num_available == free and decode.engine.reserved == {}
    decode.engine.check_integrity()
    assert all(t.name not in ("prefetch-a", "prefetch-b") for t in threading.enumerate())


def test_a_preview_that_does_not_match_its_handoff_is_dropped_and_pulled_afresh(llama_ckpt, expected):
    prefill, decode = Prefill(llama_ckpt), Decode(llama_ckpt)
    desc = prefill.run("r", PROMPT)
    stale = dataclasses.replace(desc, block_checksums=(), first_token_id=0,
                                rank_block_ids={0: tuple(b + 1 for b in desc.rank_block_ids[0])})
    decode.prefetch(stale)
    outcome = decode.import_(desc)
    assert not outcome.prefetched and decode.engine.reserved == {}
    assert decode.finish() == expected
    decode.engine.check_integrity()


def test_a_failed_prefetch_falls_back_to_a_pull_from_the_pinned_copy(llama_ckpt, expected):
    prefill, decode = Prefill(llama_ckpt), Decode(llama_ckpt)
    desc = prefill.run("r", PROMPT)
    wrong_slot = dataclasses.replace(desc, block_checksums=(), first_token_id=0, progress_slot=desc.progress_slot + 1,
                                     lease_deadline_unix_ms=int((time.time() + 0.2) * 1000))  # times out fast
    decode.prefetch(wrong_slot)
    with pytest.raises(ValueError, match="preview"):  # a preview is never imported
        decode.import_(wrong_slot)
    decode.handlers["drop_prefetch"](decode.engine, Command("drop_prefetch", "r"))
    decode.prefetch(dataclasses.replace(wrong_slot, lease_deadline_unix_ms=int((time.time() + 0.2) * 1000)))
    outcome = decode.import_(desc)  # the prefetch timed out waiting: pulled again, verified, same tokens
    assert outcome.prefetched and outcome.stats.num_bytes > 0
    assert decode.finish() == expected
    decode.engine.check_integrity()
    assert decode.engine.reserved == {}


def test_a_late_preview_is_refused_once_the_request_runs(llama_ckpt):
    prefill, decode = Prefill(llama_ckpt), Decode(llama_ckpt)
    desc = prefill.run("r", PROMPT)
    decode.import_(desc)
    preview = prefill.previews[0]
    with pytest.raises(ValueError, match="already running"):
        decode.prefetch(preview)
    assert decode.engine.reserved == {}


def test_a_byte_corrupted_before_the_prefetch_pulled_it_is_caught(llama_ckpt):
    prefill, decode = Prefill(llama_ckpt), Decode(llama_ckpt)
    desc = prefill.run("r", PROMPT)  # checksums taken; every layer marked ready
    block = desc.rank_block_ids[0][2]
    prefill.engine.kv_caches[1][1, block, 0, 0, 0] += 1.0  # V of layer 1, after the checksums
    decode.prefetch(prefill.previews[0])
    free = decode.engine.pool.num_available + 6
    with pytest.raises(ChecksumMismatchError, match=r"pulled blocks \[2\]"):
        decode.import_(desc)
    assert decode.verified_at_import == []  # caught by the share the prefetch summed
    assert decode.engine.reserved == {} and decode.engine.pool.num_available == free
    decode.engine.check_integrity()


def test_a_prefill_longer_than_the_lease_keeps_its_prefetch_while_layers_arrive(llama_ckpt, expected):
    """The lease bounds a prefetch's time *without progress*: a slow prefill (here 4 layers x 0.3 s
    against a 0.4 s lease) keeps it as long as layers come, and the import still uses it."""
    prefill, decode = Prefill(llama_ckpt, layer_delay_s=0.3, handoff_lease_s=0.4), Decode(llama_ckpt)
    expirations = []
    prefill.on_preview = decode.prefetch
    prefill.on_layer = lambda i: expirations.extend(decode.hooks["housekeeping"]())
    desc = prefill.run("r", PROMPT)
    assert prefill.layers_marked[-1][1] - prefill.layers_marked[0][1] > 0.4  # longer than the lease
    assert expirations == []
    outcome = decode.import_(desc)
    assert outcome.prefetched and decode.verified_at_import == []
    assert decode.finish() == expected
    decode.engine.check_integrity()


def test_a_prefetch_stuck_in_a_pull_keeps_its_blocks_until_it_returns(llama_ckpt, monkeypatch):
    """An import whose prefetch thread hangs inside one pull fails, and the blocks that thread may
    still write are not handed out again until it returns (then they go back, nothing leaked)."""
    from splitserve.engine import prefetch as prefetch_module
    from splitserve.engine.transfer.transport import TransferError

    prefill, decode = Prefill(llama_ckpt), Decode(llama_ckpt)
    desc = prefill.run("s", PROMPT)
    release, entered = threading.Event(), threading.Event()
    real_pull = InProcTransport.pull

    def hanging_pull(self, *args, **kwargs):
        if threading.current_thread().name.startswith("prefetch-"):
            entered.set()
            release.wait(30)
        return real_pull(self, *args, **kwargs)

    monkeypatch.setattr(InProcTransport, "pull", hanging_pull)
    monkeypatch.setattr(prefetch_module, "JOIN_TIMEOUT_S", 0.2)
    free = decode.engine.pool.num_available
    decode.prefetch(dataclasses.replace(desc, block_checksums=(), first_token_id=0))
    assert entered.wait(10)
    held = list(decode.engine.reserved["s"][0])
    with pytest.raises(TransferError, match="still pulling"):
        decode.handlers["import"](decode.engine, Command("import", "s", (PROMPT, PARAMS, desc, 0.3, "")))
    assert not decode.engine.has_request("s")
    (tombstone,) = decode.engine.reserved  # the stuck thread's blocks, counted by the integrity check
    assert decode.engine.reserved[tombstone][0] == held and decode.engine.pool.num_available == free - len(held)
    assert all(decode.engine.pool.ref_count(b) == 1 for b in held)
    decode.engine.check_integrity()
    release.set()
    deadline = time.monotonic() + 10
    while decode.engine.reserved and time.monotonic() < deadline:
        decode.hooks["after_step"](decode.engine, [])  # collect, as after every engine step
        time.sleep(0.05)
    assert decode.engine.reserved == {} and decode.engine.pool.num_available == free
    decode.engine.check_integrity()


def test_recent_aborts_are_remembered_up_to_a_limit_oldest_forgotten_first():
    from splitserve.decode_worker.hooks import RecentIds

    ids = RecentIds(3)
    for rid in ("a", "b", "c", "a", "d"):  # "a" again: now the newest
        ids.add(rid)
    assert "a" in ids and "c" in ids and "d" in ids and "b" not in ids
