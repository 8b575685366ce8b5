"""A llama-family decoder stack's decode and verify forward on the fused ops, its checks made
once per model and once per forward instead of in every layer.

``fused.block_call`` decides in each layer of each forward whether its ops apply (module
classes, weights, RoPE, dtypes, rows): ~35 us of Python a layer, 1.0 ms of a 1.5 ms width-1
forward's graph build, while the ops themselves take 0.5 ms to build. A ``Stack`` checks the
layers' modules when made (``Stack.of``) and, each forward, that they are still those modules
and that the rows fit; then it builds every layer straight from the ops, the same ops in the
same order ``block_call`` takes (``qkv_rope`` with the input norm, the cache append and
attention, ``mlp_block`` with the output projection), so every bit is the same. Over a paged
cache (the engine's default) or mlx-lm ``KVCache`` buffers with room, the whole stack is one op
(``decoder_stack``: those ops' functions in that order, in C++; ``stack_kv`` plans the writes): a width-1 step was ~150 ops, their graph built in Python (~0.8 ms,
cold after each step's weight stream) and scheduled one by one on the caller's thread (~4 us
each) while the step computed on both cores. Anything else
(a tree forward's per-node RoPE, more rows than the kernels take, a quantized cache, sliding
windows, a replaced module) returns None before anything is built: the model's own call runs.

Vocabulary: a *layer plan* is one block's modules as they were checked.
"""

from __future__ import annotations

import sys
from operator import getitem, is_

import attrs
import mlx.core as mx
import mlx.nn as nn

from ..stack_kv import StackWrite
from . import _NO_MASK, MAX_ROWS, _active, edits, rope_positions
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
    linears: tuple[nn.Module, ...]  # PROJECTIONS then MLP

    @classmethod
    def of(cls, ext, block: nn.Module) -> LayerPlan | None:
        attn, mlp = block.get("self_attn"), block.get("mlp")
        norm, post = block.get("input_layernorm"), block.get("post_attention_layernorm")
        if not (getattr(type(attn), "_sb_qkv", False) and getattr(type(mlp), "_sb_mlp", False)
                and all(getattr(type(n), "_sb_norm", False) for n in (norm, post))) or "q_norm" in attn:
            return None
        rope = attn["rope"]
        linears = tuple(attn[p] for p in PROJECTIONS) + tuple(mlp[p] for p in MLP)
        if ("_sb_inv_freq" not in rope or getattr(rope, "positions", None) is not None
                or not all(getattr(type(m), "small_m", False) and weight_ok(ext, m["weight"]) for m in linears)
                or any("bias" in m for m in linears[3:])):
            return None
        biased = ["bias" in attn[p] for p in PROJECTIONS[:3]]
        if any(biased) and not all(biased):
            return None
        return cls(block, attn, norm, post, mlp, rope, all(biased), linears)

    def links(self) -> tuple:
        """(parent, key, child) for every module this plan holds: the block holds these while
        each parent's ``parent[key] is child`` (a tree forward wraps the RoPE; a quantized or
        reloaded model holds other modules)."""
        b, a, m = self.block, self.attn, self.mlp
        return ((b, "self_attn", a), (b, "mlp", m), (b, "input_layernorm", self.norm),
                (b, "post_attention_layernorm", self.post), (a, "rope", self.rope),
                *((a, p, x) for p, x in zip(PROJECTIONS, self.linears)),
                *((m, p, x) for p, x in zip(MLP, self.linears[len(PROJECTIONS):])))

    def sources(self) -> tuple:
        """(module, key) of each array ``decoder_stack`` takes for this layer, in its order:
        norm_in, wq, wk, wv, [bq, bk, bv], norm_post, wg, wu, wd, wo (read again after any write
        to a swapped module's items, ``edits``: a model's weights may be replaced in place)."""
        q, k, v, o, g, u, d = self.linears
        biases = ((q, "bias"), (k, "bias"), (v, "bias")) if self.qkv_bias else ()
        return ((self.norm, "weight"), (q, "weight"), (k, "weight"), (v, "weight"), *biases, (self.post, "weight"),
                (g, "weight"), (u, "weight"), (d, "weight"), (o, "weight"))

    def shape(self) -> tuple:
        """What ``decoder_stack`` assumes every layer shares."""
        a, rope = self.attn, self.rope
        return (a.n_heads, a.n_kv_heads, a["k_proj"]["weight"].shape[0] // a.n_kv_heads, rope.dims, rope.traditional,
                rope._sb_scale, a.scale, self.qkv_bias)

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
    shared: tuple | None  # LayerPlan.shape() where every layer has it, its RoPE frequencies too
    links: tuple[tuple, tuple, tuple]  # every layer's LayerPlan.links() as (parents, keys, children)
    sources: tuple[tuple, tuple]  # every layer's LayerPlan.sources() as (modules, keys)
    eps: tuple[float, ...]  # every layer's (input, post-attention) norm eps
    # the edit count the links were last found whole at, and the weights read then
    read: dict = attrs.field(factory=dict, eq=False)

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
        shape, freqs = plans[0].shape(), plans[0].rope["_sb_inv_freq"]
        same = all(p.shape() == shape and mx.array_equal(p.rope["_sb_inv_freq"], freqs).item()
                   and p.norm["weight"].dtype == p.post["weight"].dtype == mx.float32
                   and all(q["bias"].dtype == mx.float32 for q in p.linears[:3] if p.qkv_bias)
                   for p in plans)
        # flat and column-wise, so each forward's checks and reads run as C-level maps (~0.1 ms
        # of bytecode a forward otherwise, cold after the step's weight stream)
        links = tuple(zip(*(x for p in plans for x in p.links())))
        sources = tuple(zip(*(x for p in plans for x in p.sources())))
        eps = tuple(e for p in plans for e in (p.norm.eps, p.post.eps))
        return cls(inner, plans, getattr(inner, "fa_idx", 0), shape if same else None, links, sources, eps)

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
        if len(blocks) != len(self.layers) or not all(b is p.block for b, p in zip(blocks, self.layers)):
            return None
        if self.read.get("at") != edits.count():  # a swapped module was written since: check again
            if not all(map(is_, map(getitem, *self.links[:2]), self.links[2])):
                return None
            self.read.update(at=edits.count(), weights=list(map(getitem, *self.sources)), held=None)
        h = self.inner["embed_tokens"](tokens)  # [B, L, D]
        if h.dtype != mx.float32:
            return None
        caches = cache if cache is not None else [None] * len(self.layers)
        mask = sys.modules[type(self.inner).__module__].create_attention_mask(h, caches[self.mask_cache])
        whole = self._whole(ext, h, mask, cache, keep) if cache is not None and self.shared else None
        if whole is not None:
            return self.inner["norm"](whole[0]), whole[1]
        kept, last, positions = {}, None, None
        for i, (plan, c) in enumerate(zip(self.layers, caches)):
            offset = c.offset if c is not None else 0
            if not (isinstance(offset, int) and offset == last):  # one positions array for equal offsets
                positions, last = rope_positions(offset), offset if isinstance(offset, int) else None
            h = plan(ext, h, mask, c, positions)
            if i in keep:
                kept[i] = h
        return self.inner["norm"](h), [kept[i] for i in keep]

    def _whole(self, ext, h: mx.array, mask, cache: list, keep: tuple[int, ...]):
        """(the last layer's output, the kept layers') as one ``decoder_stack`` op over a paged
        cache or mlx-lm ``KVCache`` buffers (``StackWrite``); None (nothing built or appended)
        where the cache or the mask is another kind."""
        kind = "" if mask is None else mask if isinstance(mask, str) else "array"
        if kind not in ("", "causal") and not (kind == "array" and mask.dtype == mx.bool_ and mask.ndim == 4
                                               and mask.shape[1] == 1):
            return None
        heads, kv_heads, head_dim, dims, traditional, rope_scale, attn_scale, bias = self.shared
        if head_dim > 256:
            return None
        positions = rope_positions(cache[0].offset)  # each row's first new position, before the writes
        B, L = h.shape[:2]
        write = StackWrite.of(cache, L, kv_heads, head_dim)
        if write is None:
            return None
        if kind == "array" and mask.shape[2:] != (L, write.end):
            mask = mx.broadcast_to(mask, (mask.shape[0], 1, L, write.end))
        held = self.read.get("held")  # the weights as read at the current edit count (__call__), checked once
        if held is None:
            held = self.read["held"] = ext.stack_weights(self.read["weights"], list(self.eps), heads, kv_heads, dims,
                                                         traditional, rope_scale, attn_scale, bias)
        out = ext.decoder_stack(h, held, positions, self.layers[0].rope["_sb_inv_freq"], write.buffers,
                                write.write_slots, write.read_slots, write.start, kind,
                                mask if kind == "array" else _NO_MASK, list(keep))
        n = 1 + len(keep)
        write.commit(out[n:])
        return out[0], out[1:n]
