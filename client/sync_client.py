"""`Client`: the blocking SDK over the Router (generation) and ControlPlane (lifecycle, topology) services.

    from splitserve.client import Client, SamplingParams

    with Client("127.0.0.1:50061", control_plane="127.0.0.1:50051", tokenizer="default") as client:
        results = client.generate(["def fib(n):", [1, 42, 7]], SamplingParams(num_tokens_to_generate=32))
        for chunk in client.stream("import os", SamplingParams(temperature=0)):
            print(chunk.text, end="")

Thread-safe: one channel per service, shared by every call.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.client.convert import (
    ResultBuilder,
    generate_request_to_proto,
    lifecycle_from_proto,
    topology_from_proto,
)
from splitserve.client.errors import InternalError, error_from_rpc
from splitserve.client.options import ClientOptions, sync_channel
from splitserve.client.prepared import PreparedRequest, abort_request, leader_of, lifecycle_request, prepare
from splitserve.client.prompts import load_tokenizer
from splitserve.client.resume import next_try
from splitserve.client.types import (
    ClusterTopology,
    GenerateResult,
    LifecycleStatus,
    SamplingParams,
    StreamChunk,
)
from splitserve.engine.tokenizer import Tokenizer
from splitserve.proto.v1 import control_plane_pb2, control_plane_pb2_grpc, router_pb2_grpc
from splitserve.telemetry.http import TracedCall, wants_timing


class Client:
    """Blocking client of one router (and optionally its control plane)."""

    def __init__(
        self,
        router: str = "127.0.0.1:50061",
        *,
        control_plane: str | None = None,
        tokenizer: str | Path | Tokenizer | None = None,
        options: ClientOptions | None = None,
        return_timing: bool = False,
    ) -> None:
        """`tokenizer`: a model directory, "default" (the embedded model) or None (token ids only, no text)."""
        self.options = options or ClientOptions()
        self.tokenizer = load_tokenizer(tokenizer)
        self._router_address = router
        self._return_timing = return_timing
        self._channel = sync_channel(router, self.options)
        self._router = router_pb2_grpc.RouterStub(self._channel)
        self._control_plane_address = control_plane
        self._cp_channel = sync_channel(control_plane, self.options) if control_plane else None

    # ----------------------------------------------------------------- generation
    def generate(
        self, prompts, params: SamplingParams | None = None, *, request_ids: Sequence[str] | None = None,
        timeout_s: float | None = None,
    ) -> list[GenerateResult]:  # fmt: skip
        """Like `LLM.generate`: a str, a token-id list, or a list of those; results in input order (always a list)."""
        prepared, _ = prepare(prompts, params, self.tokenizer, request_ids)
        if len(prepared) == 1:
            return [self._run(prepared[0], timeout_s)]
        with ThreadPoolExecutor(max_workers=min(len(prepared), 64), thread_name_prefix="splitserve-client") as pool:
            return list(pool.map(lambda p: self._run(p, timeout_s), prepared))

    def stream(
        self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> Iterator[StreamChunk]:  # fmt: skip
        """Yields the new tokens (and text) as they come; the last chunk carries `result`.

        Leaving the loop early cancels the request on every worker.
        """
        prepared, is_single = prepare(prompt, params, self.tokenizer, None if request_id is None else [request_id])
        if not is_single:
            raise ValueError("stream() takes one prompt; use generate() for several")
        return self._stream(prepared[0], timeout_s)

    def abort(self, request_id: str) -> bool:
        """Stops a running request; False when the router does not know it (finished, or never seen)."""
        try:
            reply = self._router.Abort(abort_request(request_id), timeout=self.options.control_timeout_s,
                                       metadata=self.options.metadata)  # fmt: skip
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"Abort on {self._router_address}") from None
        return reply.was_found

    def _run(self, prepared: PreparedRequest, timeout_s: float | None) -> GenerateResult:
        for chunk in self._stream(prepared, timeout_s):
            if chunk.result is not None:
                return chunk.result
        raise InternalError(f"the Generate stream of {prepared.request_id!r} ended without a result")

    def _stream(self, prepared: PreparedRequest, timeout_s: float | None) -> Iterator[StreamChunk]:
        timeout = timeout_s if timeout_s is not None else self.options.timeout_s
        sending, builder = prepared, None
        with TracedCall("router.Generate", self.options.metadata, prepared.request_id) as traced:
            for attempt in range(1, self.options.max_attempts + 1):
                if sending is prepared:  # a first try, or one again from the start
                    builder = ResultBuilder(prepared.request_id, prepared.token_ids, self.tokenizer)
                builder.is_resumed = sending is not prepared
                request = generate_request_to_proto(sending.request_id, sending.token_ids, sending.params,
                                                    self._return_timing or wants_timing())
                call = self._router.Generate(request, timeout=timeout, metadata=traced.metadata)
                try:
                    for message in call:
                        traced.on_message(message)
                        chunk = builder.add(message)
                        yield chunk
                        if chunk.result is not None:
                            return
                    raise InternalError(f"the Generate stream of {prepared.request_id!r} ended without a finish reason")
                except grpc.RpcError as e:
                    error = error_from_rpc(e, f"Generate on {self._router_address}")
                    sending = next_try(prepared, builder.token_ids, e.code(), attempt, self.options)
                    if sending is None:
                        raise error from None
                    time.sleep(self.options.backoff_s(attempt))
                    if self.options.reconnect_wait_s:
                        try:  # READY at once unless the router is unreachable
                            grpc.channel_ready_future(self._channel).result(timeout=self.options.reconnect_wait_s)
                        except grpc.FutureTimeoutError:
                            raise error from None
                finally:
                    call.cancel()  # a no-op when finished; frees the workers when the caller stopped early

    def health(self) -> bool:
        """True when the router answers its gRPC health check with SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.options.control_timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    # -------------------------------------------------------------- control plane
    def pause(self) -> LifecycleStatus:
        """Stop scheduling cluster-wide (requests and KV are kept)."""
        return self._lifecycle("pause")

    def unpause(self) -> LifecycleStatus:
        return self._lifecycle("unpause")

    def suspend(self) -> LifecycleStatus:
        """Paused and GPU buffers freed (pause first)."""
        return self._lifecycle("suspend")

    def resume(self) -> LifecycleStatus:
        """Suspended -> paused, buffers reallocated (unpause to schedule again)."""
        return self._lifecycle("resume")

    def reload_weights(self, checkpoint_path: str | Path) -> LifecycleStatus:
        """Load new weights while suspended."""
        return self._lifecycle("reload_weights", str(checkpoint_path))

    def topology(self) -> ClusterTopology:
        stub = control_plane_pb2_grpc.ControlPlaneStub(self._require_control_plane())
        try:
            reply = stub.GetTopology(control_plane_pb2.GetTopologyRequest(), timeout=self.options.control_timeout_s,
                                     metadata=self.options.metadata)  # fmt: skip
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"GetTopology on {self._control_plane_address}") from None
        return topology_from_proto(reply)

    def _lifecycle(self, action: str, checkpoint_path: str | None = None) -> LifecycleStatus:
        request = lifecycle_request(action, checkpoint_path)
        address = self._control_plane_address
        try:
            return self._call_lifecycle(self._require_control_plane(), address, request, action)
        except _Redirect as redirect:  # a follower named the leader: ask it once
            with sync_channel(redirect.leader, self.options) as channel:
                return self._call_lifecycle(channel, redirect.leader, request, action, follow=False)

    def _call_lifecycle(self, channel, address, request, action, follow: bool = True) -> LifecycleStatus:
        stub = control_plane_pb2_grpc.ControlPlaneStub(channel)
        try:
            reply = stub.Lifecycle(request, timeout=self.options.control_timeout_s, metadata=self.options.metadata)
        except grpc.RpcError as e:
            leader = leader_of(e, e.trailing_metadata() if hasattr(e, "trailing_metadata") else None)
            if follow and leader is not None and leader != address:
                raise _Redirect(leader) from None
            raise error_from_rpc(e, f"Lifecycle({action}) on {address}") from None
        return lifecycle_from_proto(reply.lifecycle)

    def _require_control_plane(self) -> grpc.Channel:
        if self._cp_channel is None:
            raise ValueError("this call needs the control plane: pass control_plane='HOST:PORT' to the client")
        return self._cp_channel

    # ------------------------------------------------------------------ lifecycle
    def close(self) -> None:
        self._channel.close()
        if self._cp_channel is not None:
            self._cp_channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Redirect(Exception):
    def __init__(self, leader: str) -> None:
        self.leader = leader
