"""splitserve.control_plane: shard assignment, membership and lifecycle of a splitserve cluster (no torch).

Pure policy (unit-testable, no I/O):
    shard_spec.py           --inference-shards parser, ShardGroup / Slot expansion
    assignment.py           which slots a registering worker gets; Assignment, Peer
    topology.py             Topology snapshot, built from one etcd read
    lifecycle.py            pause / unpause / suspend / resume / reload-weights state machine
    records.py, keys.py     etcd values (JSON) and every etcd key
etcd side:
    etcd_client.py          endpoint parsing, client creation
    registry.py             LeaseKeeper: a lease kept alive by a background task
    election.py             leader election among control-plane replicas (lease + transaction)
    cluster_store.py        fenced reads / writes of the cluster state
    topology_feed.py        latest topology, followed through one etcd watch
Serving:
    controller.py           leader-only operations (register, drain, lifecycle)
    service.py              ControlPlane gRPC servicer; the only proto <-> dataclass conversion
    server.py, cli.py       one replica (serve()), `splitserve control-plane` flags
Client:
    worker_registration.py  WorkerRegistration: what a worker process uses to join the cluster
"""
