"""The kernels wing: fused C kernels for the engine's passes, their build, cache and thread pool."""
