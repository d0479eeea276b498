"""`EngineLoop`: runs an engine for a server, on every rank of its TP × PP group.

Global rank 0 is the group's front: its gRPC handlers `submit` commands from any
thread. Each iteration, rank 0 broadcasts the pending commands; every rank
applies them in the same order and then steps, so schedulers never diverge:

    rank 0:  [cmds] ──broadcast──▶ apply ──▶ step ──▶ outputs ──▶ callbacks (rank 0 only)
    rank k:          ◀─broadcast── apply ──▶ step ──▶ (hooks run on every rank)

Decisions that depend on a clock (handoff lease expiry) are made on rank 0
and travel as commands. A command's result (or exception) resolves the
`Future` that `submit` returned, on rank 0.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.engine import fault_injection
from splitserve.engine.engine import Engine, StepOutput

log = logging.getLogger(__name__)


class EngineStoppedError(RuntimeError):
    """A command submitted to (or pending in) an engine loop that has stopped: the worker is
    going away (stopped, or its engine crashed). Services answer it with UNAVAILABLE."""


@dataclass(frozen=True)
class Command:
    """An engine mutation, applied identically on every rank."""

    kind: str  # "add" | "import" | "abort" | "release" | "call" | "stop"
    request_id: str = ""
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


ApplyHook = Callable[[Engine, Command], Any]


class EngineLoop:
    def __init__(
        self,
        engine: Engine,
        on_outputs: Callable[[list[StepOutput]], None] | None = None,
        after_step: Callable[[Engine, list[StepOutput]], None] | None = None,
        handlers: dict[str, ApplyHook] | None = None,
        idle_tick_s: float = 0.1,
        housekeeping: Callable[[], list[Command]] | None = None,
    ):
        """`handlers` adds command kinds (e.g. "import" for the decode worker),
        each run on every rank; `after_step` runs on every rank after each step
        (collectives allowed); `on_outputs` gets each step's outputs at once, on rank 0 only; `housekeeping`
        runs on rank 0 every iteration (idle ones too) and returns commands for
        every rank, like lease expiry (clock decisions are rank 0's)."""
        self.engine = engine
        self.on_outputs = on_outputs
        self.after_step = after_step
        self.handlers = {
            "add": lambda e, c: e.add_request(c.request_id, *c.args),
            "abort": lambda e, c: e.abort(c.request_id),
            "release": lambda e, c: e.release_handoff(c.request_id),
            "pause": lambda e, c: setattr(self, "is_paused", True),
            "unpause": lambda e, c: setattr(self, "is_paused", False),
            **(handlers or {}),
        }
        self.idle_tick_s = idle_tick_s
        self.housekeeping = housekeeping
        self._pending: list[tuple[Command, concurrent.futures.Future]] = []
        self._cond = threading.Condition()
        self._stopped = threading.Event()
        self.is_front = engine.ps.rank == 0
        self.is_paused = False
        """Paused: commands still apply (requests queue up) but no step runs."""

    # ------------------------------------------------------------ rank 0 API
    def submit(self, command: Command) -> concurrent.futures.Future:
        if not self.is_front:
            raise RuntimeError("commands are submitted on global rank 0 only")
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stopped.is_set():
            settle(future, error=EngineStoppedError("engine loop has stopped"))
            return future
        with self._cond:
            self._pending.append((command, future))
            self._cond.notify()
        return future

    def stop(self) -> None:
        if self.is_front:
            self.submit(Command("stop"))

    @property
    def is_running(self) -> bool:
        return not self._stopped.is_set()

    # -------------------------------------------------------------- the loop
    def _take_commands(self) -> list[tuple[Command, concurrent.futures.Future]]:
        with self._cond:
            if not self._pending and (self.is_paused or not self.engine.has_unfinished()):
                self._cond.wait(timeout=self.idle_tick_s)
            batch, self._pending = self._pending, []
        for request_id in self.engine.expired_handoffs():
            batch.append((Command("release", request_id), concurrent.futures.Future()))
        if self.housekeeping is not None:
            batch.extend((command, concurrent.futures.Future()) for command in self.housekeeping())
        return batch

    def run(self) -> None:
        """Serve until a "stop" command; call on every rank (rank 0 from its own thread)."""
        engine = self.engine
        try:
            while True:
                batch = self._take_commands() if self.is_front else []
                commands = engine.ps.broadcast_from_first([c for c, _ in batch] if self.is_front else None)
                futures = [f for _, f in batch] if self.is_front else [None] * len(commands)
                if self._apply_all(commands, futures):
                    return
                if engine.has_unfinished() and not self.is_paused:  # same on every rank: same state
                    fault_injection.before_step()  # test hook: crash or a long step
                    outputs = engine.step()
                    if self.after_step is not None:
                        self.after_step(engine, outputs)
                    if self.is_front and self.on_outputs is not None and outputs:
                        self._safe(self.on_outputs, outputs)
        finally:
            self._stopped.set()
            self._fail_pending(EngineStoppedError("engine loop stopped"))

    def _apply_all(self, commands: list[Command], futures: list) -> bool:
        stop = False
        for command, future in zip(commands, futures, strict=True):
            if future is not None:
                # From here on the submitter's cancel (its RPC gone: `asyncio.wrap_future`
                # cancels this future) no longer takes: the command applies on every rank
                # alike, cancelled or not, and its outcome is dropped if nobody waits.
                future.set_running_or_notify_cancel()
            if command.kind == "stop":
                stop = True
                settle(future, None)
                continue
            handler = self.handlers.get(command.kind)
            try:
                if handler is None:
                    raise ValueError(f"unknown engine command {command.kind!r}")
                result = handler(self.engine, command)
            except Exception as exc:  # the submitter gets the error; the loop goes on
                settle(future, error=exc)
            else:
                settle(future, result)
        return stop

    def _fail_pending(self, exc: Exception) -> None:
        with self._cond:
            batch, self._pending = self._pending, []
        for _, future in batch:
            settle(future, error=exc)

    @staticmethod
    def _safe(fn: Callable, *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a broken consumer must not kill the engine
            log.exception("output callback failed")


def settle(future: concurrent.futures.Future | None, value: Any = None, error: BaseException | None = None) -> None:
    """Resolve `future` with `value` (or `error`) unless it was cancelled: its caller gave up
    (a cancelled RPC cancels the future `asyncio.wrap_future` made of it), and the thread that
    settles — the engine's — must not die of it (`InvalidStateError`; a decode worker's engine
    loop did, when a client's deadline passed while its import was failing). No `done()` check
    first: the event loop may cancel between the check and the set."""
    if future is None:
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass
