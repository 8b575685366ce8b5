"""Swapping a loaded model's float32 linears (and a tied output head) for modules that
call :func:`specbatch.kernels.cpu.linear`, its attention layers for ones whose attention is
:func:`specbatch.kernels.cpu.attention`, its RMSNorm and RoPE layers for ones that run
one kernel op each, and (llama / qwen2) its decoder blocks for ones whose residual add after
attention is one op with the norm after it; the parameters stay the same arrays, so
checkpoints, dtype changes and the drafters' shared heads see no difference.

mlx-lm's attention layers call their module's ``scaled_dot_product_attention``; that name is
wrapped once per model module, and the wrapper takes the kernel only while a swapped layer
is running, so an mlx-lm model loaded beside ours (the benchmarks' baseline) is untouched.
Over a paged cache (one with ``paged_view``) the kernel reads the pools through the block
table in place; the gathered view the cache returned stays lazy and is never computed."""

from __future__ import annotations

import sys
import threading

import numpy as np

import mlx.core as mx
import mlx.nn as nn

from . import blocks, extension, fused, half, linear, prefill_on_kernel, rms_norm, rope, rope_positions
from .edits import Tracked

_inside = threading.local()  # set while a swapped attention layer runs on this thread


class FastLinear(Tracked, nn.Linear):
    """``nn.Linear`` whose matmul is the small-M CPU kernel where it applies (still an
    ``nn.Linear``: MLX's sharding and quantization helpers take it as one)."""

    small_m = True  # the fused projections take its weight (a sharded or quantized linear is another class)

    def __init__(self, weight: mx.array, bias: mx.array | None):
        nn.Module.__init__(self)
        self.weight = weight  # [out, in]
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        y = linear(x, self["weight"])  # item access: no Module.__getattr__ in every forward
        return y + self["bias"] if "bias" in self else y


class FastEmbedding(Tracked, nn.Embedding):
    """A tied embedding whose ``as_linear`` (the output head) uses the CPU kernel."""

    def __init__(self, weight: mx.array):
        nn.Module.__init__(self)
        self.weight = weight  # [vocab, dims]

    def __call__(self, x: mx.array) -> mx.array:
        return half.widened(self["weight"][x])  # the rows looked up, widened: float32 activations

    def rows(self, ids: mx.array) -> mx.array:
        """The rows for ``ids`` as stored (float16 where half-stored), for a linear to take: read
        as their quantized blocks where the whole matrix is (``blocks.rows``)."""
        return blocks.rows(extension(), self, ids)

    def as_linear(self, x: mx.array) -> mx.array:
        return linear(x, self["weight"])


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
            return fused.attend(queries, keys, values, cache, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    sdpa._specbatch = True
    mod.scaled_dot_product_attention = sdpa
    return True


_fast_classes: dict[type, type] = {}


def _fast_class(cls: type, methods: dict) -> type:
    """``cls`` with ``methods`` overridden and its item writes counted (made once per class:
    instances keep every attribute, only their class changes)."""
    if cls not in _fast_classes:
        _fast_classes[cls] = type(f"Fast{cls.__name__}", (Tracked, cls), methods)
    return _fast_classes[cls]


def _attention_methods(cls: type) -> dict:
    copied = cls.__module__ in fused.MODULES  # its call is copied onto the fused projections

    def __call__(self, *args, **kwargs):  # marks the call: the wrapped sdpa takes the kernel inside
        out = fused.attention_call(self, *args, **kwargs) if copied else None
        if out is not None:
            return out
        _inside.on = True
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            _inside.on = False
    return {"__call__": __call__, "_sb_qkv": copied}  # a block may hand it its input norm


def _mlp_methods(cls: type) -> dict:
    def __call__(self, x):
        out = fused.mlp_call(self, x)
        return cls.__call__(self, x) if out is None else out
    return {"__call__": __call__, "_sb_mlp": True}  # a block may run it fused with the norm before it


def _block_methods(cls: type) -> dict:
    def __call__(self, x, mask=None, cache=None):
        out = fused.block_call(self, x, mask, cache)
        return cls.__call__(self, x, mask, cache) if out is None else out
    return {"__call__": __call__}


def _swap_attention(module: nn.Module) -> bool:
    cls = type(module)
    if cls in _fast_classes.values():
        return False
    if cls.__name__ == "MLP" and cls.__module__ in fused.MODULES:
        module.__class__ = _fast_class(cls, _mlp_methods(cls))
        return True
    if cls.__name__ == "TransformerBlock" and cls.__module__ in fused.MODULES:
        module.__class__ = _fast_class(cls, _block_methods(cls))
        return True
    if cls.__name__ != "Attention" or not _wrap_sdpa(cls.__module__):
        return False
    module.__class__ = _fast_class(cls, _attention_methods(cls))
    return True


def _rope_inv_freq(module: nn.Module) -> tuple[mx.array, float] | None:
    """The inverse frequencies and position scale ``mx.fast.rope`` uses for this module
    (computed as MLX computes them), or None for a RoPE variant the kernel does not cover."""
    cls = type(module)
    if cls is nn.RoPE and module.base is not None:
        half = module.dims // 2
        step = np.float32(np.log(np.float32(module.base))) / np.float32(half)
        return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * float(step)), float(module.scale)
    if cls.__name__ == "Llama3RoPE" and cls.__module__.startswith("mlx_lm."):
        return mx.reciprocal(module._freqs.astype(mx.float32)), 1.0
    return None


def _rope_methods(cls: type) -> dict:
    def __call__(self, x, offset=0):
        out = rope(x, rope_positions(offset), self._sb_inv_freq, self.dims, self.traditional, self._sb_scale)
        return cls.__call__(self, x, offset) if out is None else out

    def rope_at(self, x, positions):
        """``x`` [B, H, L, D] at explicit int32 positions [B, L]; None off the kernel."""
        return rope(x, positions, self._sb_inv_freq, self.dims, self.traditional, self._sb_scale)
    return {"__call__": __call__, "rope_at": rope_at}


def _swap_norm_or_rope(module: nn.Module) -> bool:
    cls = type(module)
    if cls is nn.RMSNorm and module.weight.dtype == mx.float32:
        module.__class__ = _fast_class(cls, {"__call__": lambda self, x: rms_norm(x, self["weight"], self.eps),
                                             "_sb_norm": True})  # a block may fuse the add before it
        return True
    freqs = _rope_inv_freq(module) if cls not in _fast_classes.values() else None
    if freqs is None:
        return False
    mx.eval(freqs[0])  # now: a lazy array made on this thread cannot be evaluated on the engine's
    module._sb_inv_freq, module._sb_scale = freqs  # underscored: not parameters
    module.__class__ = _fast_class(cls, _rope_methods(cls))
    return True


def _swap(module: nn.Module) -> nn.Module | None:
    if type(module) is nn.Linear and module.weight.dtype == mx.float32:
        return FastLinear(module.weight, module.get("bias"))
    if type(module) is nn.Embedding and module.weight.dtype == mx.float32:
        return FastEmbedding(module.weight)
    return None


def use_cpu_kernels(model: nn.Module, half_weights: bool = False) -> int:
    """Swap ``model``'s float32 ``nn.Linear``/``nn.Embedding`` children in place; returns how
    many were swapped (0 where the kernels are inactive: the model is left as it was).
    ``half_weights``: store each swapped weight as float16 where that is exact (:mod:`.half`;
    for frozen models: a trained head's optimizer would then step in float16)."""
    if extension() is None:
        return 0
    swapped, fast = 0, []
    for _, child in model.named_modules():
        swapped += _swap_attention(child) or _swap_norm_or_rope(child)
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
                fast.append(new)
    if half_weights:
        half.store_half(extension(), fast)
    if swapped:
        prefill_on_kernel(extension())  # measured here, once a process: not inside a first prefill's forward
    return swapped
