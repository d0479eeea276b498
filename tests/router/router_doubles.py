"""Protocol-level test doubles of the PrefillWorker and DecodeWorker gRPC services.

They speak the real protos over real gRPC servers on 127.0.0.1 and follow
the contract written in decode_worker.proto, without an engine:

* Prefill answers a handoff whose first token is `first_token_of(prompt)`;
  its num_cached_tokens and block set are whatever the test sets. PrefillStream
  sends that token first (with FINISH_REASON_LENGTH when it is the only one to
  generate), then the same response; `hold_result` holds the response back and
  `fail_after_first` fails the stream between the two (the first token is out);
  `send_preview` sends a handoff_started preview first (layer-wise streaming), and
  `fail_after_preview` fails the stream right after it.
* Decode with a handoff echoes the handoff's first token as the first
  token of its first chunk, then continues `token + 1, token + 2, ...`;
  without a handoff it "prefills" itself and starts at
  `first_token_of(prompt)`. One token per chunk; the last chunk says LENGTH.
* Prefetch records the preview's request id in `prefetched` (and `events`), after
  `prefetch_delay_s`, and answers `prefetch_accepts`.
* Abort ends a running decode with FINISH_REASON_ABORT and is recorded.
* Failures are injected per call (`fail_with`); `hold` makes a call wait
  (for cancellation tests).

The lead's end-to-end tests run the real workers; these pin down the
router's side of the protocol: retries, first-token-once, cancellation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import grpc

from splitserve.control_plane.shard_spec import Role
from splitserve.proto.v1 import (
    common_pb2,
    decode_worker_pb2,
    decode_worker_pb2_grpc,
    handoff_pb2,
    prefill_worker_pb2,
    prefill_worker_pb2_grpc,
)
from splitserve.router.workers import WorkerEndpoint


def first_token_of(token_ids) -> int:
    return (sum(token_ids) * 7 + len(token_ids)) % 1000


class PrefillDouble(prefill_worker_pb2_grpc.PrefillWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.requests: list[prefill_worker_pb2.PrefillRequest] = []
        self.aborted: list[str] = []
        self.fail_with: list[grpc.StatusCode] = []
        self.hold: asyncio.Event | None = None
        self.hold_result: asyncio.Event | None = None
        """PrefillStream: wait for it between the first token and the response."""
        self.fail_after_first: list[grpc.StatusCode] = []
        """PrefillStream: fail with these after the first token, instead of sending the response."""
        self.send_preview = False
        self.fail_after_preview: list[grpc.StatusCode] = []
        self.after_preview_s = 0.0
        """PrefillStream: seconds between the preview and what follows it (the forward pass)."""
        self.num_cached_tokens = 0
        self.lease_s = 30.0
        self.block_set = prefill_worker_pb2.BlockSet()
        self.block_set_source = None
        """A callable returning the BlockSet to answer (a live cache), else `block_set`."""
        self.num_block_set_calls = 0

    async def Prefill(self, request, context):
        self.requests.append(request)
        if self.fail_with:
            await context.abort(self.fail_with.pop(0), f"injected failure on {self.worker_id}")
        if self.hold is not None:
            await self.hold.wait()
        return self._response(request)

    async def PrefillStream(self, request, context):
        self.requests.append(request)
        if self.fail_with:
            await context.abort(self.fail_with.pop(0), f"injected failure on {self.worker_id}")
        if self.hold is not None:
            await self.hold.wait()
        response = self._response(request)
        handoff = response.handoff
        if self.send_preview:
            preview = handoff_pb2.HandoffDescriptor(request_id=request.request_id, num_tokens=len(request.token_ids),
                                                    progress_slot=0)  # fmt: skip
            yield prefill_worker_pb2.PrefillEvent(handoff_started=preview)
            await asyncio.sleep(self.after_preview_s)
            if self.fail_after_preview:
                await context.abort(self.fail_after_preview.pop(0), f"injected failure after the preview on {self.worker_id}")
        first = prefill_worker_pb2.PrefillFirstToken(token_id=handoff.first_token_id, finish_reason=response.finish_reason)
        if handoff.HasField("first_token_logprob"):
            first.logprob = handoff.first_token_logprob
        yield prefill_worker_pb2.PrefillEvent(first_token=first)
        if self.hold_result is not None:
            await self.hold_result.wait()
        if self.fail_after_first:
            await context.abort(self.fail_after_first.pop(0), f"injected failure after the first token on {self.worker_id}")
        yield prefill_worker_pb2.PrefillEvent(response=response)

    def _response(self, request) -> prefill_worker_pb2.PrefillResponse:
        params = request.sampling_params
        handoff = handoff_pb2.HandoffDescriptor(
            request_id=request.request_id, first_token_id=first_token_of(request.token_ids),
            num_tokens=len(request.token_ids), lease_deadline_unix_ms=int((time.time() + self.lease_s) * 1e3),
        )  # fmt: skip
        if params.return_log_probs:
            handoff.first_token_logprob = -0.5
        finish = common_pb2.FINISH_REASON_LENGTH if params.num_tokens_to_generate == 1 else 0
        return prefill_worker_pb2.PrefillResponse(
            handoff=handoff, num_cached_tokens=self.num_cached_tokens, finish_reason=finish
        )

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        return common_pb2.AbortResponse(was_found=True)

    async def Release(self, request, context):
        return prefill_worker_pb2.ReleaseResponse(was_pinned=True)

    async def GetBlockSet(self, request, context):
        self.num_block_set_calls += 1
        return self.block_set_source() if self.block_set_source else self.block_set


class DecodeDouble(decode_worker_pb2_grpc.DecodeWorkerServicer):
    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.requests: list[decode_worker_pb2.DecodeRequest] = []
        self.aborted: list[str] = []
        self.fail_with: list[grpc.StatusCode] = []
        self.hold_after_first: asyncio.Event | None = None
        self.hold_after_index = 0
        """`hold_after_first` waits after the chunk of this index (0: the first)."""
        self.hold_only_with_handoff = False
        """Hold only calls that carry a handoff (not a recomputing retry)."""
        self.num_cached_tokens = 0
        self.block_set = prefill_worker_pb2.BlockSet()
        self.block_set_source = None
        self.num_block_set_calls = 0
        self._abort_events: dict[str, asyncio.Event] = {}
        self.prefetched: list[str] = []
        self.prefetch_delay_s = 0.0
        self.prefetch_accepts = True
        self.prefetch_hangs: list[float] = []
        """Each Prefetch pops one and does not answer for that many seconds (shareable between doubles)."""
        self.events: list[tuple[str, str]] = []
        """(method, request id) in the order calls completed (Prefetch) or began (Decode)."""

    async def Prefetch(self, request, context):
        await asyncio.sleep(self.prefetch_hangs.pop(0) if self.prefetch_hangs else self.prefetch_delay_s)
        self.prefetched.append(request.request_id)
        self.events.append(("Prefetch", request.request_id))
        return decode_worker_pb2.PrefetchResponse(accepted=self.prefetch_accepts,
                                                  reason="" if self.prefetch_accepts else "declined by the double")

    async def Decode(self, request, context):
        self.requests.append(request)
        self.events.append(("Decode", request.request_id))
        if self.fail_with:
            await context.abort(self.fail_with.pop(0), f"injected failure on {self.worker_id}")
        aborted = self._abort_events.setdefault(request.request_id, asyncio.Event())
        params = request.sampling_params
        has_handoff = request.HasField("handoff")
        token = request.handoff.first_token_id if has_handoff else first_token_of(request.token_ids)
        for index in range(params.num_tokens_to_generate):
            chunk = decode_worker_pb2.DecodeChunk(token_ids=[token + index])
            if params.return_log_probs:
                chunk.logprobs.append(-1.0 - index)
            if index == 0 and not has_handoff:
                chunk.num_cached_tokens = self.num_cached_tokens
            if index == params.num_tokens_to_generate - 1:
                chunk.finish_reason = common_pb2.FINISH_REASON_LENGTH
            yield chunk
            is_held = self.hold_after_first is not None and (has_handoff or not self.hold_only_with_handoff)
            if index == self.hold_after_index and is_held:
                waits = [asyncio.ensure_future(self.hold_after_first.wait()), asyncio.ensure_future(aborted.wait())]
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
                for waiter in waits:
                    waiter.cancel()
            if aborted.is_set():
                yield decode_worker_pb2.DecodeChunk(finish_reason=common_pb2.FINISH_REASON_ABORT)
                return

    async def Abort(self, request, context):
        self.aborted.append(request.request_id)
        self._abort_events.setdefault(request.request_id, asyncio.Event()).set()
        return common_pb2.AbortResponse(was_found=True)

    async def GetBlockSet(self, request, context):
        self.num_block_set_calls += 1
        return self.block_set_source() if self.block_set_source else self.block_set


@contextlib.asynccontextmanager
async def serving(*doubles):
    """Serves each double on its own 127.0.0.1 port; yields {worker_id: WorkerEndpoint}."""
    servers, endpoints = [], {}
    for double in doubles:
        server = grpc.aio.server()
        if isinstance(double, PrefillDouble):
            prefill_worker_pb2_grpc.add_PrefillWorkerServicer_to_server(double, server)
            role = Role.PREFILL
        else:
            decode_worker_pb2_grpc.add_DecodeWorkerServicer_to_server(double, server)
            role = Role.DECODE
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        endpoints[double.worker_id] = WorkerEndpoint(double.worker_id, f"127.0.0.1:{port}", role,
                                                     tp=getattr(double, "tp", 1))
    try:
        yield endpoints
    finally:
        for server in servers:
            await server.stop(0)
