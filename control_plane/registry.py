"""etcd leases kept alive from a background task: what makes membership die with its process.

A worker registers by attaching its keys to a lease it holds here (see
worker_registration.py); the control plane's leader key sits on one too. If
the process dies the refreshes stop, etcd expires the lease after its TTL and
deletes every key attached to it in one revision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import aetcd

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 10


class LeaseKeeper:
    """Owns one etcd lease and refreshes it every ttl/3 seconds.

    etcd being unreachable is tolerated: refreshes are retried (every 0.5 s at
    most) for as long as it takes, because only etcd knows whether the lease
    survived (a restarted etcd extends its leases). When etcd answers that the
    lease is gone, `lost` is set and the keeper stops; it never grants a
    replacement — the owner decides (a worker re-registers, a control plane
    re-campaigns). Not thread-safe; one event loop.
    """

    def __init__(self, client: aetcd.Client, ttl_s: int = DEFAULT_LEASE_TTL_S, *, name: str = "lease") -> None:
        if not isinstance(ttl_s, int) or ttl_s < 1:
            raise ValueError(f"ttl_s must be a positive integer, got {ttl_s!r}")
        self._client = client
        self._ttl_s = ttl_s
        self._name = name
        self._task: asyncio.Task[None] | None = None
        self.lease_id: int | None = None
        self.lost = asyncio.Event()
        """Set once the lease is no longer held: etcd reported it gone, or close() ended it."""

    @property
    def ttl_s(self) -> int:
        return self._ttl_s

    async def start(self) -> int:
        """Grants the lease and starts refreshing it; returns the lease id."""
        if self._task is not None:
            raise RuntimeError(f"{self._name} keeper already started (lease {self.lease_id})")
        lease = await self._client.lease(self._ttl_s)
        self.lease_id = lease.id
        self._task = asyncio.create_task(self._keep_alive(), name=f"{self._name}-keepalive")
        return lease.id

    async def _keep_alive(self) -> None:
        period = self._ttl_s / 3
        delay = period
        unreachable_since: float | None = None
        while True:
            await asyncio.sleep(delay)
            try:
                reply = await asyncio.wait_for(self._client.refresh_lease(self.lease_id), timeout=max(period, 1.0))
            except (TimeoutError, aetcd.ClientError) as e:
                if unreachable_since is None:
                    unreachable_since = time.monotonic()
                    log.warning("%s %x: refresh failed (%s); retrying", self._name, self.lease_id, e)
                delay = min(period, 0.5)
                continue
            if reply.TTL <= 0:
                log.warning("%s %x: etcd reports the lease gone", self._name, self.lease_id)
                self.lost.set()
                return
            if unreachable_since is not None:
                log.info(
                    "%s %x: refreshed again after %.1f s", self._name, self.lease_id, time.monotonic() - unreachable_since
                )
                unreachable_since = None
            delay = period

    async def close(self, *, revoke: bool = True) -> None:
        """Stops refreshing; with `revoke`, also ends the lease now (its keys vanish at once).

        Without `revoke` the lease runs out after its TTL, as if the process had died.
        """
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if revoke and self.lease_id is not None and not self.lost.is_set():
            try:
                await asyncio.wait_for(self._client.revoke_lease(self.lease_id), timeout=2.0)
            except (TimeoutError, aetcd.ClientError) as e:
                log.warning("%s %x: revoke failed (%s); it expires in %d s", self._name, self.lease_id, e, self._ttl_s)
        self.lost.set()
