"""A `splitserve up` cluster for fault tests, and what the tests ask of it.

    cluster = FaultCluster.start(work_dir, "tp=1,role=prefill,dp=2+tp=1,role=decode,dp=2", router_args=[...])
    cluster.set_faults("prefill=2000")            # engine/fault_injection.py, read at every check
    since = cluster.fault_lines()                 # before the request, then:
    pid, request_id = cluster.wait_fault_holder("prefill", since)   # the worker process holding it there
    cluster.wait_clean(timeout_s=1.0)             # every worker's pool passes CheckIntegrity, nothing held
    cluster.stop()                                # SIGTERM to `up`; returns the processes left behind

Worker processes are found through the control plane's topology (their addresses) and
their CheckIntegrity answers (their pids), so a test can kill exactly the one it means.
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
from dataclasses import dataclass
from pathlib import Path

import grpc

from splitserve.proto.v1 import (
    common_pb2,
    control_plane_pb2,
    control_plane_pb2_grpc,
    decode_worker_pb2_grpc,
    prefill_worker_pb2_grpc,
)
from tests.e2e.process_tree import alive, descendants

PREFILL, DECODE = common_pb2.ROLE_PREFILL, common_pb2.ROLE_DECODE
MODEL = "splitserve-default"
SHARDS = "tp=1,role=prefill,dp=2+tp=1,role=decode,dp=2"
NUM_WORKERS = 4
LEASE_S = 5
"""--handoff-lease-s of the workers: an unacknowledged pin is freed after this long."""
ROUTER_ARGS = ["--prefill-timeout=4", "--decode-first-chunk-timeout=5", "--decode-stall-timeout=5"]
PROMPT = "def parse_arguments(argv):\n    parser = argparse.ArgumentParser()\n"
_FAULT_LINE = re.compile(r"fault injection: pid (\d+) holds request (\S+) in phase (\w+)")


@dataclass(frozen=True)
class Worker:
    worker_id: str
    address: str
    role: int


class FaultCluster:
    def __init__(self, proc: subprocess.Popen, work: Path, lines: queue.Queue, output: list[str]) -> None:
        self.proc = proc
        self.work = work
        self.faults = work / "faults"
        self._lines = lines
        self.output = output
        text = "".join(output)
        self.url = next(line.split()[1] for line in output if line.startswith("READY "))
        sdk = re.search(r"Client\('([^']+)', control_plane='([^']+)'", text)
        self.router, self.control_plane = sdk.group(1), sdk.group(2)
        self.seen_pids: set[int] = set()
        """Every process `up` ran (grows as it restarts children): none may outlive `up`."""

    @classmethod
    def start(cls, work: Path, shards: str, *, router_args=(), worker_args=(), timeout_s: float = 150.0) -> FaultCluster:
        faults = work / "faults"
        faults.write_text("")
        argv = [sys.executable, "-m", "splitserve", "up", "--port", "0", "--work-dir", str(work),
                "--inference-shards", shards]  # fmt: skip
        argv += [f"--router-arg={a}" for a in router_args] + [f"--worker-arg={a}" for a in worker_args]
        env = dict(os.environ, PYTHONUNBUFFERED="1", SPLITSERVE_FAULT_DELAY_FILE=str(faults), OMP_NUM_THREADS="1")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True, env=env)  # fmt: skip
        lines: queue.Queue = queue.Queue()
        output: list[str] = []

        def read() -> None:
            for line in proc.stdout:
                output.append(line)
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not any(line.startswith("READY ") for line in output):
            if proc.poll() is not None or time.monotonic() > deadline:
                _terminate(proc)
                raise RuntimeError("splitserve up did not become ready:\n" + "".join(output))
            time.sleep(0.2)
        cluster = cls(proc, work, lines, output)
        cluster.note_processes()
        return cluster

    # ------------------------------------------------------------ processes
    def note_processes(self) -> set[int]:
        family = descendants(self.proc.pid)
        self.seen_pids |= family
        return family

    def stop(self, timeout_s: float = 90.0) -> list[int]:
        """SIGTERM to `up` (it stops every child); the pids of processes left behind."""
        self.note_processes()
        _terminate(self.proc, timeout_s)
        time.sleep(0.3)
        return sorted(pid for pid in self.seen_pids if alive(pid))

    def child_pid(self, name: str) -> int:
        """The pid of the `splitserve <name>` child (router, gateway, control-plane) or of etcd."""
        for pid in descendants(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            words = [a.decode() for a in argv]
            if name == "etcd" and words and os.path.basename(words[0]) == "etcd":
                return pid
            if len(words) > 3 and words[1:3] == ["-m", "splitserve"] and words[3] == name:
                return pid
        raise LookupError(f"no {name} process under splitserve up")

    def log_text(self) -> str:
        return "".join(self.output)

    def wait_log(self, *needles: str, timeout_s: float = 20.0) -> None:
        """Until `splitserve up`'s output holds every needle (its supervisor notices a death on its own
        schedule, which may come after the request the death was about has been answered)."""
        deadline = time.monotonic() + timeout_s
        while not all(n in self.log_text() for n in needles):
            if time.monotonic() > deadline:
                raise AssertionError(f"{needles} not in the cluster log:\n{self.log_text()[-3000:]}")
            time.sleep(0.1)

    # ------------------------------------------------------------- topology
    def topology(self):
        with grpc.insecure_channel(self.control_plane) as channel:
            stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
            return stub.GetTopology(control_plane_pb2.GetTopologyRequest(), timeout=3)

    def workers(self) -> list[Worker]:
        """The workers filling a slot now (tp=1: one slot each)."""
        topology = self.topology()
        addresses = {w.worker_id: w.address for w in topology.workers}
        return [Worker(s.worker_id, addresses[s.worker_id], s.slot.role) for s in topology.slots
                if s.worker_id and s.worker_id in addresses]  # fmt: skip

    def integrity(self, worker: Worker, timeout_s: float = 3.0) -> common_pb2.IntegrityReport:
        with grpc.insecure_channel(worker.address) as channel:
            stub_type = prefill_worker_pb2_grpc.PrefillWorkerStub if worker.role == PREFILL else decode_worker_pb2_grpc.DecodeWorkerStub
            return stub_type(channel).CheckIntegrity(common_pb2.IntegrityRequest(), timeout=timeout_s)

    def reports(self, role: int | None = None) -> dict[str, common_pb2.IntegrityReport]:
        return {w.worker_id: self.integrity(w) for w in self.workers() if role is None or w.role == role}

    def worker_pids(self, role: int | None = None) -> dict[str, int]:
        return {worker_id: r.pid for worker_id, r in self.reports(role).items()}

    def wait_whole(self, num_workers: int, timeout_s: float = 90.0) -> dict[str, int]:
        """Waits until `num_workers` fill the slots and all answer; their pids by worker id."""
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            try:
                pids = self.worker_pids()
                if len(pids) == num_workers and all(alive(pid) for pid in pids.values()):
                    self.note_processes()
                    return pids
                last = pids
            except grpc.RpcError as e:
                last = e
            time.sleep(0.3)
        raise TimeoutError(f"the cluster did not get its {num_workers} workers back: {last}\n{self.log_text()[-3000:]}")

    def wait_clean(self, timeout_s: float) -> dict[str, common_pb2.IntegrityReport]:
        """Waits until every worker's pool is intact and holds nothing (no request, pin or used
        block; cached blocks are fine); AssertionError with the reports otherwise."""
        deadline = time.monotonic() + timeout_s
        while True:
            reports = self.reports()
            problems = {w: r for w, r in reports.items() if not is_clean(r)}
            if not problems:
                return reports
            if time.monotonic() > deadline:
                raise AssertionError(f"not clean within {timeout_s} s: {problems}")
            time.sleep(0.05)

    # ---------------------------------------------------------------- faults
    def set_faults(self, text: str) -> None:
        """engine/fault_injection.py syntax, e.g. "prefill=2000"; "" = none."""
        self.faults.write_text(text)

    def fault_lines(self) -> list[tuple[int, str, str]]:
        """(pid, request id, phase) of every fault-injection wait logged so far, by any worker."""
        found = []
        for path in sorted((self.work / "logs").glob("*worker*.log")):
            found += [(int(m[1]), m[2], m[3]) for m in _FAULT_LINE.finditer(path.read_text(errors="replace"))]
        return found

    def wait_fault_holder(self, phase: str, since: list, timeout_s: float = 30.0) -> tuple[int, str]:
        """(pid, request id) of a worker that logged a wait in `phase` which is not in `since`
        (`cluster.fault_lines()` taken before the request)."""
        seen = set(since)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for pid, request_id, seen_phase in self.fault_lines():
                if seen_phase == phase and (pid, request_id, seen_phase) not in seen:
                    return pid, request_id
            time.sleep(0.02)
        raise TimeoutError(f"no worker waited in phase {phase!r}")


def is_clean(report: common_pb2.IntegrityReport) -> bool:
    r = report
    return r.is_ok and not (r.num_requests or r.num_handoffs or r.num_pinned_blocks or r.num_in_use_blocks or r.num_in_flight)


def kill(pid: int, sig: int = signal.SIGKILL) -> None:
    os.kill(pid, sig)


def wait_dead(pid: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while alive(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"process {pid} is still alive")
        time.sleep(0.05)


def _terminate(proc: subprocess.Popen, timeout_s: float = 90.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def complete(oai, prompt: str, max_tokens: int = 16, **options):
    return oai.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, **{"temperature": 0, **options})
