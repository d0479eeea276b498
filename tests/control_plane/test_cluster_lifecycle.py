import pytest

from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.lifecycle import (
    LifecycleAction,
    LifecycleError,
    LifecycleState,
    LifecycleStatus,
    apply_action,
)
from splitserve.control_plane.records import LeaderRecord, WorkerRecord
from splitserve.control_plane.shard_spec import Role

A, S = LifecycleAction, LifecycleState


def test_rl_refit_cycle():
    status = LifecycleStatus()
    for action, state in [(A.PAUSE, S.PAUSED), (A.SUSPEND, S.SUSPENDED)]:
        status = apply_action(status, action)
        assert status.state is state
    status = apply_action(status, A.RELOAD_WEIGHTS, "/ckpt/step-10")
    assert status == LifecycleStatus(S.SUSPENDED, weights_version=1, checkpoint_path="/ckpt/step-10")
    status = apply_action(status, A.RESUME)
    assert status == LifecycleStatus(S.PAUSED, 1, "/ckpt/step-10")
    assert apply_action(status, A.UNPAUSE) == LifecycleStatus(S.RUNNING, 1, "/ckpt/step-10")


def test_repeated_actions_are_no_ops():
    paused = LifecycleStatus(S.PAUSED)
    assert apply_action(paused, A.PAUSE) is paused
    assert apply_action(LifecycleStatus(), A.UNPAUSE) == LifecycleStatus()


@pytest.mark.parametrize(
    ("state", "action", "path", "message"),
    [
        (S.RUNNING, A.SUSPEND, None, "cannot SUSPEND while RUNNING: PAUSE first"),
        (S.RUNNING, A.RESUME, None, "cannot RESUME while RUNNING: it is not suspended"),
        (S.SUSPENDED, A.UNPAUSE, None, "cannot UNPAUSE while SUSPENDED: RESUME first"),
        (S.PAUSED, A.RELOAD_WEIGHTS, "/c", "cannot RELOAD_WEIGHTS while PAUSED: SUSPEND first"),
        (S.SUSPENDED, A.RELOAD_WEIGHTS, None, "RELOAD_WEIGHTS needs a checkpoint_path"),
        (S.RUNNING, A.PAUSE, "/c", "checkpoint_path is only for RELOAD_WEIGHTS, got '/c' with PAUSE"),
    ],
)
def test_invalid_transitions(state, action, path, message):
    with pytest.raises(LifecycleError) as info:
        apply_action(LifecycleStatus(state), action, path)
    assert str(info.value) == message


def test_records_round_trip_and_validate():
    status = LifecycleStatus(S.SUSPENDED, 3, "/ckpt")
    assert LifecycleStatus.decode(status.encode()) == status
    worker = WorkerRecord("w-1", "127.0.0.1:5000", Role.DECODE, 2)
    assert WorkerRecord.decode(worker.encode()) == worker
    assert WorkerRecord.decode(WorkerRecord("w", "h:1").encode()).role is None
    assert LeaderRecord.decode(LeaderRecord("cp", "h:1").encode()) == LeaderRecord("cp", "h:1")
    with pytest.raises(ValueError, match="address must be host:port, got 'nohost'"):
        WorkerRecord("w", "nohost")
    with pytest.raises(ValueError, match="worker_id must be .*, got 'a/b'"):
        WorkerRecord("a/b", "h:1")
    with pytest.raises(ValueError, match="num_gpu_ranks must be a positive integer, got 0"):
        WorkerRecord("w", "h:1", None, 0)


def test_keys_layout():
    keys = ClusterKeys("prod", "/ss")
    assert keys.root == b"/ss/prod/"
    assert keys.worker("w-1") == b"/ss/prod/workers/w-1"
    assert keys.slot(12) == b"/ss/prod/slots/000012"
    assert keys.slot_id_of(keys.slot(12)) == 12
    assert keys.worker_id_of(keys.draining("w-1")) == "w-1"
    assert keys.slot_id_of(keys.leader) is None
    with pytest.raises(ValueError, match="prefix must start with '/' and not end with '/', got 'ss/'"):
        ClusterKeys("prod", "ss/")
    with pytest.raises(ValueError, match="cluster must be .*, got 'a b'"):
        ClusterKeys("a b")
