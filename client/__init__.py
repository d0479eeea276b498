"""splitserve.client: the gRPC client SDK (sync `Client`, asyncio `AsyncClient`).

    from splitserve.client import Client, SamplingParams

    with Client("127.0.0.1:50061", control_plane="127.0.0.1:50051", tokenizer="default") as client:
        [result] = client.generate("def fib(n):", SamplingParams(num_tokens_to_generate=32, temperature=0))
        print(result.generated_text, result.usage)

Importing it does not import torch. Errors are `SplitserveError` subclasses
mapped from gRPC status codes (errors.py).
"""

from splitserve.client.async_client import AsyncClient
from splitserve.client.errors import (
    AlreadyExistsError,
    AuthenticationError,
    DeadlineExceededError,
    FailedPreconditionError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    RequestCancelledError,
    SplitserveError,
    UnavailableError,
)
from splitserve.client.options import ClientOptions, TLSConfig
from splitserve.client.sync_client import Client
from splitserve.client.types import (
    ClusterTopology,
    FinishReason,
    GenerateResult,
    LifecycleState,
    LifecycleStatus,
    RoutingInfo,
    SamplingParams,
    SlotInfo,
    StreamChunk,
    TimingInfo,
    Usage,
    WorkerInfo,
)

__all__ = [
    "AsyncClient", "Client", "ClientOptions", "TLSConfig", "SamplingParams", "GenerateResult", "StreamChunk",
    "FinishReason", "Usage", "RoutingInfo", "TimingInfo", "ClusterTopology", "SlotInfo", "WorkerInfo",
    "LifecycleState", "LifecycleStatus", "SplitserveError", "InvalidRequestError", "OverloadedError",
    "UnavailableError", "DeadlineExceededError", "FailedPreconditionError", "AlreadyExistsError", "NotFoundError",
    "AuthenticationError", "RequestCancelledError", "InternalError",
]  # fmt: skip
