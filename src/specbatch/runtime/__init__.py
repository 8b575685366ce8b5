"""The runtime core: the machine and what it decides over, the steppable ``EngineCore``
and its thread driver ``Engine``, requests, plans, output delivery and statistics.

The machine and the data it reads (``machine``, ``scheduler``, ``plan``, ``request``,
``output``, ``params``, ``schedule``, ``stats``, ``detok``) import no MLX and no kernel;
``core``, ``engine`` and ``config`` are where kernels are built and handed in.
"""
