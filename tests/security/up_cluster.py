"""`splitserve up` as a test fixture: start it with extra flags, read its addresses, stop it cleanly.

    with UpCluster(tmp_path, "--engine", "sim", "--tls-cert", ...) as up:
        up.url, up.router, up.control_plane, up.workers    # from the lines `up` prints
"""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class UpCluster:
    def __init__(self, work: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 90.0) -> None:
        self.work = work
        self.argv = [sys.executable, "-m", "splitserve", "up", "--port", "0", "--work-dir", str(work), *args]
        self.env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        self.timeout_s = timeout_s
        self.output: list[str] = []
        self.url = self.router = self.control_plane = ""
        self.workers: list[str] = []
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> UpCluster:
        self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True, env=self.env)  # fmt: skip
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in self.proc.stdout], daemon=True).start()
        started = time.monotonic()
        while not self.url:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                line = None
            if line is not None:
                self.output.append(line)
                if line.startswith("READY "):
                    self.url = line.split()[1]
            elif time.monotonic() - started > self.timeout_s or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("splitserve up did not become ready:\n" + "".join(self.output))
        text = "".join(self.output)
        sdk = re.search(r"Client\('([^']+)', control_plane='([^']+)'", text)
        self.router, self.control_plane = sdk.group(1), sdk.group(2)
        self.workers = re.findall(r"worker \(group \d+, dp \d+\)\s+(\S+)", text)
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log(self, name: str) -> str:
        path = self.work / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
