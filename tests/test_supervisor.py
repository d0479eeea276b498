"""`splitserve up`'s supervision (splitserve/supervisor.py) on real child processes: a child
that exits is started again, a crash loop ends the supervision."""

from __future__ import annotations

import asyncio
import sys

from splitserve.child_process import ChildProcess
from splitserve.supervisor import supervise


class OneChildCluster:
    def __init__(self, child: ChildProcess) -> None:
        self.child = child

    async def wait_for_exit(self) -> ChildProcess:
        await self.child.wait()
        return self.child


async def test_a_child_that_exits_is_restarted_until_it_crash_loops(tmp_path):
    log = tmp_path / "flaky.log"
    child = ChildProcess("flaky", [sys.executable, "-c", "print('up'); raise SystemExit(3)"], log)
    await child.start()
    said: list[str] = []
    gave_up = await asyncio.wait_for(supervise(OneChildCluster(child), said.append, max_restarts=2), 30)
    assert gave_up is child and child.returncode == 3
    assert len(said) == 2 and "flaky exited with code 3; restarting it in 0.5 s (restart 1 of at most 2" in said[0]
    assert "restarting it in 1 s (restart 2" in said[1]  # a crash loop backs off
    text = log.read_text()
    assert text.count("up\n") == 3 and text.count("restarted by splitserve up (it exited with code 3)") == 2


async def test_no_restarts_returns_the_first_exit(tmp_path):
    child = ChildProcess("once", [sys.executable, "-c", "raise SystemExit(0)"], tmp_path / "once.log")
    await child.start()
    said: list[str] = []
    assert await asyncio.wait_for(supervise(OneChildCluster(child), said.append, max_restarts=0), 30) is child
    assert said == []


async def test_stop_leaves_no_process_of_the_group_behind(tmp_path):
    """A child that spawned a process ignoring SIGTERM (as a worker's tensor-parallel ranks do):
    `stop` SIGTERMs the group, the leader exits, the straggler is SIGKILLed, and once `stop`
    returns the group is gone — the straggler reaped by its new parent, not reported as an orphan."""
    script = (
        "import signal, subprocess, sys, time\n"
        "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "print(\"rank\", flush=True); time.sleep(60)'])\n"
        "time.sleep(60)\n"
    )
    child = ChildProcess("group", [sys.executable, "-c", script], tmp_path / "group.log")
    await child.start()
    log = tmp_path / "group.log"
    for _ in range(200):
        if log.exists() and "rank" in log.read_text():
            break
        await asyncio.sleep(0.05)
    assert child.is_group_alive()
    await asyncio.wait_for(child.stop(grace_s=5.0), 30)
    assert not child.is_group_alive()
