"""splitserve.proto."""
