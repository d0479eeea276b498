"""Generated gRPC code of the splitserve.v1 API; do not edit.

Written by `python -m splitserve.proto.generate` with grpcio-tools 1.85.1
from proto/splitserve/v1/*.proto. Modules:

    splitserve.proto.v1.common_pb2(_grpc)
    splitserve.proto.v1.control_plane_pb2(_grpc)
    splitserve.proto.v1.decode_worker_pb2(_grpc)
    splitserve.proto.v1.handoff_pb2(_grpc)
    splitserve.proto.v1.kv_events_pb2(_grpc)
    splitserve.proto.v1.prefill_worker_pb2(_grpc)
    splitserve.proto.v1.router_pb2(_grpc)
"""
