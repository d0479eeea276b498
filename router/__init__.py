"""splitserve.router: prefix-aware, load-aware routing and prefill -> decode orchestration (no torch).

Pure (unit-testable, no I/O):
    snapshot.py         WorkerState, Snapshot, RoutingDecision: a policy's input and output
    policy.py           load_balanced, longest_prefix, first_prefix_block, scored; decode choice; route()
    prefix_index.py     PrefixIndex: block hash -> workers bitmask, one-pass longest-prefix lookup
    approximate.py      RoutedPrefixes: index what was routed, with a TTL (no KV events)
    load.py             LoadTracker: requests in flight per worker (+ worker reports)
    workers.py          WorkerEndpoint, routable_workers(topology)
    request_run.py      RequestRun book-keeping, retry rules (handoff reuse, recompute)
    messages.py         typed requests, chunks, worker replies, KV events
State:
    cluster_view.py     ClusterView: workers + index + load -> Snapshot; block-size checks
Network:
    kv_events.py        KVEventSubscriber: ZMQ SUB of every worker, gap detection, GetBlockSet resync
    topology_watcher.py TopologyWatcher: the control plane's WatchTopology, reconnecting
    worker_client.py    GrpcWorkerClient: Prefill / Decode / Abort / GetBlockSet calls
    orchestrator.py     Orchestrator: decide, prefill, decode, relay; retries, cancellation, admission
    service.py          Router gRPC servicer; the only proto <-> dataclass conversion
    server.py, cli.py   RouterServer, `splitserve router` flags
Benchmark:
    bench.py            `splitserve bench router`: a Mooncake trace through ClusterView + policies, vs an oracle
The workers' side of KV events is engine/kv_events.py (KVEventPublisher).
"""
