"""splitserve.engine."""
