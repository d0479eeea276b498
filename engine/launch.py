"""Run an engine over several ranks (TP × PP) from one Python call.

One process per rank (spawned, so CUDA and torch threads start clean), joined
through a `file://` rendezvous — nothing binds a network port. gloo on CPU,
NCCL on GPU (rank i uses cuda:i), by the engines' device
(`devices.group_on_cuda`, the rule worker groups follow too). Any rank's
failure kills the group and re-raises with that rank's traceback; a deadline
prevents hangs.
"""

from __future__ import annotations

import os
import queue as queue_mod
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splitserve.engine.devices import group_on_cuda


def _rank_main(
    rank: int, world_size: int, init_method: str, use_cuda: bool, fn: Callable, args: tuple, results
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if use_cuda:
        torch.cuda.set_device(rank)
    else:  # gloo between the ranks: an engine's "auto" device is the CPU too, never a GPU of the host
        os.environ["SPLITSERVE_AUTO_DEVICE"] = "cpu"
    try:
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=init_method, rank=rank, world_size=world_size)
        results.put((rank, True, fn(*args)))
    except (ValueError, FileNotFoundError) as exc:  # a bad option or model: the caller's error, said plainly
        results.put((rank, False, (type(exc).__name__, str(exc))))
    except BaseException:
        results.put((rank, False, ("", traceback.format_exc())))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(
    world_size: int, fn: Callable, *args: Any, use_cuda: bool | None = None, timeout_s: float = 600.0
) -> list[Any]:
    """Call `fn(*args)` on `world_size` fresh processes; return their results by rank.
    `use_cuda`: NCCL with a GPU per rank, or gloo on the CPU (default: `group_on_cuda("auto", world_size)`)."""
    if use_cuda is None:
        use_cuda = group_on_cuda("auto", world_size)
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="splitserve-rdzv-") as tmp:
        init_method = f"file://{tmp}/rendezvous"
        procs = [
            ctx.Process(target=_rank_main, args=(r, world_size, init_method, use_cuda, fn, args, results), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        by_rank: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        try:
            while len(by_rank) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(by_rank))} did not finish in {timeout_s} s")
                try:
                    rank, ok, value = results.get(timeout=min(remaining, 1.0))
                except queue_mod.Empty:
                    dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in by_rank]
                    if dead:
                        raise RuntimeError(f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}") from None
                    continue
                if not ok:
                    kind, text = value
                    if kind:  # ValueError / FileNotFoundError in the rank: the same here, without its traceback
                        raise (ValueError if kind == "ValueError" else FileNotFoundError)(f"rank {rank}: {text}")
                    raise RuntimeError(f"rank {rank} failed:\n{text}")
                by_rank[rank] = value
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [by_rank[r] for r in range(world_size)]


def _generate(model: str | None, prompts: Sequence, params, options: dict[str, Any]):
    from splitserve.engine.llm import LLM

    llm = LLM(model, **options)
    results = llm.generate(prompts, params)
    llm.engine.check_integrity()
    return results


def generate_on_ranks(
    model: str | None,
    prompts: Sequence,
    params,
    tensor_parallel_size: int = 1,
    pipeline_parallel_size: int = 1,
    **engine_options: Any,
):
    """`LLM.generate` on a TP × PP group; returns the driver rank's results."""
    world = tensor_parallel_size * pipeline_parallel_size
    options = dict(engine_options, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)
    use_cuda = group_on_cuda(str(engine_options.get("device", "auto")), tensor_parallel_size, pipeline_parallel_size)
    per_rank = run_on_ranks(world, _generate, model, prompts, params, options, use_cuda=use_cuda)
    return per_rank[(pipeline_parallel_size - 1) * tensor_parallel_size]
