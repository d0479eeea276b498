"""`supervise`: what `splitserve up` does while the cluster runs — restart any child that exits.

A user who runs `splitserve up` expects a service, not a demo that falls over with its
first crash: a killed router, gateway, control plane, etcd or worker is started again
with the same command, so on the same ports and (etcd) the same data directory. The
others keep running meanwhile — workers are not restarted because the router died.
A worker that was SIGTERMed drains and exits 0, and is restarted too: SIGTERM to one
worker is a rolling restart. A child that exits more than `max_restarts` times within
`window_s` is crash-looping: `supervise` returns it and `up` stops the cluster, as it
does for any exit with `max_restarts=0`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from splitserve.child_process import ChildProcess

RESTART_WINDOW_S = 60.0


async def supervise(
    cluster, progress: Callable[[str], None], max_restarts: int, window_s: float = RESTART_WINDOW_S
) -> ChildProcess:
    """Restarts the cluster's children as they exit; returns the first one past its restart budget.
    `cluster` is a LocalCluster (started). Runs until cancelled otherwise."""
    restarts: dict[str, list[float]] = {}
    while True:
        child = await cluster.wait_for_exit()
        now = time.monotonic()
        recent = [t for t in restarts.get(child.name, []) if now - t < window_s]
        if len(recent) >= max_restarts:
            return child
        recent.append(now)
        restarts[child.name] = recent
        delay_s = min(8.0, 0.5 * 2 ** (len(recent) - 1))  # a crash loop backs off
        progress(
            f"splitserve up: {child.name} exited with code {child.returncode}; restarting it in {delay_s:g} s "
            f"(restart {len(recent)} of at most {max_restarts} per {window_s:g} s; log {child.log_path})"
        )
        await asyncio.sleep(delay_s)
        await child.restart()
