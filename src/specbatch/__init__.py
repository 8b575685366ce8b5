"""specbatch: speculative decoding and continuous batching together, on MLX.

The public names load lazily (PEP 562 ``__getattr__``): ``from specbatch import Engine``
works as before, while tools that need no kernels (``specbatch statechart --check``,
the machine's table) import without loading MLX.
"""

import importlib

from .openblas import preload_in_process as _preload_blas

_preload_blas()  # before anything imports MLX: its BLAS calls then bind to OpenBLAS

from .logs import configure_default as _configure_logs  # noqa: E402

_configure_logs()

_EXPORTS = {
    "Engine": ".runtime.engine", "EngineCore": ".runtime.core", "StepEvent": ".runtime.output",
    "SamplingParams": ".runtime.params", "TokenLogprob": ".runtime.params",
    "Completion": ".runtime.request", "RequestHandle": ".runtime.request", "TokenEvent": ".runtime.request",
    "Usage": ".runtime.request", "from_pretrained": ".kernels.build",
    "InvalidRequest": ".errors", "EngineClosed": ".errors", "QueueFull": ".errors",
}
__all__ = list(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specbatch' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])
