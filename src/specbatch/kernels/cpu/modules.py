"""Swapping a loaded model's float32 linears (and a tied output head) for modules that
call :func:`specbatch.kernels.cpu.linear`; the parameters stay the same arrays, so
checkpoints, dtype changes and the drafters' shared heads see no difference."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from . import extension, linear


class FastLinear(nn.Linear):
    """``nn.Linear`` whose matmul is the small-M CPU kernel where it applies (still an
    ``nn.Linear``: MLX's sharding and quantization helpers take it as one)."""

    def __init__(self, weight: mx.array, bias: mx.array | None):
        nn.Module.__init__(self)
        self.weight = weight  # [out, in]
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        y = linear(x, self.weight)
        return y + self.bias if "bias" in self else y


class FastEmbedding(nn.Embedding):
    """A tied embedding whose ``as_linear`` (the output head) uses the CPU kernel."""

    def __init__(self, weight: mx.array):
        nn.Module.__init__(self)
        self.weight = weight  # [vocab, dims]

    def as_linear(self, x: mx.array) -> mx.array:
        return linear(x, self.weight)


def _swap(module: nn.Module) -> nn.Module | None:
    if type(module) is nn.Linear and module.weight.dtype == mx.float32:
        return FastLinear(module.weight, module.get("bias"))
    if type(module) is nn.Embedding and module.weight.dtype == mx.float32:
        return FastEmbedding(module.weight)
    return None


def use_cpu_kernels(model: nn.Module) -> int:
    """Swap ``model``'s float32 ``nn.Linear``/``nn.Embedding`` children in place; returns how
    many were swapped (0 where the kernels are inactive: the model is left as it was)."""
    if extension() is None:
        return 0
    swapped = 0
    for path, child in model.named_modules():
        for name in list(child.children()):
            value = child[name]  # the module's own list, not a copy, so items swap in place
            items = value if isinstance(value, list) else [value]
            for index, item in enumerate(items):
                new = _swap(item) if isinstance(item, nn.Module) else None
                if new is None:
                    continue
                if isinstance(value, list):
                    value[index] = new
                else:
                    setattr(child, name, new)
                swapped += 1
    return swapped
