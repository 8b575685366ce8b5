"""Quantized blocks for decode and verify rows: a matrix a checkpoint shipped as affine blocks
(the embedded target's GGUF: its linears Q4_1, its tied embedding and output head Q8_0; 32
weights a group, a float16 scale and bias each) holds their float32 values, ``q * scale + bias``
rounded once (what MLX's ``quantized_matmul`` computes with float32 activations, and llama.cpp's
Q4_1 and Q8_0), and is read as those blocks: 0.625 (4 bits) or 1.125 (8 bits) bytes a weight
instead of 4 (the kernel keeps its own copy, repacked). Every weight the kernel rebuilds is the
matrix's own value (``register`` checks the whole matrix first). The blocks serve any number of
token rows with sums of their own (each group's partial sum scaled once: within rounding of the
float32 path, ~5e-8 of sum |x w| from the exact product), so a model reading them decodes a
little differently from its float32 matrices, and every row still has the bits it has alone.

Where the kernel reads blocks (the extension on AVX-512, or AVX2 with FMA and F16C),
``dequantize`` gives those linears and embeddings their float32
values; elsewhere (no extension, ``SPECBATCH_BLOCKS=0``) mlx-lm's dequantization stands: float16
arithmetic, whose values a float16 matrix holds exactly (``half``).

Vocabulary: *blocks* are a matrix's (q, scales, biases) as MLX's ``QuantizedLinear`` and
``QuantizedEmbedding`` hold them; *bits* their width (4 or 8).
"""

from __future__ import annotations

import os
import weakref

import attrs
import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx.utils import tree_unflatten

log = structlog.get_logger(__name__)

ENV = "SPECBATCH_BLOCKS"
BITS = (4, 8)


@attrs.frozen
class Blocks:
    """One matrix's quantized blocks as MLX holds them."""

    q: mx.array  # uint32 [N, K * bits / 32]
    scales: mx.array  # float16 [N, K / 32]
    biases: mx.array  # float16 [N, K / 32]
    bits: int


def _readable(m: nn.Module) -> bool:
    return (isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.bits in BITS
            and m.group_size == 32 and getattr(m, "mode", "affine") == "affine"
            and m.scales.dtype == mx.float16 and m.get("biases") is not None)


def blocks_of(model: nn.Module) -> dict[str, Blocks]:
    """The 4- and 8-bit, group-32, affine, float16-scaled blocks of ``model``'s quantized linears
    and embeddings by module path (before the model is dequantized)."""
    return {name: Blocks(m.weight, m.scales, m.biases, m.bits)
            for name, m in model.named_modules() if _readable(m)}


def reads_here(ext) -> bool:
    """Whether this process reads quantized blocks (the extension running, not switched off)."""
    return ext is not None and ext.isa() in ("avx512", "avx2") and os.environ.get(ENV, "1") != "0"


def _float32_module(m: nn.Module) -> nn.Module:
    """``m``'s float32 twin: its values ``q * scale + bias`` in float32 arithmetic."""
    weight = mx.dequantize(m.weight, m.scales.astype(mx.float32), m.biases.astype(mx.float32),
                           group_size=m.group_size, bits=m.bits)  # [out, in] (embeddings: [vocab, dims])
    if isinstance(m, nn.QuantizedEmbedding):
        twin = nn.Embedding(weight.shape[0], weight.shape[1])
    else:
        twin = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in m)
        if "bias" in m:
            twin.bias = m["bias"]
    twin.weight = weight
    return twin


def dequantize(ext, model: nn.Module, blocks: dict[str, Blocks]) -> int:
    """Swap each of ``blocks``' modules for one holding their float32 values (what the kernel
    reads) where this process reads blocks; returns how many. Anything else (other layouts) is
    left to mlx-lm's dequantization."""
    if not blocks or not reads_here(ext):
        return 0
    swaps = [(name, _float32_module(m)) for name, m in model.named_modules() if name in blocks]
    model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def quantize_linears(ext, model: nn.Module, bits: int = 8) -> dict[str, Blocks]:
    """Where this process reads blocks, give ``model``'s float linears blocks of their own
    (group 32, float16 scales and biases, as a checkpoint's) and swap in their float32 values;
    the blocks go to ``register`` once the kernels' modules are in. For a frozen model saved in
    float16 (a drafter's head): 8 bits keep ~3 significant digits and halve the bytes a draft
    step streams. Elsewhere (nothing reads blocks) ``model`` is left as it is."""
    if not reads_here(ext):
        return {}
    made = {}
    for name, m in model.named_modules():
        weight = m.get("weight") if type(m) is nn.Linear else None
        if weight is None or weight.ndim != 2 or weight.shape[1] % 32 or not mx.issubdtype(weight.dtype, mx.floating):
            continue
        q, scales, biases = mx.quantize(weight.astype(mx.float16), group_size=32, bits=bits)
        m.weight = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits)
        made[name] = Blocks(q, scales, biases, bits)
    mx.eval(model.parameters())
    return made


def register(ext, model: nn.Module, blocks: dict[str, Blocks]) -> int:
    """Hand the kernels each matrix's blocks where they rebuild it exactly (the module's
    ``_sb_q_bytes`` says how many bytes a decode row then reads: the kernel keeps its own copy,
    repacked); returns how many matrices read them."""
    if not blocks or not reads_here(ext):
        return 0
    done, held = 0, {bits: 0 for bits in BITS}
    for name, m in model.named_modules():
        b = blocks.get(name)
        if b is None or getattr(m, "weight", None) is None or m["weight"].dtype not in (mx.float32, mx.float16):
            continue
        if nbytes := ext.blocks_register(m["weight"], b.q, b.scales, b.biases, b.bits):
            m._sb_q_bytes = nbytes  # what a decode row reads of it
            weakref.finalize(m, ext.blocks_forget, m["weight"])  # the registry holds its copy until the module goes
            done, held[b.bits] = done + 1, held[b.bits] + nbytes
    if done:
        log.info("quantized_blocks", matrices=done, of=len(blocks),
                 **{f"mb_{bits}bit": round(n / 2**20, 1) for bits, n in held.items() if n})
    return done


def rows(ext, module: nn.Module, ids: mx.array) -> mx.array:
    """``module``'s weight rows for ``ids`` [R], read as those rows of its blocks where the whole
    matrix's are (a reduced-vocabulary head then streams what the full one does a row): one
    registration per distinct ``ids``, forgotten with the module."""
    gathered = module["weight"][ids]  # [R, K]
    if not reads_blocks(module):
        return gathered
    cache = module.__dict__.setdefault("_sb_rows", {})
    key = bytes(memoryview(ids.astype(mx.int32)))
    if key not in cache:
        mx.eval(gathered)
        if ext.blocks_register_rows(gathered, module["weight"], ids.astype(mx.int32)):
            weakref.finalize(module, ext.blocks_forget, gathered)
        cache[key] = gathered
    return cache[key]


def reads_blocks(module: nn.Module) -> bool:
    """Decode rows read ``module``'s registered blocks, not its weight."""
    return getattr(module, "_sb_q_bytes", 0) > 0


def decode_bytes(module: nn.Module) -> int:
    """The bytes a decode row reads of ``module``'s weight: its blocks' where registered."""
    return module._sb_q_bytes if reads_blocks(module) else module["weight"].nbytes
