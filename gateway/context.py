"""What every handler needs, built once per gateway process."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.client import AsyncClient
from splitserve.gateway.choice_output import TokenTexts
from splitserve.gateway.config import GatewayConfig
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.model_info import ModelInfo


@dataclass
class ServingContext:
    config: GatewayConfig
    model: ModelInfo
    client: AsyncClient
    """Created inside the server's event loop (grpc.aio channels belong to one loop)."""
    token_texts: TokenTexts
    metrics: GatewayMetrics
    num_in_flight: int = 0
    """Generation requests being handled (bounded by config.max_in_flight); event-loop only."""
