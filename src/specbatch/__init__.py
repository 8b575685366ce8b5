"""specbatch: speculative decoding and continuous batching together, on MLX."""

from .openblas import preload_in_process as _preload_blas

_preload_blas()  # before anything imports MLX: its BLAS calls then bind to OpenBLAS

from .logs import configure_default as _configure_logs  # noqa: E402

_configure_logs()

from .core import EngineCore, StepEvent  # noqa: E402
from .engine import Engine  # noqa: E402
from .errors import EngineClosed, InvalidRequest, QueueFull
from .request import Completion, RequestHandle, TokenEvent, Usage
from .sampling import SamplingParams

__all__ = ["Engine", "EngineCore", "StepEvent", "SamplingParams", "Completion", "RequestHandle",
           "TokenEvent", "Usage", "InvalidRequest", "EngineClosed", "QueueFull"]
__version__ = "0.1.0"
