"""A multi-token-prediction (MTP) head as a Drafter: one transformer block on the target.

To propose the token after ``y`` (the pending token, at position ``p``) the head takes the
target's final hidden state at ``p - 1`` (the one that predicted ``y``) and the embedding
of ``y``: ``x = eh_proj([enorm(emb(y)); hnorm(h)])``, one attention + MLP block whose
queries attend over the *target's own last-layer KV* for positions ``< p`` (shared KV: no
cache of its own) plus the head's keys for the positions it drafted this round, then the
target's final norm-free head: ``logits = target_head(norm(x))``. Drafting chains ``k``
steps, feeding its own output hidden state back as ``h``.

A head may keep a reduced output vocabulary (``draft_vocab`` in its config, the kept token
ids in ``vocab_ids``, FR-Spec style): it projects onto those rows of the target's output
layer only and scatters them into a full-vocabulary row filled with -inf, so a token
outside the kept set is never proposed and the chooser and verify code see [B, V] as ever.

EAGLE-3-style input (``fuse_layers`` in its config, target layer indices): the first step's
``h`` is ``fc([h_low; h_mid; h_high])``, a learned ``[n * D -> D]`` fusion of those target
layers' outputs (``ModelRunner.keep_layers``); later steps read the head's own output as
ever. A head without the key is the plain one above, weights and arithmetic unchanged.

Its only per-row state is that hidden state, so a cold start from a capture round is one
array, not a re-prefill of history.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models import llama

from ...runtime.tree_shape import TreeLayout
from ..cpu import attention as cpu_attention
from ..cpu import fused
from ..cpu import linear as cpu_linear
from ..cpu.vocab import spread
from .base import ANY_WIDTH, Capture, Chooser, DraftTree
from .head_context import HeadContext, context_of

HEAD_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
             "rope_theta", "rope_scaling", "rope_traditional", "max_position_embeddings")


def head_config(target_args, intermediate_size: int | None = None) -> dict:
    """An MTP head shaped to read the target's last-layer KV."""
    cfg = {k: getattr(target_args, k, None) for k in HEAD_KEYS}
    heads = cfg["num_attention_heads"]
    cfg["num_key_value_heads"] = cfg["num_key_value_heads"] or heads
    cfg["head_dim"] = cfg["head_dim"] or cfg["hidden_size"] // heads
    cfg["intermediate_size"] = intermediate_size or target_args.intermediate_size
    cfg["rope_theta"] = cfg["rope_theta"] or 10000.0
    cfg["rope_traditional"] = bool(cfg["rope_traditional"])
    return {k: v for k, v in cfg.items() if v is not None}


class MTPHead(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        block = {k: v for k, v in config.items() if k not in ("draft_vocab", "fuse_layers")}
        args = llama.ModelArgs(model_type="llama", num_hidden_layers=1, vocab_size=1, **block)
        D = args.hidden_size
        self.enorm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.hnorm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * D, D, bias=False)
        self.block = llama.TransformerBlock(args)
        self.norm = nn.RMSNorm(D, eps=args.rms_norm_eps)
        self.fuse_layers = tuple(config.get("fuse_layers") or ())  # target layers fused at step 1
        if self.fuse_layers:
            self.fc = nn.Linear(len(self.fuse_layers) * D, D, bias=False)
        if config.get("draft_vocab"):
            self.vocab_ids = mx.zeros((int(config["draft_vocab"]),), dtype=mx.int32)
            self.freeze(keys=["vocab_ids"], recurse=False)
        self.config = config
        self.name = "mtp-head"  # where it was loaded from, once loaded

    def first_input(self, states: mx.array) -> mx.array:
        """The first step's ``h`` ``[..., D]`` from the target's states: the final hidden
        ``[..., D]`` as it is, or (a fused head) the kept layers' ``[..., n * D]`` through ``fc``."""
        if not self.fuse_layers:
            return states
        want = len(self.fuse_layers) * self.config["hidden_size"]
        if states.shape[-1] != want:
            raise ValueError(f"a fused MTP head needs the target's layers {list(self.fuse_layers)} "
                             f"({want} features), got {states.shape[-1]}")
        return self.fc(states)

    def step(self, h, emb, positions, ctx: HeadContext, own_keys, own_values):
        """One draft position per row. h, emb: [B, D]; positions: [B] (query positions).

        ctx: the target's last-layer KV (dense or paged) and its validity mask;
        own_*: lists of the head's keys/values for earlier steps of this round.
        Returns (hidden [B, D], new own key, new own value)."""
        fast = fused.mtp_step(self, h, emb, positions, ctx, own_keys, own_values)
        if fast is not None:  # one op, the context read in place (else the ops below)
            return fast
        attn = self.block.self_attn
        x = self.eh_proj(mx.concatenate([self.enorm(emb), self.hnorm(h)], axis=-1))[:, None]  # [B, 1, D]
        B = x.shape[0]
        heads = fused.qkv_heads(attn, x, positions, self.block["input_layernorm"])  # one op where it applies
        if heads is None:
            a = self.block.input_layernorm(x)
            q = attn.q_proj(a).reshape(B, 1, attn.n_heads, -1).transpose(0, 2, 1, 3)
            k = attn.k_proj(a).reshape(B, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            v = attn.v_proj(a).reshape(B, 1, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
            q, k = attn.rope(q, offset=positions), attn.rope(k, offset=positions)
        else:
            q, k, v = heads  # [B, H, 1, d]
        ctx_keys, ctx_values, ctx_mask = ctx.dense(B)
        keys = mx.concatenate([ctx_keys, *own_keys, k], axis=2)
        values = mx.concatenate([ctx_values, *own_values, v], axis=2)
        mask = mx.concatenate([ctx_mask, mx.ones((B, len(own_keys) + 1), dtype=mx.bool_)], axis=1)
        out = cpu_attention(q, keys, values, attn.scale, mask[:, None, None, :], merge_heads=True)  # [B, 1, Hq * d]
        y = fused.second_half(self.block, x, out)  # the block's second half as one op where it applies
        if y is None:
            x = x + attn.o_proj(out)
            y = x + self.block.mlp(self.block.post_attention_layernorm(x))
        return self.norm(y)[:, 0], k, v

    def train_forward(self, hidden, emb, ctx_keys, ctx_values):
        """All positions at once, for training: hidden/emb ``[B, N, D]`` at positions
        ``1 .. N`` (hidden from position ``i - 1``), target KV ``[B, Hkv, N, d]`` for
        positions ``0 .. N-1``. Query ``n`` sees target columns ``<= n`` and its own key."""
        attn = self.block.self_attn
        x = self.eh_proj(mx.concatenate([self.enorm(emb), self.hnorm(hidden)], axis=-1))  # [B, N, D]
        a = self.block.input_layernorm(x)
        B, N, _ = a.shape
        q = attn.q_proj(a).reshape(B, N, attn.n_heads, -1).transpose(0, 2, 1, 3)
        k = attn.k_proj(a).reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = attn.v_proj(a).reshape(B, N, attn.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = attn.rope(q, offset=1), attn.rope(k, offset=1)
        rows, cols = mx.arange(N)[:, None], mx.arange(N)[None]
        mask = mx.concatenate([cols <= rows, cols == rows], axis=1)  # [N, 2N]
        out = mx.fast.scaled_dot_product_attention(q, mx.concatenate([ctx_keys, k], 2),
                                                   mx.concatenate([ctx_values, v], 2), scale=attn.scale, mask=mask)
        x = x + attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, N, -1))
        x = x + self.block.mlp(self.block.post_attention_layernorm(x))
        return self.norm(x)


class MTPDrafter:
    """Drafter protocol over an ``MTPHead`` that shares the target's embedding, head and KV."""

    tree_width = ANY_WIDTH
    # off: with the verify's graph built in ~0.8 ms (cpu/stack.py), drafting on one core while it
    # builds made the round wait on that core (Intel AVX-512, engine_compare: 1.03-1.05x plain
    # against 1.10-1.11x drafting on both; on the EPYC, with a 1.9 ms build, it had won 5%)
    draft_on_one_core = False
    # between rounds it holds the target's hidden state only, so a prompt-lookup round may
    # draft in its place (drafters/lookup.py)
    target_state_only = True

    def __init__(self, head: MTPHead, runner):
        self.head, self.runner = head, runner
        if head.fuse_layers:  # the loops then hand the kept layers' outputs (draft_states)
            runner.keep_layers(head.fuse_layers)
        self.hidden: mx.array | None = None  # [B, D]: target hidden that predicted each pending token
        self._rows: mx.array | None = None  # the kept rows of the target's output layer [N, D]

    def logits(self, h: mx.array) -> mx.array:
        """[B, V] draft logits; -inf outside a reduced head's kept vocabulary."""
        if "vocab_ids" not in self.head:
            return self.runner.head(h)
        ids = self.head.vocab_ids
        if self._rows is None:
            self._rows = self.runner.head_rows(ids)
        return spread(cpu_linear(h, self._rows), ids, self.runner.vocab_size)  # h @ rows.T, -inf elsewhere

    @property
    def width(self) -> int:
        return 0 if self.hidden is None else self.hidden.shape[0]

    def draft(self, prev, pending, k: int, choose: Chooser, context=None):
        ctx = context_of(context[-1])
        base = mx.array(ctx.lengths, dtype=mx.int32)  # [B]: the pending token's position
        h, token = self.hidden, pending
        own_k, own_v, tokens, logits = [], [], [], []
        for j in range(k):
            h, kj, vj = self.head.step(h, self.runner.embed(token), base + j, ctx, own_k, own_v)
            own_k.append(kj)
            own_v.append(vj)
            step_logits = self.logits(h)  # [B, V]
            token = choose(step_logits, j)
            tokens.append(token)
            logits.append(step_logits)
        return mx.stack(tokens, axis=1), mx.stack(logits, axis=1)

    def draft_tree(self, prev, pending, shape, choose, context=None) -> DraftTree:
        return self.draft_trees(prev, pending, shape, choose, context)[0]

    def commit_tree(self, path: list[int], hidden: mx.array | None = None) -> None:
        self.commit_trees([path], hidden)

    def draft_trees(self, prev, pending, shape, choose, context=None) -> list[DraftTree]:
        """One tree per row, level by level: every row's frontier nodes are the rows of one
        head step, each carrying its parent's output state and seeing its own row's target
        KV and its ancestors' head keys. A dynamic shape keeps only children whose path
        score (product of drafted probabilities) reaches ``shape.min_score``."""
        ctx = context_of(context[-1])
        if shape.dynamic:
            return self._draft_dynamic(pending, shape, choose, ctx)
        B = pending.shape[0]
        owner, h, token, own_k, own_v, levels = mx.arange(B), self.hidden, pending, [], [], []
        for d, b in enumerate(shape.branching, 1):
            h, own_k, own_v = self._expand(h, token, owner, d, ctx, own_k, own_v)  # h [M, D]
            token = choose(self.logits(h), d, b).reshape(-1)  # [M * b] children, row-major
            levels.append(token.reshape(B, -1))
            parent = mx.repeat(mx.arange(token.shape[0] // b), b)  # [M * b]: each child's frontier row
            owner, h = owner[parent], h[parent]
            own_k, own_v = [k[parent] for k in own_k], [v[parent] for v in own_v]
        tokens = mx.concatenate([pending[:, None], *levels], axis=1).astype(mx.int32)  # [B, N]
        layout = shape.layout()
        return [DraftTree(tokens[i], layout) for i in range(B)]

    def _expand(self, h, token, owner, d: int, ctx: HeadContext, own_k: list, own_v: list):
        """One head step for the frontier rows at depth ``d - 1`` (``owner`` [M]: their batch rows)."""
        base = mx.array(ctx.lengths, dtype=mx.int32)[owner]  # [M]: the pending tokens' positions
        h, kj, vj = self.head.step(h, self.runner.embed(token), base + d - 1, ctx.select(owner), own_k, own_v)
        return h, [*own_k, kj], [*own_v, vj]  # h [M, D], kj [M, Hkv, 1, hd]

    def _draft_dynamic(self, pending, shape, choose, ctx) -> list[DraftTree]:
        """The static draft, pruned by path score; one host read per depth (the pruning
        decides the next frontier). Per frontier row: its batch row, node id and score."""
        trees = [([t], [-1]) for t in pending.tolist()]  # per batch row: tokens, parents
        owner, node, score = list(range(len(trees))), [0] * len(trees), [1.0] * len(trees)
        h, token, own_k, own_v = self.hidden, pending, [], []
        for d, b in enumerate(shape.branching, 1):
            h, own_k, own_v = self._expand(h, token, mx.array(owner), d, ctx, own_k, own_v)
            logits = self.logits(h)  # [M, V]
            kids = choose(logits, d, b)  # [M, b], best first
            probs = mx.take_along_axis(mx.softmax(logits, axis=-1), kids, axis=-1)  # [M, b]
            kids_h, probs_h = kids.tolist(), probs.tolist()
            kept = [(m, j) for m in range(len(owner)) for j in range(b) if score[m] * probs_h[m][j] >= shape.min_score]
            if not kept:
                break
            placed = []
            for m, j in kept:  # depth by depth, parents first: each row's nodes stay in tree order
                tokens, parents = trees[owner[m]]
                tokens.append(kids_h[m][j])
                parents.append(node[m])
                placed.append(len(tokens) - 1)
            node, owner, score = placed, [owner[m] for m, _ in kept], [score[m] * probs_h[m][j] for m, j in kept]
            rows = mx.array([m for m, _ in kept])  # [M'] each kept child's frontier row
            token = mx.array([kids_h[m][j] for m, j in kept], dtype=mx.int32)
            h, own_k, own_v = h[rows], [k[rows] for k in own_k], [v[rows] for v in own_v]
        return [DraftTree(mx.array(t, dtype=mx.int32), TreeLayout.of_parents(p)) for t, p in trees]

    def commit_trees(self, paths: list[list[int]], hidden: mx.array | None = None) -> None:
        """``hidden`` ``[B, D]`` (``[B, n * D]``, fused): the target state at each row's last accepted node."""
        if hidden is not None:
            self.hidden = self.head.first_input(hidden)

    def rollback(self, counts: list[int], hidden: mx.array | None = None) -> None:
        if hidden is not None:
            self.hidden = self.head.first_input(hidden)

    def advance(self, tokens: list[int], hidden: mx.array | None = None) -> None:
        """The head reads the target's own KV: only its input state moves on."""
        self.rollback([0] * len(tokens), hidden)

    def add_rows(self, histories: list[list[int]], hidden: mx.array | None = None) -> None:
        if hidden is None:
            raise ValueError("the MTP drafter needs the target's hidden state for new rows")
        hidden = self.head.first_input(hidden)  # [B, D]
        self.hidden = hidden if self.hidden is None else mx.concatenate([self.hidden, hidden])

    def filter(self, keep: list[int]) -> None:
        self.hidden = self.hidden[mx.array(keep)] if keep and self.hidden is not None else None

    def reset(self) -> None:
        self.hidden = None

    def cold_start(self, capture: Capture) -> None:
        self.hidden = None if capture.hidden is None else self.head.first_input(capture.hidden)

    def nbytes(self) -> int:
        return 0 if self.hidden is None else self.hidden.nbytes


def save_head(head: MTPHead, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(mx.float16) if mx.issubdtype(v.dtype, mx.floating) else v
               for k, v in tree_flatten(head.parameters())}
    mx.save_safetensors(str(out / "mtp.safetensors"), weights, metadata={"format": "mlx"})
    (out / "mtp_config.json").write_text(json.dumps(head.config, indent=1))
