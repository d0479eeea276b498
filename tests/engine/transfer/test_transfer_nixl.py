"""Real NIXL between two real processes: the source process exposes two source ranks (tp=2, one
agent each), the destination process pulls through its own agents; metadata only travels as bytes
through a pipe (standing in for our gRPC), never through NIXL's listener."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest
import torch
from kvtransfer_helpers import layout, nixl_destination_process, nixl_source_process, run_processes

pytest.importorskip("nixl_cu13")


def _nixl_handoff(case):
    ctx = mp.get_context("spawn")
    src_conn, dst_conn = ctx.Pipe()
    run_processes([(nixl_source_process, case, src_conn), (nixl_destination_process, case, dst_conn)])


def test_nixl_moves_kv_tp2_to_tp1_between_processes():
    _nixl_handoff(dict(src=dict(tp=2, pp=1, kv_heads=4), dst=dict(tp=1, pp=2, kv_heads=4),
                       num_blocks=6, pool=11, seed=21, first_block=2))


@pytest.mark.parametrize("ucx_tls", [None, "tcp,self"], ids=["ucx-default", "tcp"])
def test_a_pulling_agent_without_a_progress_thread_reads_between_processes(ucx_tls):
    """Decode workers' agents run without NIXL's progress thread (it spins a core): their own polling
    progresses the reads, over shared memory and over TCP (where the source's thread answers)."""
    if ucx_tls and not _ucx_starts_with(ucx_tls):  # e.g. the trimmed nixl-cu13 carried to the GPU host
        pytest.skip(f"UCX cannot start with UCX_TLS={ucx_tls} on this host")
    _nixl_handoff(dict(src=dict(tp=1, pp=1, kv_heads=2), dst=dict(tp=2, pp=1, kv_heads=2), num_blocks=5,
                       pool=9, seed=23, first_block=1, dst_progress_thread=False, ucx_tls=ucx_tls))


def _ucx_starts_with(ucx_tls: str) -> bool:
    import os
    import subprocess
    import sys

    probe = "from splitserve.engine.transfer.nixl_transport import NixlTransport; NixlTransport().close()"
    env = dict(os.environ, UCX_TLS=ucx_tls)
    return subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=60).returncode == 0


def test_nixl_endpoint_round_trips_and_rejects_garbage():
    from splitserve.engine.transfer.nixl_transport import NixlEndpoint

    ep = NixlEndpoint(b"\x00agent\xff", "DRAM", 0, (1, 2, 3), (2, 4, 1, 2, 4), "float32")
    assert NixlEndpoint.from_bytes(ep.to_bytes()) == ep
    with pytest.raises(ValueError, match="not NIXL endpoint metadata"):
        NixlEndpoint.from_bytes(b"inproc:3")


def test_nixl_refuses_an_endpoint_that_does_not_match_the_plan():
    from splitserve.engine.transfer.nixl_transport import NixlTransport
    from splitserve.engine.transfer.plan import build_plan

    src, dst = layout(1, 1, 2), layout(1, 1, 2)
    plan = build_plan(src, dst, {0: [0]}, {0: [1]})
    with NixlTransport() as t:
        wrong = t.expose([torch.zeros(2, 3, 2, 2, 4)] * 2)  # 2 layers, plan's source has 3
        with pytest.raises(ValueError, match=r"source rank 0 exposes 2 layers of \(2, 3, 2, 2, 4\) float32"):
            t.pull(plan, 0, {0: wrong}, [torch.zeros(dst.kv_shape(3)) for _ in range(3)])


def _in_process_handoff(src_lay, dst_lay, first_block, seed):
    from kvtransfer_helpers import SENTINEL, block_tables, random_logical, scatter

    from splitserve.engine.transfer.plan import build_plan

    logical = random_logical(src_lay, 4, seed)
    src_t, dst_t = block_tables(src_lay, 4, 7, seed), block_tables(dst_lay, 4, 7, seed + 1)
    plan = build_plan(src_lay, dst_lay, src_t, dst_t, first_block)
    src_kv = scatter(logical, src_lay, src_t, 7)
    dst_kv = scatter(torch.full_like(logical, SENTINEL), dst_lay, dst_t, 7)
    expected = logical.clone()
    expected[:, :, :first_block] = SENTINEL
    return plan, src_kv, dst_kv, scatter(expected, dst_lay, dst_t, 7)


def test_nixl_two_agents_in_one_process_replicated_heads_tp1_to_tp4():
    from kvtransfer_helpers import assert_pools_equal

    from splitserve.engine.transfer.nixl_transport import NixlTransport

    src_lay, dst_lay = layout(1, 2, 2), layout(4, 1, 2)
    plan, src_kv, dst_kv, expected = _in_process_handoff(src_lay, dst_lay, 1, seed=7)
    with NixlTransport() as src_t, NixlTransport() as dst_t:
        remote = {rank: src_t.expose(kv) for rank, kv in src_kv.items()}
        for rank in range(dst_lay.world_size):
            assert dst_t.pull(plan, rank, remote, dst_kv[rank]).num_bytes == 3 * 2 * 3 * src_lay.head_block_bytes
    assert_pools_equal(dst_kv, expected, "nixl tp1 pp2 -> tp4")


def test_nixl_pull_times_out_with_a_clear_error_instead_of_hanging():
    from splitserve.engine.transfer.nixl_transport import NixlTransport
    from splitserve.engine.transfer.transport import TransferTimeout

    src_lay, dst_lay = layout(2, 1, 2), layout(1, 1, 2)
    plan, src_kv, dst_kv, _ = _in_process_handoff(src_lay, dst_lay, 0, seed=8)
    with NixlTransport() as src_t, NixlTransport() as dst_t:
        remote = {rank: src_t.expose(kv) for rank, kv in src_kv.items()}
        # Model a peer that never completes: the backend keeps reporting "in progress".
        dst_t._agent.check_xfer_state = lambda handle: "PROC"
        with pytest.raises(TransferTimeout, match=r"NIXL read from source ranks \[0, 1\] not done after 0.2s"):
            dst_t.pull(plan, 0, remote, dst_kv[0], timeout_s=0.2)


def _thread_cpu_s(tids) -> float:
    """User + system CPU seconds of this process's threads `tids` (Linux /proc)."""
    import os

    total = 0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # the thread ended
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize(("delay_us", "spins"), [(None, False), (0, True)], ids=["default", "nixl-spin"])
def test_the_progress_thread_sleeps_between_polls_unless_asked_to_spin(delay_us, spins):
    """NIXL's Python API makes its progress thread spin (zero poll timeout); our agents give it a
    timeout (nixl_transport.PROGRESS_DELAY_US), so an idle source costs no core. The threads the
    agent started are measured over one idle second."""
    import os
    import time

    from splitserve.engine.transfer.nixl_transport import NixlTransport

    before = set(os.listdir("/proc/self/task"))
    transport = NixlTransport(progress_delay_us=delay_us)
    try:
        started = set(os.listdir("/proc/self/task")) - before
        assert started, "the agent started no thread"
        cpu0 = _thread_cpu_s(started)
        time.sleep(1.0)
        used = _thread_cpu_s(started) - cpu0
    finally:
        transport.close()
    if spins:
        assert used > 0.3, f"NIXL's spinning thread used only {used:.2f} s of CPU in 1 s"
    else:
        assert used < 0.1, f"the progress thread used {used:.2f} s of CPU in an idle second"


def test_a_bad_progress_delay_setting_is_refused_clearly(monkeypatch):
    from splitserve.engine.transfer.nixl_transport import NixlTransport

    monkeypatch.setenv("SPLITSERVE_NIXL_PROGRESS_DELAY_US", "soon")
    with pytest.raises(ValueError, match="SPLITSERVE_NIXL_PROGRESS_DELAY_US must be whole microseconds, got 'soon'"):
        NixlTransport()


@pytest.mark.parametrize("cuda", [False, True], ids=["cpu-host", "cuda-host"])
def test_cuda_ipc_reads_are_asked_for_only_on_a_cuda_host(monkeypatch, cuda):
    """UCX turns cuda_ipc's get_zcopy off on GPUs without NVLink, and NIXL READs of VRAM then
    crawl over TCP loopback; a CUDA host asks for it. A CPU host leaves the variable alone: UCX
    has no cuda module loaded there and warns about every unused UCX_ variable. A value already
    in the environment wins."""
    from splitserve.engine.transfer import nixl_agent

    key = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(nixl_agent, "_cuda_available", lambda: cuda)
    nixl_agent.apply_env_defaults()
    assert os.environ.get(key) == ("on" if cuda else None)
    assert os.environ["UCX_NET_DEVICES"]  # the loopback default (or the caller's) is always there
    monkeypatch.setenv(key, "auto")
    nixl_agent.apply_env_defaults()
    assert os.environ[key] == "auto"


@pytest.mark.parametrize("shortcut", [True, False], ids=["cuda-ipc-shortcut", "nixl-reads"])
def test_vram_pulls_on_one_host_map_the_source_pool_over_cuda_ipc(monkeypatch, shortcut):
    """Both pools in VRAM on one host: the destination maps the source's pool and copies with our
    kernel (nixl_same_host.py); `SPLITSERVE_NIXL_CUDA_IPC=0` keeps NIXL reads. Same bytes either way
    (a tp 1 -> 2 reshard: head slices)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    monkeypatch.setenv("SPLITSERVE_NIXL_CUDA_IPC", "1" if shortcut else "0")  # the spawned processes inherit it
    _nixl_handoff(dict(src=dict(tp=1, pp=1, kv_heads=4), dst=dict(tp=2, pp=1, kv_heads=4), num_blocks=6,
                       pool=11, seed=31, first_block=1, cuda=True, same_host=shortcut))


def test_the_same_host_shortcut_stays_out_of_cpu_pools_and_other_hosts(monkeypatch):
    """What a source publishes and when a destination may map it (the GPU test above maps it)."""
    from splitserve.engine.transfer import nixl_same_host
    from splitserve.engine.transfer.nixl_endpoint import NixlEndpoint

    cpu_pool = [torch.zeros(2, 3, 2, 4, 8) for _ in range(2)]
    assert nixl_same_host.publish(cpu_pool) == ("", "")
    base = dict(agent_metadata=b"agent", mem_type="VRAM", device_id=0, layer_addrs=(1, 2),
                layer_shape=(2, 3, 2, 4, 8), dtype="float32")
    ep = NixlEndpoint(**base, ipc_host="boot/host", ipc_handles='[{"h": 1}]')
    assert NixlEndpoint.from_bytes(ep.to_bytes()) == ep
    assert NixlEndpoint.from_bytes(NixlEndpoint(**base).to_bytes()).ipc_handles == ""  # the older form reads
    path = nixl_same_host.SameHostPath()
    here = NixlEndpoint(**base, ipc_host=nixl_same_host.host_identity(), ipc_handles='[{"h": 1}]')
    assert path.pull(None, 0, {0: here}, cpu_pool, 0.0) is None  # a CPU destination pool: NIXL
    if torch.cuda.is_available():
        gpu_pool = [t.cuda() for t in cpu_pool]
        assert path.pull(None, 0, {0: ep}, gpu_pool, 0.0) is None  # another host: NIXL
        monkeypatch.setenv("SPLITSERVE_NIXL_CUDA_IPC", "0")  # read when a transport starts
        assert nixl_same_host.SameHostPath().pull(None, 0, {0: here}, gpu_pool, 0.0) is None  # turned off
    assert path.pulls == 0
