"""4-bit blocks for decode rows: a half-stored linear (:mod:`.half`) that a checkpoint shipped
as affine 4-bit blocks (the embedded target's GGUF is Q4_1: 32 weights a group, a float16
scale and bias each) is also read as those blocks by 1-4 token rows (decode steps at widths
1-4, verifies of up to 4 positions): 0.75 bytes a weight instead of 2 (the kernel keeps its own
copy, nibbles repacked and scales widened). The kernel rebuilds each group's 16 values as
MLX's dequantize rounds them, so every weight it reads is the float16 matrix's and every sum
the float16 path's, bit for bit; ``register`` checks the whole matrix first and keeps the
float16 path where a block set does not rebuild it. ``SPECBATCH_Q4=0`` reads float16 only.

Vocabulary: *blocks* are a matrix's (q, scales, biases) as MLX's ``QuantizedLinear`` holds them.
"""

from __future__ import annotations

import os
import weakref

import mlx.core as mx
import mlx.nn as nn
import structlog

log = structlog.get_logger(__name__)

ENV = "SPECBATCH_Q4"


def blocks_of(model: nn.Module) -> dict:
    """The 4-bit, group-32, affine, float16-scaled blocks of ``model``'s quantized linears by
    module path (before the model is dequantized)."""
    return {name: (m.weight, m.scales, m.biases) for name, m in model.named_modules()
            if isinstance(m, nn.QuantizedLinear) and m.bits == 4 and m.group_size == 32
            and getattr(m, "mode", "affine") == "affine" and m.scales.dtype == mx.float16
            and m.get("biases") is not None}


def register(ext, model: nn.Module, blocks: dict) -> int:
    """Hand the kernels each half-stored linear's blocks where they rebuild it exactly (the
    module's ``_sb_q4_bytes`` says how many bytes a decode row then reads: the kernel keeps its
    own copy, repacked); returns how many matrices read them."""
    if ext is None or not blocks or os.environ.get(ENV, "1") == "0":
        return 0
    done = held = 0
    for name, m in model.named_modules():
        parts = blocks.get(name)
        if parts is None or getattr(m, "weight", None) is None or m["weight"].dtype != mx.float16:
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
