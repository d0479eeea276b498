"""`AsyncClient`: the asyncio SDK; the same API as `Client`, with coroutines and async iterators.

    async with AsyncClient("127.0.0.1:50061", tokenizer="default") as client:
        [result] = await client.generate("def fib(n):", SamplingParams(temperature=0))
        async for chunk in client.stream("import os"):
            print(chunk.text, end="")

Create it inside the event loop that uses it (grpc.aio channels belong to one loop).
Cancelling the task that iterates a stream cancels the request on every worker.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
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
from splitserve.client.options import ClientOptions, async_channel
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


class AsyncClient:
    """asyncio client of one router (and optionally its control plane)."""

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
        self._channel = async_channel(router, self.options)
        self._router = router_pb2_grpc.RouterStub(self._channel)
        self._control_plane_address = control_plane
        self._cp_channel = async_channel(control_plane, self.options) if control_plane else None

    # ----------------------------------------------------------------- generation
    async def generate(
        self, prompts, params: SamplingParams | None = None, *, request_ids: Sequence[str] | None = None,
        timeout_s: float | None = None,
    ) -> list[GenerateResult]:  # fmt: skip
        """Like `LLM.generate`: results in input order (always a list); the prompts run concurrently."""
        prepared, _ = prepare(prompts, params, self.tokenizer, request_ids)
        return list(await asyncio.gather(*(self._run(p, timeout_s) for p in prepared)))

    def stream(
        self, prompt, params: SamplingParams | None = None, *, request_id: str | None = None,
        timeout_s: float | None = None,
    ) -> AsyncIterator[StreamChunk]:  # fmt: skip
        """Yields the new tokens (and text) as they come; the last chunk carries `result`."""
        prepared, is_single = prepare(prompt, params, self.tokenizer, None if request_id is None else [request_id])
        if not is_single:
            raise ValueError("stream() takes one prompt; use generate() for several")
        return self.stream_prepared(prepared[0], timeout_s)

    async def stream_token_ids(
        self, request_id: str, token_ids: list[int], params: SamplingParams, timeout_s: float | None = None
    ) -> AsyncIterator[StreamChunk]:
        """`stream` for callers that tokenize themselves (the gateway): no copying, no tokenizer."""
        async for chunk in self.stream_prepared(PreparedRequest(request_id, token_ids, params), timeout_s):
            yield chunk

    async def abort(self, request_id: str) -> bool:
        """Stops a running request; False when the router does not know it (finished, or never seen)."""
        try:
            reply = await self._router.Abort(abort_request(request_id), timeout=self.options.control_timeout_s,
                                             metadata=self.options.metadata)  # fmt: skip
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"Abort on {self._router_address}") from None
        return reply.was_found

    async def _run(self, prepared: PreparedRequest, timeout_s: float | None) -> GenerateResult:
        async for chunk in self.stream_prepared(prepared, timeout_s):
            if chunk.result is not None:
                return chunk.result
        raise InternalError(f"the Generate stream of {prepared.request_id!r} ended without a result")

    async def stream_prepared(self, prepared: PreparedRequest, timeout_s: float | None) -> AsyncIterator[StreamChunk]:
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
                    async for message in call:
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
                    await asyncio.sleep(self.options.backoff_s(attempt))
                    if self.options.reconnect_wait_s:
                        try:  # READY at once unless the router is unreachable
                            await asyncio.wait_for(self._channel.channel_ready(), self.options.reconnect_wait_s)
                        except TimeoutError:
                            raise error from None
                finally:
                    call.cancel()  # a no-op when finished; frees the workers when the caller stopped early

    async def health(self) -> bool:
        """True when the router answers its gRPC health check with SERVING."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=self.options.control_timeout_s)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    # -------------------------------------------------------------- control plane
    async def pause(self) -> LifecycleStatus:
        return await self._lifecycle("pause")

    async def unpause(self) -> LifecycleStatus:
        return await self._lifecycle("unpause")

    async def suspend(self) -> LifecycleStatus:
        return await self._lifecycle("suspend")

    async def resume(self) -> LifecycleStatus:
        return await self._lifecycle("resume")

    async def reload_weights(self, checkpoint_path: str | Path) -> LifecycleStatus:
        return await self._lifecycle("reload_weights", str(checkpoint_path))

    async def topology(self) -> ClusterTopology:
        stub = control_plane_pb2_grpc.ControlPlaneStub(self._require_control_plane())
        try:
            reply = await stub.GetTopology(control_plane_pb2.GetTopologyRequest(),
                                           timeout=self.options.control_timeout_s, metadata=self.options.metadata)  # fmt: skip
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"GetTopology on {self._control_plane_address}") from None
        return topology_from_proto(reply)

    async def _lifecycle(self, action: str, checkpoint_path: str | None = None) -> LifecycleStatus:
        request = lifecycle_request(action, checkpoint_path)
        stub = control_plane_pb2_grpc.ControlPlaneStub(self._require_control_plane())
        address = self._control_plane_address
        try:
            reply = await stub.Lifecycle(request, timeout=self.options.control_timeout_s, metadata=self.options.metadata)
            return lifecycle_from_proto(reply.lifecycle)
        except grpc.aio.AioRpcError as e:
            leader = leader_of(e, e.trailing_metadata())
            if leader is None or leader == address:
                raise error_from_rpc(e, f"Lifecycle({action}) on {address}") from None
        async with async_channel(leader, self.options) as channel:  # a follower named the leader: ask it once
            try:
                reply = await control_plane_pb2_grpc.ControlPlaneStub(channel).Lifecycle(
                    request, timeout=self.options.control_timeout_s, metadata=self.options.metadata
                )
            except grpc.RpcError as e:
                raise error_from_rpc(e, f"Lifecycle({action}) on {leader}") from None
        return lifecycle_from_proto(reply.lifecycle)

    def _require_control_plane(self) -> grpc.aio.Channel:
        if self._cp_channel is None:
            raise ValueError("this call needs the control plane: pass control_plane='HOST:PORT' to the client")
        return self._cp_channel

    # ------------------------------------------------------------------ lifecycle
    async def close(self) -> None:
        await self._channel.close()
        if self._cp_channel is not None:
            await self._cp_channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
