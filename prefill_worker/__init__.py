"""splitserve.prefill_worker."""
