"""Reads and writes of the cluster state in etcd (key layout: keys.py). No policy here.

Every write a leader makes is one transaction that also compares the leader
key's create_revision with the caller's fencing token (election.py), so a
deposed leader's write fails instead of clobbering its successor's.
Writes return the etcd revision they landed at, or None when a comparison
failed (a lost race or lost leadership: the caller re-reads and decides).
"""

from __future__ import annotations

from collections.abc import Iterable

import aetcd

from splitserve.control_plane.errors import LeaseNotAliveError, SpecMismatchError, WorkerNotFoundError
from splitserve.control_plane.keys import ClusterKeys
from splitserve.control_plane.lifecycle import LifecycleStatus
from splitserve.control_plane.records import LeaderRecord, WorkerRecord
from splitserve.control_plane.shard_spec import ShardSpec, parse_inference_shards
from splitserve.control_plane.topology import Topology, topology_from_kvs


async def read_leader(client: aetcd.Client, keys: ClusterKeys) -> tuple[LeaderRecord | None, int | None]:
    """(leader record, its fencing token) or (None, None) when nobody leads."""
    result = await client.get(keys.leader)
    if result is None:
        return None, None
    return LeaderRecord.decode(result.value), result.create_revision


class ClusterStore:
    """The cluster's etcd state for one spec; safe to share between tasks of one event loop."""

    def __init__(self, client: aetcd.Client, keys: ClusterKeys, spec: ShardSpec) -> None:
        self.client = client
        self.keys = keys
        self.spec = spec

    async def ensure_spec(self) -> None:
        """Records the spec on first start; raises SpecMismatchError if etcd holds a different one.

        Slot ids only mean something for one spec, so a replica started with
        another spec must not act on the stored assignments.
        """
        tx = self.client.transactions
        created, responses = await self.client.transaction(
            compare=[tx.create(self.keys.spec) == 0],
            success=[tx.put(self.keys.spec, self.spec.to_text().encode())],
            failure=[tx.get(self.keys.spec)],
        )
        if created or not responses[0]:
            return
        stored = responses[0][0][0].decode()
        if parse_inference_shards(stored) != self.spec:
            raise SpecMismatchError(
                f"cluster {self.keys.root.decode()!r} in etcd was created with --inference-shards "
                f"{stored!r}, this replica has {self.spec.to_text()!r}; use another --cluster "
                f"or delete the old cluster's keys (etcdctl del --prefix {self.keys.root.decode()})"
            )

    async def read_topology(self) -> Topology:
        result = await self.client.get_prefix(self.keys.root)
        kvs = [(kv.key, kv.value, kv.lease) for kv in result.kvs]
        return topology_from_kvs(self.keys, self.spec, result.header.revision, kvs)

    async def watch(self, start_revision: int) -> aetcd.Watch:
        """Every change under the cluster's root from `start_revision` on."""
        return await self.client.watch_prefix(self.keys.root, start_revision=start_revision)

    async def read_leader(self) -> tuple[LeaderRecord | None, int | None]:
        return await read_leader(self.client, self.keys)

    async def is_lease_alive(self, lease_id: int) -> bool:
        info = await self.client.get_lease_info(lease_id, keys=False)
        return info.TTL > 0

    async def commit_registration(
        self, record: WorkerRecord, lease_id: int, slot_ids: Iterable[int], fence: int
    ) -> int | None:
        """Writes the worker and its slot keys on its lease, if the slots and the worker id are free."""
        tx = self.client.transactions
        worker_key = self.keys.worker(record.worker_id)
        slot_keys = [self.keys.slot(slot_id) for slot_id in slot_ids]
        try:
            ok, responses = await self.client.transaction(
                compare=[
                    tx.create(self.keys.leader) == fence,
                    tx.create(worker_key) == 0,
                    *(tx.create(key) == 0 for key in slot_keys),
                ],
                success=[
                    tx.put(worker_key, record.encode(), lease=lease_id),
                    *(tx.put(key, record.worker_id.encode(), lease=lease_id) for key in slot_keys),
                ],
                failure=[],
            )
        except aetcd.ClientError as e:
            if "lease not found" in str(e):
                raise LeaseNotAliveError(f"etcd lease {lease_id:x} of worker {record.worker_id!r} is not alive") from e
            raise
        return responses[0].response_put.header.revision if ok else None

    async def mark_draining(self, worker_id: str, fence: int) -> int | None:
        """Puts draining/<worker_id> on the worker's own lease, so it goes when the worker does."""
        current = await self.client.get(self.keys.worker(worker_id))
        if current is None:
            raise WorkerNotFoundError(f"worker {worker_id!r} is not registered")
        tx = self.client.transactions
        ok, responses = await self.client.transaction(
            compare=[
                tx.create(self.keys.leader) == fence,
                tx.create(self.keys.worker(worker_id)) == current.create_revision,
            ],
            success=[tx.put(self.keys.draining(worker_id), b"", lease=current.lease)],
            failure=[],
        )
        return responses[0].response_put.header.revision if ok else None

    async def read_lifecycle(self) -> tuple[LifecycleStatus, int]:
        """(status, mod revision of its key); an absent key is the default status at revision 0."""
        result = await self.client.get(self.keys.lifecycle)
        if result is None:
            return LifecycleStatus(), 0
        return LifecycleStatus.decode(result.value), result.mod_revision

    async def write_lifecycle(self, status: LifecycleStatus, expected_mod_revision: int, fence: int) -> int | None:
        """Compare-and-swap of the lifecycle key against the revision it was read at."""
        tx = self.client.transactions
        ok, responses = await self.client.transaction(
            compare=[
                tx.create(self.keys.leader) == fence,
                tx.mod(self.keys.lifecycle) == expected_mod_revision,
            ],
            success=[tx.put(self.keys.lifecycle, status.encode())],
            failure=[],
        )
        return responses[0].response_put.header.revision if ok else None
