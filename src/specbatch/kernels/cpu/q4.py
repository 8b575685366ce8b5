"""4-bit blocks for decode and verify rows: a linear a checkpoint shipped as affine 4-bit blocks
(the embedded target's GGUF is Q4_1: 32 weights a group, a float16 scale and bias each) holds
their float32 values, ``q * scale + bias`` rounded once (what MLX's ``quantized_matmul`` computes
with float32 activations, and llama.cpp's Q4_1), and is read as those blocks by up to 32 token
rows: 0.75 bytes a weight instead of 4 (the kernel keeps its own copy, nibbles repacked and
scales widened). Every weight the kernel rebuilds is the matrix's own value and every sum the
float32 path's, bit for bit (``register`` checks the whole matrix first; prefill's wider inputs
read the matrix itself).

Where the kernel reads blocks (the extension on AVX-512, or AVX2 with FMA: an 8-lane tile that
computes each value in one FMA), ``dequantize`` gives those linears their float32 values;
elsewhere (no extension, ``SPECBATCH_Q4=0``) mlx-lm's dequantization stands: float16
arithmetic, whose values a float16 matrix holds exactly (``half``).

Vocabulary: *blocks* are a matrix's (q, scales, biases) as MLX's ``QuantizedLinear`` holds them.
"""

from __future__ import annotations

import os
import weakref

import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx.utils import tree_unflatten

log = structlog.get_logger(__name__)

ENV = "SPECBATCH_Q4"


def blocks_of(model: nn.Module) -> dict:
    """The 4-bit, group-32, affine, float16-scaled blocks of ``model``'s quantized linears by
    module path (before the model is dequantized)."""
    return {name: (m.weight, m.scales, m.biases) for name, m in model.named_modules()
            if isinstance(m, nn.QuantizedLinear) and m.bits == 4 and m.group_size == 32
            and getattr(m, "mode", "affine") == "affine" and m.scales.dtype == mx.float16
            and m.get("biases") is not None}


def reads_here(ext) -> bool:
    """Whether this process reads 4-bit blocks (the extension running, not switched off)."""
    return ext is not None and ext.isa() in ("avx512", "avx2") and os.environ.get(ENV, "1") != "0"


def dequantize(ext, model: nn.Module, blocks: dict) -> int:
    """Swap each of ``blocks``' linears for one holding their float32 values (``q * scale +
    bias`` in float32, what the kernel reads) where this process reads blocks; returns how many.
    Anything else (the embedding, other layouts) is left to mlx-lm's dequantization."""
    if not blocks or not reads_here(ext):
        return 0
    swaps = []
    for name, m in model.named_modules():
        if name not in blocks:
            continue
        weight = mx.dequantize(m.weight, m.scales.astype(mx.float32), m.biases.astype(mx.float32),
                               group_size=m.group_size, bits=m.bits)  # [out, in], float32 arithmetic
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
        linear.weight = weight
        if "bias" in m:
            linear.bias = m["bias"]
        swaps.append((name, linear))
    model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def register(ext, model: nn.Module, blocks: dict) -> int:
    """Hand the kernels each linear's blocks where they rebuild it exactly (the module's
    ``_sb_q4_bytes`` says how many bytes a decode row then reads: the kernel keeps its own
    copy, repacked); returns how many matrices read them."""
    if not blocks or not reads_here(ext):
        return 0
    done = held = 0
    for name, m in model.named_modules():
        parts = blocks.get(name)
        if parts is None or getattr(m, "weight", None) is None or m["weight"].dtype not in (mx.float32, mx.float16):
            continue
        if nbytes := ext.q4_register(m["weight"], *parts):
            m._sb_q4_bytes = nbytes  # what a decode row reads of it
            weakref.finalize(m, ext.q4_forget, m["weight"])  # the registry holds its copy until the module goes
            done, held = done + 1, held + nbytes
    if done:
        log.info("q4_blocks", matrices=done, of=len(blocks), mb=round(held / 2**20, 1))
    return done


def reads_blocks(module: nn.Module) -> bool:
    """Decode rows read ``module``'s registered 4-bit blocks, not its weight."""
    return getattr(module, "_sb_q4_bytes", 0) > 0


def decode_bytes(module: nn.Module) -> int:
    """The bytes a decode row reads of ``module``'s weight: its blocks' where registered."""
    return module._sb_q4_bytes if reads_blocks(module) else module["weight"].nbytes
