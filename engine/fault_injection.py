"""Test hook: hold a request in a named phase of a worker, so a test can kill or stop the
worker exactly there (tests/reliability/). Off unless one of these variables is set:

    SPLITSERVE_FAULT_DELAY_MS="prefill=3000,stream=200"   fixed for the process's life
    SPLITSERVE_FAULT_DELAY_FILE=/tmp/faults               same syntax, re-read at every check
                                                          (a missing or empty file = no delay)

Phases (where the worker waits):

    prefill    prefill worker: the prompt is computed and its blocks are pinned, the reply not yet sent
               (PrefillStream: the first token is out, the final response not)
    transfer   decode worker: the handoff arrived, the pull from the prefill worker not yet begun
    stream     decode worker: before each chunk of the token stream is sent
    step       any worker: the engine thread sleeps before each step it runs (a long step: commands
               submitted meanwhile wait for it)
    crash      any worker: the engine loop raises at its next step (the milliseconds are ignored);
               the worker must then exit non-zero rather than hang its requests

Each wait logs `fault injection: pid <pid> holds request <id> in phase <phase> for <ms> ms`
(on the worker's log, at WARNING), so the test knows which process to hit. Never set these in
production: they only slow requests down.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

log = logging.getLogger(__name__)

PHASES = ("prefill", "transfer", "stream", "step", "crash")


def parse_delays(text: str) -> dict[str, float]:
    """`"prefill=3000,stream=200"` -> {"prefill": 3.0, "stream": 0.2} (seconds); ValueError quoting a bad part."""
    delays: dict[str, float] = {}
    for part in text.replace("\n", ",").split(","):
        part = part.strip()
        if not part:
            continue
        phase, sep, ms = part.partition("=")
        phase = phase.strip()
        if not sep or phase not in PHASES:
            raise ValueError(f"fault delay {part!r}: expected <phase>=<ms> with a phase in {PHASES}")
        try:
            value = float(ms)
        except ValueError:
            raise ValueError(f"fault delay {part!r}: {ms.strip()!r} is not a number of milliseconds") from None
        if value < 0:
            raise ValueError(f"fault delay {part!r}: milliseconds must be >= 0")
        delays[phase] = value / 1e3
    return delays


def delay_s(phase: str) -> float:
    """Seconds to hold a request in `phase` now (0 = none)."""
    delays = _current()
    return 0.0 if delays is None else delays.get(phase, 0.0)


def before_step() -> None:
    """The engine loop's hook before each step, one look at the setting: raise for "crash",
    sleep for "step" (off: two environment lookups)."""
    delays = _current()
    if delays is None:
        return
    if "crash" in delays:  # tests/integration/test_worker_crash.py
        raise RuntimeError("fault injection: the engine loop crashes")
    if slow := delays.get("step", 0.0):  # a long step
        time.sleep(slow)


def _current() -> dict[str, float] | None:
    """The setting now; None when the hook is off (no variable set: the common, fast case)."""
    fixed = os.environ.get("SPLITSERVE_FAULT_DELAY_MS")
    path = os.environ.get("SPLITSERVE_FAULT_DELAY_FILE")
    if not fixed and not path:
        return None
    text = fixed or ""
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError:
            text = ""
    try:
        return parse_delays(text)
    except ValueError as exc:
        log.error("ignoring the fault-injection setting: %s", exc)
        return None


async def hold(phase: str, request_id: str) -> None:
    """Waits in `phase` if the test hook asks for it (cancellable like any await)."""
    seconds = delay_s(phase)
    if seconds <= 0:
        return
    log.warning(
        "fault injection: pid %d holds request %s in phase %s for %d ms", os.getpid(), request_id, phase, seconds * 1e3
    )
    await asyncio.sleep(seconds)
