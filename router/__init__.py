"""splitserve.router."""
