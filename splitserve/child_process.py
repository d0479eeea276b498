"""One child process of `splitserve up`: its own process group, its output in a log file, watched lines.

    child = ChildProcess("router", [sys.executable, "-m", "splitserve", "router", ...], log_dir / "router.log")
    await child.start()
    line = await child.wait_for_line("READY ", timeout_s=60)   # or poll a health check
    await child.stop(grace_s=10)                                # SIGTERM the group, then SIGKILL what is left

The child runs in a new session, so a Ctrl-C in the terminal reaches only
`splitserve up`, which then stops the children in order; `stop` signals the
whole group, so processes a child spawned (tensor-parallel ranks) go too. On
Linux each child also gets SIGTERM from the kernel if `splitserve up` itself
dies without cleaning up (SIGKILL, OOM): no orphans either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

# Runs before the real program (then replaced by it through exec): asks the kernel
# to SIGTERM this process when its parent dies (PR_SET_PDEATHSIG survives exec),
# and gives up if the parent is already gone.
_PARENT_DEATH_SIGNAL = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit('splitserve up is gone')\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """`argv`, wrapped so that the child is SIGTERMed when this process dies (Linux; unchanged elsewhere)."""
    if not sys.platform.startswith("linux"):
        return argv
    return [sys.executable, "-I", "-S", "-c", _PARENT_DEATH_SIGNAL, str(os.getpid()), *argv]


class ChildExitedError(RuntimeError):
    """A child ended while we waited for it; the message holds the tail of its log."""


class ChildProcess:
    def __init__(
        self, name: str, argv: list[str], log_path: Path, *, env: dict[str, str] | None = None,
        echo: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        """`echo` receives every output line (prefixed by the caller) when the user asked to see them."""
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._env = env
        self._echo = echo
        self._process: asyncio.subprocess.Process | None = None
        self._reader: asyncio.Task | None = None
        self._lines: list[str] = []
        self._line_added = asyncio.Event()

    @property
    def pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    @property
    def returncode(self) -> int | None:
        return None if self._process is None else self._process.returncode

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._process = await asyncio.create_subprocess_exec(
            *with_parent_death_signal(self.argv), stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env=self._env, start_new_session=True,
        )  # fmt: skip
        self._reader = asyncio.create_task(self._read(), name=f"read-{self.name}")

    async def _read(self) -> None:
        with open(self.log_path, "a", encoding="utf-8", errors="replace") as log:
            while True:
                raw = await self._process.stdout.readline()
                if not raw:
                    break
                line = raw.decode("utf-8", errors="replace").rstrip("\n")
                log.write(line + "\n")
                log.flush()
                self._lines.append(line)
                del self._lines[:-200]  # keep a tail for errors and waits
                self._line_added.set()
                if self._echo is not None:
                    self._echo(line)
        self._line_added.set()

    async def wait_for_line(self, prefix: str, timeout_s: float) -> str:
        """The first output line starting with `prefix`; ChildExitedError / TimeoutError otherwise."""
        async with asyncio.timeout(timeout_s):
            seen = 0
            while True:
                for line in self._lines[seen:]:
                    if line.startswith(prefix):
                        return line
                seen = len(self._lines)
                if self._reader.done():
                    await self._process.wait()
                    raise ChildExitedError(self.exit_message())
                self._line_added.clear()
                await self._line_added.wait()

    def exit_message(self) -> str:
        return f"{self.name} exited with code {self.returncode}; the end of its log ({self.log_path}):\n{self.tail()}"

    def tail(self, num_lines: int = 25) -> str:
        return "\n".join(f"    {line}" for line in self._lines[-num_lines:]) or "    (no output)"

    async def wait(self) -> int:
        """Waits for the process to end; its exit code."""
        code = await self._process.wait()
        if self._reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        return code

    async def stop(self, grace_s: float) -> int | None:
        """SIGTERM to the process group; SIGKILL whatever is left of it after `grace_s`. Returns the exit code."""
        if self._process is None:
            return None
        pgid = self._process.pid  # a session leader: its pid is its group id
        if self._process.returncode is None:
            _signal_group(pgid, signal.SIGTERM)
            try:
                async with asyncio.timeout(grace_s):
                    await self._process.wait()
            except TimeoutError:
                pass
        _signal_group(pgid, signal.SIGKILL)  # the leader's stragglers (rank processes), or the leader itself
        code = await self.wait()
        # A killed straggler whose parent (the leader) is gone exists until its new parent reaps it;
        # give that a moment so `is_group_alive` reports real orphans, not a reaping in progress.
        for _ in range(40):
            if not self.is_group_alive():
                break
            await asyncio.sleep(0.05)
        return code

    async def restart(self) -> None:
        """Runs the same command again, after the process exited; what is left of its group
        (ranks it spawned) is killed first. The log file goes on (a marker line first)."""
        if self._process is not None:
            _signal_group(self._process.pid, signal.SIGKILL)
            await self.wait()
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"---- {self.name} restarted by splitserve up (it exited with code {self.returncode}) ----\n")
        self._lines.clear()
        await self.start()

    def is_group_alive(self) -> bool:
        """Any process of the child's group still exists (after stop: an orphan)."""
        if self._process is None:
            return False
        try:
            os.killpg(self._process.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)
