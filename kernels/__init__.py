"""splitserve.kernels."""
