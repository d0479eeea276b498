"""The test-only fault-injection hook (engine/fault_injection.py): off by default, a fixed
setting or a file re-read at every check, bad settings refused with the bad part quoted."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.engine import fault_injection
from splitserve.engine.fault_injection import delay_s, parse_delays


def test_parse_delays():
    assert parse_delays("prefill=3000, stream=200\ntransfer=0") == {"prefill": 3.0, "stream": 0.2, "transfer": 0.0}
    assert parse_delays("") == {}
    for bad, quoted in (("decode=5", "decode=5"), ("prefill", "prefill"), ("stream=soon", "'soon'"), ("prefill=-1", "prefill=-1")):
        with pytest.raises(ValueError, match=quoted):
            parse_delays(bad)


def test_off_unless_set_then_fixed_or_read_from_the_file(monkeypatch, tmp_path):
    monkeypatch.delenv("SPLITSERVE_FAULT_DELAY_MS", raising=False)
    monkeypatch.delenv("SPLITSERVE_FAULT_DELAY_FILE", raising=False)
    assert delay_s("prefill") == 0.0
    monkeypatch.setenv("SPLITSERVE_FAULT_DELAY_MS", "prefill=1500")
    assert delay_s("prefill") == 1.5 and delay_s("stream") == 0.0
    monkeypatch.delenv("SPLITSERVE_FAULT_DELAY_MS")
    path = tmp_path / "faults"
    monkeypatch.setenv("SPLITSERVE_FAULT_DELAY_FILE", str(path))
    assert delay_s("stream") == 0.0  # no file yet
    path.write_text("stream=250")
    assert delay_s("stream") == 0.25
    path.write_text("stream=oops")  # a bad setting is logged and ignored, never raised into a request
    assert delay_s("stream") == 0.0


def test_hold_waits_and_logs_the_pid(monkeypatch, caplog):
    monkeypatch.setenv("SPLITSERVE_FAULT_DELAY_MS", "transfer=50")
    started = time.monotonic()
    asyncio.run(fault_injection.hold("transfer", "req-1"))
    assert time.monotonic() - started >= 0.05
    assert "holds request req-1 in phase transfer for 50 ms" in caplog.text


def test_before_step_is_a_no_op_when_off_and_crashes_or_sleeps_when_set(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_FAULT_DELAY_MS", raising=False)
    monkeypatch.delenv("SPLITSERVE_FAULT_DELAY_FILE", raising=False)
    fault_injection.before_step()
    monkeypatch.setenv("SPLITSERVE_FAULT_DELAY_MS", "step=60")
    started = time.monotonic()
    fault_injection.before_step()
    assert time.monotonic() - started >= 0.06
    monkeypatch.setenv("SPLITSERVE_FAULT_DELAY_MS", "crash=0,step=5000")  # the crash wins, at once
    with pytest.raises(RuntimeError, match="engine loop crashes"):
        fault_injection.before_step()
