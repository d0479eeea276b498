"""Leader election among control-plane replicas: a lease plus a create-if-absent transaction.

Every replica campaigns with ``put(leader, me, lease=my_lease) if
create_revision(leader) == 0``. The winner leads while the key exists; the
others watch it and campaign again when it is deleted, which etcd does as
soon as the leader resigns (revokes its lease) or, if it died, when its
lease expires — so a standby takes over within one TTL plus etcd's expiry
tick (0.5 s).

The leader key's create_revision is a fencing token: every leader-only write
compares it (see cluster_store.py), so a replica that lost leadership without
noticing (a long pause) cannot overwrite its successor's decisions.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import aetcd

from splitserve.control_plane.errors import NotLeaderError
from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.records import LeaderRecord
from splitserve.control_plane.registry import DEFAULT_LEASE_TTL_S, LeaseKeeper

log = logging.getLogger(__name__)

STOP_TIMEOUT_S = 3.0
"""How long `close` waits for the campaign to stop (its cleanup cancels an etcd watch, an RPC
that a stalled etcd could keep waiting forever): past it the task is left to finish alone."""


class LeaderElection:
    """Campaigns for the leader key of `keys` on behalf of one replica (`record`).

    State is read through `is_leader`, `fence()` and `leader`; it changes
    only on the event loop's task started by `start()`.
    """

    def __init__(
        self, client: aetcd.Client, keys: ClusterKeys, record: LeaderRecord, ttl_s: int = DEFAULT_LEASE_TTL_S
    ) -> None:
        self._client = client
        self._keys = keys
        self._record = record
        self._ttl_s = ttl_s
        self._keeper: LeaseKeeper | None = None
        self._task: asyncio.Task[None] | None = None
        self._fence: int | None = None
        self._elected = asyncio.Event()
        self._is_failing = False
        self.leader: LeaderRecord | None = None
        """The last known leader (this replica's record while it leads)."""

    @property
    def is_leader(self) -> bool:
        return self._fence is not None

    def fence(self) -> int:
        """The fencing token (leader key create_revision); raises NotLeaderError on a follower."""
        if self._fence is None:
            raise NotLeaderError(self.leader)
        return self._fence

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"election-{self._record.replica_id}")

    async def wait_until_leader(self) -> None:
        await self._elected.wait()

    async def close(self, *, resign: bool = True) -> None:
        """Stops campaigning. `resign` revokes the lease, which deletes the leader key at once;
        without it the key stays until the lease runs out, as if this process had frozen."""
        if self._task is not None:
            self._task.cancel()
            done, _ = await asyncio.wait({self._task}, timeout=STOP_TIMEOUT_S)
            if not done:
                log.warning("replica %s: the campaign did not stop within %.0f s; leaving it behind",
                            self._record.replica_id, STOP_TIMEOUT_S)
            elif not self._task.cancelled() and self._task.exception() is not None:
                log.warning("replica %s: the campaign had failed: %r", self._record.replica_id, self._task.exception())
        if self._keeper is not None:
            await self._keeper.close(revoke=resign)
        self._step_down()

    def _step_down(self) -> None:
        if self._fence is not None:
            log.info("replica %s stops leading", self._record.replica_id)
        self._fence = None
        self._elected.clear()
        if self.leader == self._record:
            self.leader = None

    async def _run(self) -> None:
        while True:
            try:
                await self._campaign_once()
            except (TimeoutError, aetcd.ClientError) as e:
                # Warn once per outage, not every retry.
                level = logging.DEBUG if self._is_failing else logging.WARNING
                log.log(level, "replica %s: election round failed (%s); retrying", self._record.replica_id, e)
                self._is_failing = True
                self._step_down()
                await asyncio.sleep(0.5)

    async def _campaign_once(self) -> None:
        if self._keeper is None or self._keeper.lost.is_set():
            if self._keeper is not None:
                await self._keeper.close(revoke=False)
                self._keeper = None
            keeper = LeaseKeeper(self._client, self._ttl_s, name="leader-lease")
            await keeper.start()
            # Only a started keeper is kept: a put with no lease id would make a leader key that never expires.
            self._keeper = keeper
        tx = self._client.transactions
        key = self._keys.leader
        won, responses = await self._client.transaction(
            compare=[tx.create(key) == 0],
            success=[tx.put(key, self._record.encode(), lease=self._keeper.lease_id)],
            failure=[tx.get(key)],
        )
        self._is_failing = False
        if won:
            fence = responses[0].response_put.header.revision
            watch_from = fence + 1
        else:
            if not responses[0]:
                return  # deleted between compare and get: campaign again
            value, current = responses[0][0]
            watch_from = current.mod_revision + 1
            # Our own key from before a transient error: we still lead.
            fence = current.create_revision if current.lease == self._keeper.lease_id else None
            if fence is None:
                self.leader = LeaderRecord.decode(value)
        if fence is not None:
            if self._fence is None:
                log.info("replica %s leads (fence %d)", self._record.replica_id, fence)
            self._fence = fence
            self.leader = self._record
            self._elected.set()
        await self._wait_for_vacancy(watch_from)
        self._step_down()
        self.leader = None

    async def _wait_for_vacancy(self, start_revision: int) -> None:
        """Returns once the leader key is deleted (or our lease is lost)."""
        watch = await self._client.watch(self._keys.leader, start_revision=start_revision)

        async def deleted() -> None:
            async for event in watch:
                if event.kind == aetcd.EventKind.DELETE:
                    return

        watcher = asyncio.create_task(deleted())
        lost = asyncio.create_task(self._keeper.lost.wait())
        try:
            done, _ = await asyncio.wait({watcher, lost}, return_when=asyncio.FIRST_COMPLETED)
            if watcher in done:
                watcher.result()  # re-raise a watch failure so _run retries
        finally:
            for task in (watcher, lost):
                task.cancel()
            await asyncio.gather(watcher, lost, return_exceptions=True)
            with contextlib.suppress(aetcd.ClientError, TimeoutError):
                await asyncio.wait_for(watch.cancel(), STOP_TIMEOUT_S)
