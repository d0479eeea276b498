"""`EngineLoop` (engine/serving.py) outlives submitters that give up: a command whose future
was cancelled — its gRPC call cancelled or past its deadline, which cancels the future
`asyncio.wrap_future` made of it — still applies, and its outcome (result or error) is dropped
instead of killing the engine thread. A decode worker's loop died of exactly that
(`InvalidStateError` from `set_exception` on a cancelled future) when a client's deadline passed
while a failing import waited for its transfer."""

import asyncio
import threading

import grpc
import pytest

from splitserve import LLM
from splitserve.engine.serving import Command, EngineLoop, EngineStoppedError
from splitserve.engine.worker_server import unavailable_when_stopped


@pytest.fixture()
def engine(llama_ckpt):
    return LLM(str(llama_ckpt), device="cpu", block_size_tokens=4, num_blocks=32, max_tokens=16).engine


def _run(loop: EngineLoop) -> threading.Thread:
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()
    return thread


def _stop(loop: EngineLoop, thread: threading.Thread) -> None:
    loop.stop()
    thread.join(timeout=30)
    assert not thread.is_alive()


@pytest.mark.parametrize("outcome", ["error", "result"])
def test_a_command_cancelled_before_it_applies_still_applies_and_the_loop_goes_on(engine, outcome):
    applied = []

    def handler(engine, command):
        applied.append(command.request_id)
        if outcome == "error":
            raise RuntimeError("the import failed")
        return "ok"

    loop = EngineLoop(engine, handlers={"work": handler}, idle_tick_s=0.01)
    gone = loop.submit(Command("work", "gone"))
    assert gone.cancel()  # the caller gave up before the loop took the command
    thread = _run(loop)
    try:
        later = loop.submit(Command("work", "later"))
        if outcome == "result":
            assert later.result(timeout=30) == "ok"
        else:
            assert isinstance(later.exception(timeout=30), RuntimeError)
        assert loop.is_running
        assert applied == ["gone", "later"]  # applied on every rank alike, cancelled or not
    finally:
        _stop(loop, thread)


def test_a_cancel_while_the_command_runs_does_not_take_and_the_caller_sees_the_error(engine):
    started, cancel_tried = threading.Event(), threading.Event()

    def slow_failure(engine, command):
        started.set()
        assert cancel_tried.wait(timeout=30)
        raise RuntimeError("transferring failed")

    loop = EngineLoop(engine, handlers={"import": slow_failure}, idle_tick_s=0.01)
    thread = _run(loop)
    try:
        future = loop.submit(Command("import", "r0"))
        assert started.wait(timeout=30)
        assert not future.cancel()  # running: too late to cancel
        cancel_tried.set()
        with pytest.raises(RuntimeError, match="transferring failed"):
            future.result(timeout=30)
        assert loop.submit(Command("call", "r1")).exception(timeout=30) is not None  # unknown kind: an error, served
        assert loop.is_running
    finally:
        _stop(loop, thread)


def test_a_stopped_loop_answers_new_commands_with_an_error(engine):
    loop = EngineLoop(engine, idle_tick_s=0.01)
    thread = _run(loop)
    _stop(loop, thread)
    with pytest.raises(EngineStoppedError, match="stopped"):
        loop.submit(Command("abort", "r0")).result(timeout=5)

    class Servicer:  # as the workers' unary methods (Abort, GetBlockSet, CheckIntegrity) are
        @unavailable_when_stopped
        async def Abort(self, request, context):  # noqa: N802
            return await asyncio.wrap_future(loop.submit(Command("abort", request)))

    class Context:
        async def abort(self, code, details):
            raise grpc.aio.AbortError(code, details)

    with pytest.raises(grpc.aio.AbortError) as refused:  # UNAVAILABLE: the caller goes elsewhere
        asyncio.run(Servicer().Abort("r0", Context()))
    assert refused.value.args[0] == grpc.StatusCode.UNAVAILABLE and "going away" in refused.value.args[1]
