"""splitserve.engine.models."""
