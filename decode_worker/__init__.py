"""splitserve.decode_worker."""
