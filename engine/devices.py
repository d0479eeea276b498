"""Which device an engine runs on, and whether a TP x PP group of them is a CUDA (NCCL) or a CPU
(gloo) group: the one rule for engines (`model_runner.py`), the rank launcher (`launch.py`) and
the worker groups (`worker_runtime.py`); and how a small host list reaches a GPU mid-step
(`to_device`). Torch only: cheap to import before anything is built."""

from __future__ import annotations

import os

import torch


def resolve_device(name: str) -> torch.device:
    """"auto": `SPLITSERVE_AUTO_DEVICE` when set (the rank launcher sets it to cpu on the ranks of
    a CPU group, `engine/launch.py`; the test suite sets it too), else CUDA when present, else the CPU."""
    if name == "auto":
        name = os.environ.get("SPLITSERVE_AUTO_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu")
        if name not in ("cpu", "cuda"):
            raise ValueError(f"SPLITSERVE_AUTO_DEVICE must be cpu or cuda, got {name!r}")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():  # else torch's AssertionError deep in a model build
        raise ValueError(f"device {name!r}: CUDA is not available here (no GPU visible, or a CPU build of torch "
                         f"{torch.__version__}); use --device cpu or auto")
    return device


def group_on_cuda(device: str, tp: int, pp: int = 1) -> bool:
    """Whether a TP x PP group whose engines ask for `device` runs on CUDA — a GPU per rank, NCCL
    between the ranks — or on the CPU over gloo. The engines' device decides ("auto" resolved as
    `resolve_device` does), not merely a GPU being present: CPU engines on a GPU host talk over
    gloo. The one rule for the rank launcher (engine/launch.py) and the worker groups
    (engine/worker_runtime.py). A CUDA group with more ranks than GPUs is refused here, with the
    way out, rather than inside NCCL's setup (which refuses two ranks on one GPU); a silent fall
    back to the CPU would serve tens of times slower than the user asked for."""
    on_cuda = resolve_device(device).type == "cuda"
    world = tp * pp
    if on_cuda and world > 1 and world > torch.cuda.device_count():
        raise ValueError(
            f"{world} ranks (--tp {tp} x --pp {pp}) on CUDA need a GPU each and this host has "
            f"{torch.cuda.device_count()}; use fewer ranks or --device cpu"
        )
    return on_cuda


def to_device(rows: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list on `device`; to a GPU from pinned memory, queued on the stream (a copy
    from pageable memory would wait for the steps already queued there)."""
    host = torch.tensor(rows, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def put_rows(dst: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    """`dst[rows] = values` with no host sync: a plain copy when `rows` are all of `dst`'s rows
    in order (a batch's common case: no index list sent to the device), else an index copy."""
    if rows == list(range(len(dst))):
        dst.copy_(values)
    else:
        dst.index_copy_(0, to_device(rows, torch.long, dst.device), values)
