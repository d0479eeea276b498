"""splitserve.client."""
