"""The runtime core: the machine and what it decides over, the steppable ``EngineCore``
and its thread driver ``Engine``, requests, plans, output delivery and statistics.

Nothing here imports MLX or a kernel: ``kernels.build`` (the composition root) builds the
kernels and hands them to ``EngineCore(kernels, tokenizer, config)``.
"""
