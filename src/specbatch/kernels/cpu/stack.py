"""A llama-family decoder stack's decode and verify forward on the fused ops, its checks made
once per model and once per forward instead of in every layer.

``fused.block_call`` decides in each layer of each forward whether its ops apply (module
classes, weights, RoPE, dtypes, rows): ~35 us of Python a layer, 1.0 ms of a 1.5 ms width-1
forward's graph build, while the ops themselves take 0.5 ms to build. A ``Stack`` checks the
layers' modules when made (``Stack.of``) and, each forward, that they are still those modules
and that the rows fit; then it builds every layer straight from the ops, the same ops in the
same order ``block_call`` takes (``qkv_rope`` with the input norm, the cache append and
attention, ``mlp_block`` with the output projection), so every bit is the same. Anything else
(a tree forward's per-node RoPE, more rows than the kernels take, a quantized cache, sliding
windows, a replaced module) returns None before anything is built: the model's own call runs.

Vocabulary: a *layer plan* is one block's modules as they were checked.
"""

from __future__ import annotations

import sys

import attrs
import mlx.core as mx
import mlx.nn as nn

from . import MAX_ROWS, _active, rope_positions
from .fused import MODULES, _append_and_attend
from .half import weight_ok

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def kernels_on() -> bool:
    """Whether the fused ops run in this thread now (the extension loaded, not disabled)."""
    return _active() is not None


@attrs.frozen
class LayerPlan:
    """One decoder block's modules, checked for the fused ops."""

    block: nn.Module
    attn: nn.Module
    norm: nn.Module  # input_layernorm (inside qkv_rope)
    post: nn.Module  # post_attention_layernorm (inside mlp_block)
    mlp: nn.Module
    rope: nn.Module
    qkv_bias: bool

    @classmethod
    def of(cls, ext, block: nn.Module) -> LayerPlan | None:
        attn, mlp = block.get("self_attn"), block.get("mlp")
        norm, post = block.get("input_layernorm"), block.get("post_attention_layernorm")
        if not (getattr(type(attn), "_sb_qkv", False) and getattr(type(mlp), "_sb_mlp", False)
                and all(getattr(type(n), "_sb_norm", False) for n in (norm, post))) or "q_norm" in attn:
            return None
        rope = attn["rope"]
        linears = [attn[p] for p in PROJECTIONS] + [mlp[p] for p in MLP]
        if ("_sb_inv_freq" not in rope or getattr(rope, "positions", None) is not None
                or not all(getattr(type(m), "small_m", False) and weight_ok(ext, m["weight"]) for m in linears)
                or any("bias" in m for m in linears[3:])):
            return None
        biased = ["bias" in attn[p] for p in PROJECTIONS[:3]]
        if any(biased) and not all(biased):
            return None
        return cls(block, attn, norm, post, mlp, rope, all(biased))

    def current(self) -> bool:
        """Whether the block still holds these modules (a tree forward wraps the RoPE; a
        quantized or reloaded model holds others)."""
        b, a = self.block, self.attn
        return (b["self_attn"] is a and b["mlp"] is self.mlp and b["input_layernorm"] is self.norm
                and b["post_attention_layernorm"] is self.post and a["rope"] is self.rope)

    def __call__(self, ext, x: mx.array, mask, cache, positions: mx.array) -> mx.array:
        """The block's output for ``x`` ``[B, L, D]``, its KV appended to ``cache``."""
        a, m, rope, norm, post = self.attn, self.mlp, self.rope, self.norm, self.post
        biases = [a[p]["bias"] for p in PROJECTIONS[:3]] if self.qkv_bias else []
        q, k, v = ext.qkv_rope(x, a["q_proj"]["weight"], a["k_proj"]["weight"], a["v_proj"]["weight"], biases,
                               positions, rope["_sb_inv_freq"], a.n_heads, a.n_kv_heads, rope.dims,
                               rope.traditional, rope._sb_scale, [norm["weight"]], norm.eps)
        heads = _append_and_attend(q, k, v, cache, a.scale, mask)  # [B, L, Hq * Dh]
        return ext.mlp_block(x, heads, post["weight"], post.eps, m["gate_proj"]["weight"], m["up_proj"]["weight"],
                             m["down_proj"]["weight"], a["o_proj"]["weight"])


@attrs.frozen
class Stack:
    """A llama / qwen2 model's decoder stack on the fused ops (``model.model``: embedding,
    blocks, final norm)."""

    inner: nn.Module
    layers: tuple[LayerPlan, ...]
    mask_cache: int  # the cache whose offset the mask is made from (the model's choice)

    @classmethod
    def of(cls, model: nn.Module) -> Stack | None:
        """``model``'s stack where every block takes the fused ops, else None."""
        ext, inner = _active(), getattr(model, "model", None)
        if ext is None or inner is None or type(inner).__module__ not in MODULES:
            return None
        if getattr(inner, "swa_idx", None) is not None or getattr(inner, "pipeline_size", 1) != 1:
            return None  # sliding windows (a second mask), pipeline stages
        plans = tuple(LayerPlan.of(ext, block) for block in inner.layers)
        if not plans or any(p is None for p in plans):
            return None
        return cls(inner, plans, getattr(inner, "fa_idx", 0))

    def __call__(self, tokens: mx.array, cache: list | None, keep: tuple[int, ...] = ()):
        """(the final normed hidden states ``[B, L, D]``, the ``keep`` layers' outputs) for
        ``tokens`` ``[B, L]``, their KV appended to ``cache``; None (nothing built, nothing
        appended) where the fused ops do not apply to this forward."""
        ext = _active()
        if ext is None or tokens.ndim != 2 or not 0 < tokens.size <= MAX_ROWS:
            return None
        if cache is not None and (len(cache) != len(self.layers) or hasattr(cache[0], "bits")):
            return None
        blocks = self.inner["layers"]
        if len(blocks) != len(self.layers) or not all(b is p.block and p.current() for b, p in zip(blocks, self.layers)):
            return None
        h = self.inner["embed_tokens"](tokens)  # [B, L, D]
        if h.dtype != mx.float32:
            return None
        caches = cache if cache is not None else [None] * len(self.layers)
        mask = sys.modules[type(self.inner).__module__].create_attention_mask(h, caches[self.mask_cache])
        kept, last, positions = {}, None, None
        for i, (plan, c) in enumerate(zip(self.layers, caches)):
            offset = c.offset if c is not None else 0
            if not (isinstance(offset, int) and offset == last):  # one positions array for equal offsets
                positions, last = rope_positions(offset), offset if isinstance(offset, int) else None
            h = plan(ext, h, mask, c, positions)
            if i in keep:
                kept[i] = h
        return self.inner["norm"](h), [kept[i] for i in keep]
