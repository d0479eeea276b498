"""splitserve.engine.transfer."""
