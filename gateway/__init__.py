"""splitserve.gateway."""
