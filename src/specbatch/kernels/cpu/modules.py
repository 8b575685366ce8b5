"""Swapping a loaded model's float32 linears (and a tied output head) for modules that
call :func:`specbatch.kernels.cpu.linear`, and its attention layers for ones whose
attention is :func:`specbatch.kernels.cpu.attention`; the parameters stay the same arrays,
so checkpoints, dtype changes and the drafters' shared heads see no difference.

mlx-lm's attention layers call their module's ``scaled_dot_product_attention``; that name is
wrapped once per model module, and the wrapper takes the kernel only while a swapped layer
is running, so an mlx-lm model loaded beside ours (the benchmarks' baseline) is untouched."""

from __future__ import annotations

import sys
import threading

import mlx.core as mx
import mlx.nn as nn

from . import attention, extension, linear

_inside = threading.local()  # set while a swapped attention layer runs on this thread


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


def _wrap_sdpa(module_name: str) -> bool:
    """Wrap ``module_name``'s ``scaled_dot_product_attention`` (once); False where it has none."""
    mod = sys.modules.get(module_name)
    original = getattr(mod, "scaled_dot_product_attention", None)
    if original is None:
        return False
    if getattr(original, "_specbatch", False):
        return True

    def sdpa(queries, keys, values, cache=None, scale=1.0, mask=None, sinks=None):
        if getattr(_inside, "on", False) and sinks is None and not hasattr(cache, "bits"):
            return attention(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    sdpa._specbatch = True
    mod.scaled_dot_product_attention = sdpa
    return True


_fast_classes: dict[type, type] = {}


def _fast_attention_class(cls: type) -> type:
    """``cls`` with its call marked, so the wrapped attention takes the kernel inside it."""
    if cls not in _fast_classes:
        def __call__(self, *args, **kwargs):
            _inside.on = True
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
                _inside.on = False
        _fast_classes[cls] = type(f"Fast{cls.__name__}", (cls,), {"__call__": __call__})
    return _fast_classes[cls]


def _swap_attention(module: nn.Module) -> bool:
    cls = type(module)
    if cls.__name__ != "Attention" or cls in _fast_classes.values() or not _wrap_sdpa(cls.__module__):
        return False
    module.__class__ = _fast_attention_class(cls)
    return True


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
    for _, child in model.named_modules():
        swapped += _swap_attention(child)
    for _, child in model.named_modules():
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
