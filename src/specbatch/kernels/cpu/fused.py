"""The llama-family attention, MLP and block calls on fused ops (decode and verify rows).

mlx-lm's llama / qwen2 ``Attention`` runs three linears, three reshapes and transposes and
two RoPEs before its cache update (11 graph nodes a layer); here ``qkv_rope`` is one op that
writes q, k (rotated) and v in the head layout, and attention writes its heads merged
(``[B, L, Hq * D]``, the output projection's input). Its ``MLP`` runs two linears where
``gate_up`` is one; the block's residual add after attention, the norm after it, the MLP
and its residual add are one op (``mlp_block``: five graph nodes a layer become one), and
its input norm runs inside ``qkv_rope``. Per element each gives the bits the separate
kernels give, so the layer's output is the same. The MLP's activation is the kernels'
``swiglu`` at every width (prefill chunks too), so a row's bits never depend on which path
its forward took. Anything else (more rows than
the small-M kernels take, other dtypes, sharded or quantized projections, a RoPE variant
without the kernel, a quantized cache, per-head norms) takes the module's own call: these
return None there.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from . import MAX_ROWS, _active, add_rms_norm, attention, mlp_block, rope_positions, rows_of, swiglu
from .paged import paged_attention

MODULES = ("mlx_lm.models.llama", "mlx_lm.models.qwen2")  # classes whose calls are copied here


def attend(queries, keys, values, cache, scale: float, mask, merge_heads: bool = False):
    """Attention over ``cache`` with the CPU kernel: a paged one is read in place (its
    gathered view, ``keys``/``values`` here or ``cache.fetch()`` where they are None, only
    where the kernel does not apply)."""
    paged = getattr(cache, "paged_view", None)
    view = paged() if paged is not None else None
    out = paged_attention(queries, view, scale, mask, merge_heads) if view is not None else None
    if out is not None:
        return out
    if keys is None:
        keys, values = cache.fetch()
    return attention(queries, keys, values, scale, mask, merge_heads)


def _append_in_buffer(cache, k, v) -> int:
    """Store k, v ``[B, H, L, D]`` in an mlx-lm ``KVCache`` whose buffer has room, as its
    ``update_and_fetch`` does, without the sliced views it returns (two graph nodes a layer:
    attention reads the buffer's first keys itself); the keys then held, 0 where the cache is
    another kind or must grow (its own call then)."""
    if type(cache) is not KVCache or cache.keys is None:
        return 0
    prev = cache.offset
    end = prev + k.shape[2]
    if end > cache.keys.shape[2] or k.dtype != cache.keys.dtype:
        return 0
    cache.offset = end
    cache.keys[..., prev:end, :] = k
    cache.values[..., prev:end, :] = v
    return end


def _append_and_attend(q, k, v, cache, scale: float, mask):
    """Store k, v in ``cache`` and attend over it, heads merged ``[B, L, Hq * D]``; a paged
    cache is written in place and its gathered view never built, a dense one's buffer read in
    place."""
    if hasattr(cache, "append") and hasattr(cache, "paged_view"):
        cache.append(k, v)
        k = v = None
    elif length := _append_in_buffer(cache, k, v):
        return attention(q, cache.keys, cache.values, scale, mask, merge_heads=True, length=length)
    elif cache is not None:
        k, v = cache.update_and_fetch(k, v)
    return attend(q, k, v, cache, scale, mask, merge_heads=True)


def _linears(*layers) -> list | None:
    """The layers' weights where every one is a swapped float32 linear (``FastLinear``).
    Children and weights are read as the modules' own dict items here and below: attribute
    access goes through ``Module.__getattr__`` (~0.3 us each, ~25 a layer in every forward)."""
    weights = []
    for m in layers:
        if not getattr(type(m), "small_m", False):
            return None
        weights.append(m["weight"])
    return weights


def _rope(attn):
    """(the swapped RoPE, explicit positions ``[B, L]`` or None) of ``attn``, or None."""
    rope = attn["rope"]
    positions = getattr(rope, "positions", None)  # a tree forward's per-node RoPE wraps the layer's
    base = rope["inner"] if positions is not None else rope
    return (base, positions) if "_sb_inv_freq" in base else None


def qkv_heads(attn, x: mx.array, positions: mx.array | None, norm=None) -> tuple | None:
    """(q, k, v) ``[B, H, L, D]`` of mlx-lm's llama ``Attention`` ``attn`` for ``x`` as one
    ``qkv_rope`` op: q and k roped from ``positions`` (int32 ``[1]`` / ``[B]``: each row's first
    position; a tree forward's per-node RoPE brings its own), ``norm`` (a swapped RMSNorm)
    applied to ``x`` first; None where the op does not apply."""
    ext = _active()
    q_proj = attn["q_proj"]
    weights = _linears(q_proj, attn["k_proj"], attn["v_proj"])
    rope = _rope(attn)
    if (ext is None or weights is None or rope is None or x.dtype != mx.float32 or x.ndim != 3
            or not 0 < rows_of(x) <= MAX_ROWS or "q_norm" in attn
            or (norm is not None and (norm["weight"].dtype != mx.float32 or not getattr(type(norm), "_sb_norm", False)))):
        return None
    base, own = rope
    positions = own if own is not None else positions
    biases = [attn[p]["bias"] for p in ("q_proj", "k_proj", "v_proj")] if "bias" in q_proj else []
    norms, eps = ([norm["weight"]], norm.eps) if norm is not None else ([], 0.0)
    return ext.qkv_rope(x, *weights, biases, positions.astype(mx.int32), base["_sb_inv_freq"], attn.n_heads,
                        attn.n_kv_heads, base.dims, base.traditional, base._sb_scale, norms, eps)


def attention_call(self, x: mx.array, mask=None, cache=None, norm=None, project: bool = True) -> mx.array | None:
    """mlx-lm's llama ``Attention.__call__`` on ``qkv_rope``; None where it does not apply.
    ``norm``: the block's input RMSNorm (a swapped one), applied inside ``qkv_rope`` to ``x``;
    ``project=False``: the merged heads before ``o_proj`` (the caller projects them)."""
    if hasattr(cache, "bits"):
        return None
    heads = qkv_heads(self, x, rope_positions(cache.offset if cache is not None else 0), norm)
    if heads is None:
        return None
    out = _append_and_attend(*heads, cache, self.scale, mask)  # [B, L, Hq * D]
    return self["o_proj"](out) if project else out


def second_half(block, x: mx.array, r: mx.array, project: bool = True) -> mx.array | None:
    """``block``'s second half (the residual add, the norm, the MLP and its add) as one
    ``mlp_block`` op over ``r``: attention's merged heads ``[B, L, Hq * D]``, the output
    projection inside the op, where ``project``, else its projected output; None where it does
    not apply."""
    post, mlp = block["post_attention_layernorm"], block["mlp"]
    if not getattr(type(post), "_sb_norm", False) or not getattr(type(mlp), "_sb_mlp", False):
        return None
    layers = (mlp["gate_proj"], mlp["up_proj"], mlp["down_proj"]) + ((block["self_attn"]["o_proj"],) if project else ())
    weights = _linears(*layers)
    if weights is None or any("bias" in m for m in layers):
        return None
    return mlp_block(x, r, post["weight"], post.eps, *weights)


def mlp_call(self, x: mx.array) -> mx.array | None:
    """mlx-lm's llama ``MLP.__call__`` on ``gate_up`` and ``swiglu`` (wider inputs: the two
    linears, then ``swiglu``); None where the kernels are off or the input is not float32."""
    ext = _active()
    if ext is None or x.dtype != mx.float32:
        return None
    weights = _linears(self.gate_proj, self.up_proj)
    if (weights is None or not 0 < rows_of(x) <= MAX_ROWS or "bias" in self.gate_proj
            or "bias" in self.up_proj):
        gate, up = self.gate_proj(x), self.up_proj(x)
    else:
        gate, up = ext.gate_up(x, *weights)
    return self.down_proj(swiglu(gate, up))


def block_call(self, x: mx.array, mask=None, cache=None) -> mx.array | None:
    """mlx-lm's llama ``TransformerBlock.__call__`` with everything after attention (the
    output projection, the residual add, the norm, the MLP and its add) as one op
    (``mlp_block``), or at least the add and the norm (``add_rms_norm``); None where the norm
    is not the kernel's."""
    post = self["post_attention_layernorm"]
    if not getattr(type(post), "_sb_norm", False):
        return None
    attn, norm = self["self_attn"], self["input_layernorm"]
    r = None
    if getattr(type(norm), "_sb_norm", False) and getattr(type(attn), "_sb_qkv", False):
        # the input norm inside qkv_rope, the output projection inside mlp_block: two nodes fewer
        r = attention_call(attn, x, mask, cache, norm, project=False)
        if r is not None:
            out = second_half(self, x, r)
            if out is not None:
                return out
            r = attn["o_proj"](r)
    if r is None:
        r = attn(norm(x), mask, cache)
    out = second_half(self, x, r, project=False)
    if out is not None:
        return out
    fused = add_rms_norm(x, r, post["weight"], post.eps)
    if fused is None:
        h = x + r
        return h + self.mlp(post(h))
    h, normed = fused
    return h + self.mlp(normed)


def mtp_step(head, h, emb, positions, ctx, own_keys: list, own_values: list):
    """The MTP head's draft step (``MTPHead.step``: the norms and ``eh_proj``, its block over
    the target's last-layer KV, then its own keys, the final norm) as one ``mtp_step`` op,
    the context (``drafters.head_context``: dense ``[B or 1, Hkv, T, D]`` or a paged layer's
    pools through its slots) read in place; (hidden ``[B, D]``, k, v ``[B, Hkv, 1, D]``), or
    None where it does not apply."""
    ext = _active()
    block = head["block"]
    attn, mlp = block["self_attn"], block["mlp"]
    norms = (head["enorm"], head["hnorm"], block["input_layernorm"], block["post_attention_layernorm"], head["norm"])
    linears = (head["eh_proj"], attn["q_proj"], attn["k_proj"], attn["v_proj"], mlp["gate_proj"], mlp["up_proj"],
               mlp["down_proj"], attn["o_proj"])
    weights, rope = _linears(*linears), _rope(attn)
    if (ext is None or weights is None or rope is None or rope[1] is not None or "q_norm" in attn
            or any("bias" in m for m in linears) or h.ndim != 2 or not 0 < h.shape[0] <= MAX_ROWS
            or any(a.dtype != mx.float32 for a in (h, emb, ctx.keys, ctx.values))
            or ctx.keys.ndim != (3 if ctx.slots is not None else 4)
            or not all(getattr(type(n), "_sb_norm", False) and n["weight"].dtype == mx.float32 for n in norms)):
        return None
    e_w, h_w, in_w, post_w, out_w = (n["weight"] for n in norms)
    eh, wq, wk, wv, wg, wu, wd, wo = weights
    base = rope[0]
    hidden, k, v = ext.mtp_step(h, emb, positions.astype(mx.int32), base["_sb_inv_freq"], ctx.keys, ctx.values,
                                ctx.columns, ctx.mask, own_keys, own_values,
                                [e_w, h_w, eh, in_w, wq, wk, wv, post_w, wg, wu, wd, wo, out_w], attn.n_heads,
                                attn.n_kv_heads, base.dims, base.traditional, base._sb_scale, attn.scale,
                                [n.eps for n in norms], ctx.slots)
    return hidden, k, v
