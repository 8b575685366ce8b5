"""Kernels the machine drives through Protocols: the target runner, drafters, decode
loops, KV caches, the sampler, the prompt cache, and model loading (mlx-lm folders, GGUF).
``build`` joins them to the machine."""
