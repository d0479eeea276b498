"""splitserve.proto: the gRPC API of every splitserve process.

    proto/splitserve/v1/*.proto   sources, proto package splitserve.v1
        common.proto              Role, FinishReason, SamplingParams, log-prob and abort messages
        handoff.proto             HandoffDescriptor (prefill -> decode KV handoff) and KVLayout
        control_plane.proto       ControlPlane: Register, GetTopology, WatchTopology, Drain, Lifecycle
        prefill_worker.proto      PrefillWorker: Prefill, Release, Abort, GetBlockSet
        decode_worker.proto       DecodeWorker: Decode (server-streamed), Abort, GetBlockSet
        router.proto              Router: Generate (server-streamed), Abort
        kv_events.proto           KVEventBatch: the ZMQ payload of workers' KV-cache events
    proto/v1/                     generated Python package splitserve.proto.v1 (do not edit)
    proto/generate.py             `python -m splitserve.proto.generate [--check]` regenerates / checks it

Every process also serves the standard grpc.health.v1 service (package
grpcio-health-checking). Breaking changes go into a new version folder (v2).
"""
