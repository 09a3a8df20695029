"""Metal backend of ds4-core on MLX (Apple GPUs; MLX's CPU device elsewhere, for tests)."""
