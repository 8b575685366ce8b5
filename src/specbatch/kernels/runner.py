"""The target runner: the kernel every loop calls for target forwards.

A ``TargetRunner`` turns tokens ``[B, N]`` plus per-layer caches into logits
``[B, N, V]``, and keeps the last forward's final hidden states ``[B, N, D]`` (lazy) in
``hidden`` for head drafters that read them (``None`` where it cannot); asked by
``keep_layers``, also some layers' outputs in ``layer_hidden`` (an EAGLE-3-style head fuses
them). ``draft_states`` is what the loops hand a head drafter. ``ModelRunner`` wraps any
mlx-lm model; a test or another server can pass its own object, with every
method of the Protocol (the loops call each of them).
"""

from __future__ import annotations

import functools
from typing import Protocol

import mlx.core as mx
import mlx.nn as nn

from ..runtime.config import DEFAULT_PREFILL_CHUNK

SPLIT_TYPES = {"llama", "mistral", "qwen2", "qwen3"}  # logits = head(model.model(x)), no scaling


class TargetRunner(Protocol):
    n_layers: int
    vocab_size: int
    hidden: mx.array | None  # the last forward's final hidden states [B, N, D] (None: not kept)
    prefill_chunk: int  # prompt tokens per prefill forward

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        """Logits ``[B, N, V]`` for tokens ``[B, N]``; appends their KV to ``cache``."""
        ...

    def forward_last(self, tokens: mx.array, cache: list) -> mx.array:
        """Logits ``[B, V]`` of the last position only (prefill)."""
        ...

    def forward_tree(self, tokens: mx.array, cache: list, positions: mx.array, visible: mx.array) -> mx.array:
        """Logits ``[B, N, V]`` for a token tree ``[B, N]`` (``ModelRunner.forward_tree``)."""
        ...

    def head(self, hidden: mx.array) -> mx.array:
        """The output head: hidden ``[..., D]`` -> logits ``[..., V]`` (head drafters share it)."""
        ...

    def embed(self, tokens: mx.array) -> mx.array:
        """The input embedding (head drafters share it)."""
        ...

    def head_rows(self, ids: mx.array) -> mx.array:
        """Rows ``[N, D]`` of the output head's weight for token ``ids`` (a reduced-vocabulary head)."""
        ...

    def make_cache(self) -> list:
        """Fresh single-sequence caches, one per layer (mlx-lm ``KVCache``)."""
        ...


class ModelRunner:
    """``TargetRunner`` over an mlx-lm model."""

    def __init__(self, model: nn.Module, prefill_chunk: int = DEFAULT_PREFILL_CHUNK):
        self.model = model
        self.prefill_chunk = prefill_chunk  # tokens per prefill forward (the engine's config)
        self.n_layers = len(model.layers)
        self.vocab_size = int(model.args.vocab_size)
        self.hidden: mx.array | None = None
        self.layer_hidden: mx.array | None = None  # [B, N, len(kept) * D] where keep_layers asked
        self.kept: tuple[int, ...] = ()
        self._stack = None  # cpu.stack.Stack, False where the model has none, None: not looked for
        # llama / qwen / mistral: model.model gives normed hidden states, then a plain head
        self._split = getattr(model, "model_type", None) in SPLIT_TYPES and hasattr(model, "model")

    def keep_layers(self, layers) -> None:
        """Keep these layers' outputs (pre-final-norm) of every later forward in ``layer_hidden``."""
        if not self._split:
            raise ValueError("this model's hidden states are not kept (not a llama/qwen/mistral model)")
        self.kept = tuple(int(i) for i in layers)
        for i in self.kept:
            tap(self.model.layers[i], i)

    def _fast_stack(self):
        """The decoder stack on the fused ops with its checks made once (``cpu.stack``), or
        None; looked for once, the first time the kernels are on."""
        from .cpu import stack
        if self._stack is None and stack.kernels_on():
            self._stack = stack.Stack.of(self.model) or False
        return self._stack or None

    def _run(self, tokens: mx.array, cache: list) -> mx.array:
        """The final hidden states [B, N, D]; the kept layers' outputs as they pass."""
        plan = self._fast_stack()
        fast = plan(tokens, cache, self.kept) if plan is not None else None
        if fast is None:
            hidden = self.model.model(tokens, cache=cache)  # after the final norm
            outs = [self.model.layers[i]._sb_tap.out for i in self.kept]
        else:
            hidden, outs = fast
        if self.kept:
            self.layer_hidden = mx.concatenate(outs, axis=-1)  # [B, N, len(kept) * D]
        return hidden

    def forward(self, tokens: mx.array, cache: list) -> mx.array:
        if not self._split:
            return self.model(tokens, cache=cache)
        self.hidden = self._run(tokens, cache)  # [B, N, D], after the final norm
        return self.head(self.hidden)

    def forward_last(self, tokens: mx.array, cache: list) -> mx.array:
        """Logits ``[B, V]`` of the last position only: a prefill skips the head (a fifth of
        the embedded target's weights) and its ``[B, N, V]`` logits at every other position."""
        if not self._split:
            return self.forward(tokens, cache)[:, -1, :]
        self.hidden = self._run(tokens, cache)  # [B, N, D]
        return self.head(self.hidden[:, -1:])[:, 0]

    def forward_tree(self, tokens: mx.array, cache: list, positions: mx.array, visible: mx.array) -> mx.array:
        """Logits ``[B, N, V]`` for a token tree ``[B, N]``: node n at RoPE position
        ``positions[b, n]``, seeing the committed KV and the tree columns ``visible``
        ``[N, N]`` allows (``tree_attention``); appends the nodes' KV to ``cache``."""
        from .tree_attention import tree_call
        return tree_call(self.forward, self.model, tokens, cache, positions, visible)

    def head(self, hidden: mx.array) -> mx.array:
        """The target's output head (shared with head drafters): hidden -> logits."""
        if hasattr(self.model, "lm_head"):
            return self.model.lm_head(hidden)
        return self.model.model.embed_tokens.as_linear(hidden)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.model.embed_tokens(tokens)

    def head_rows(self, ids: mx.array) -> mx.array:
        """The output layer's rows for ``ids`` as stored (float16 where half-stored, which the
        linears take: a reduced head streams half the bytes)."""
        if hasattr(self.model, "lm_head"):
            return self.model.lm_head.weight[ids]
        embed = self.model.model.embed_tokens
        return embed.rows(ids) if hasattr(embed, "rows") else self.embed(ids)  # a tied head

    @functools.cached_property
    def linear_shapes(self) -> tuple[tuple[int, int], ...]:
        """The distinct ``(out, in)`` shapes of the float linears that send a prefill's rows to
        the BLAS whole: the swapped ones (``FastLinear``) keep its chunks apart (``row_blocks``)."""
        return tuple(sorted({tuple(m.weight.shape) for _, m in self.model.named_modules()
                             if isinstance(m, nn.Linear) and m.weight.dtype == mx.float32
                             and not getattr(m, "small_m", False)}))

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache
        return [KVCache() for _ in range(self.n_layers)]


class _Tap:
    """Where a tapped layer leaves its last output (a plain object: not a parameter)."""

    out: mx.array | None = None


_tapped: dict[type, type] = {}


def tap(layer: nn.Module, index: int) -> None:
    """Make ``layer`` (this instance only, once) leave each output in ``layer._sb_tap.out``;
    its parameters and every other layer stay as they were, so an unasked runner pays nothing."""
    cls = type(layer)
    if "_sb_tap" in vars(layer):
        return
    if cls not in _tapped:
        def __call__(self, *args, **kwargs):
            out = cls.__call__(self, *args, **kwargs)
            self._sb_tap.out = out
            return out
        _tapped[cls] = type(f"Tapped{cls.__name__}", (cls,), {"__call__": __call__})
    layer._sb_tap = _Tap()
    layer.__class__ = _tapped[cls]


def draft_states(runner) -> mx.array | None:
    """What a head drafter reads from the last forward: the kept layers' outputs
    ``[B, N, n * D]`` where it asked for them, else the final hidden states ``[B, N, D]``."""
    layers = getattr(runner, "layer_hidden", None)
    return getattr(runner, "hidden", None) if layers is None else layers


def prefill_batch(runner: TargetRunner, prompts: list[list[int]]):
    """Prefill several prompts in one left-padded forward ``[B, L]``.

    Returns (logits ``[B, V]`` of each prompt's last token, a ``BatchKV`` whose row b holds
    prompt b after ``L - len(prompt b)`` padding columns)."""
    from .kv import BatchKV, RaggedKVCache

    L = max(len(p) for p in prompts)
    pads = [L - len(p) for p in prompts]
    tokens = mx.array([[0] * pad + p for p, pad in zip(prompts, pads)], dtype=mx.int32)  # [B, L]
    kv = BatchKV([RaggedKVCache.left_padded(pads) for _ in range(runner.n_layers)])
    from .cpu import beside_blas, extension
    with beside_blas(extension()):
        logits = runner.forward_last(tokens, kv.layers)  # [B, V]
        mx.eval(logits, kv.arrays())
    return logits, kv


def prefill_chunk(runner: TargetRunner, tokens: list[int], cache: list) -> mx.array:
    """One chunk ``tokens`` (at most ``runner.prefill_chunk``) into ``cache``; its last
    logits ``[1, V]`` (evaluated with the new KV)."""
    from .cpu import beside_blas, extension
    with beside_blas(extension()):
        logits = runner.forward_last(mx.array(tokens, dtype=mx.int32)[None], cache)  # [1, V]
        mx.eval(logits, [c.keys for c in cache if getattr(c, "keys", None) is not None])
    return logits


IDLE_CHUNK = 512  # tokens a whole prefill's forwards take at most (1,440 tokens: 6.1 s against 11.4 s in 48s)


def idle_chunk(chunk: int, shapes: tuple = ()) -> int:
    """The chunk a whole prefill runs: the largest multiple of ``chunk`` (what chunked prefill
    between rounds cuts) up to IDLE_CHUNK, so the boundaries stay the same, where this BLAS
    gives every chunk the same bits inside the larger forward for the linears' ``shapes``
    (``merged_rows_match``), else ``chunk`` itself; a chunk within the small-M kernels' rows
    stays as it is (where prefill's linears are on the BLAS, ``cpu.wide``, a larger one would
    switch a token's linears there)."""
    from .cpu import MAX_ROWS, merged_rows_match
    big = max(chunk, IDLE_CHUNK // chunk * chunk)
    if chunk <= MAX_ROWS or big == chunk:
        return chunk
    return big if not shapes or merged_rows_match(chunk, big, tuple(shapes)) else chunk


def prefill(runner: TargetRunner, tokens: list[int], cache: list) -> mx.array:
    """Run ``tokens`` through the model; logits ``[1, V]`` of the last one. The whole chunks of
    ``runner.prefill_chunk`` go in forwards of ``idle_chunk`` tokens, the remainder last on
    its own: the chunks chunked prefill between rounds (``loops/prefill.py``) cuts, merged."""
    from .cpu import row_blocks
    chunk = runner.prefill_chunk
    big, whole = idle_chunk(chunk, getattr(runner, "linear_shapes", ())), len(tokens) - len(tokens) % chunk
    logits, i = None, 0
    with row_blocks(chunk):
        while i < len(tokens):
            n = min(big, whole - i) if i < whole else len(tokens) - i
            logits = prefill_chunk(runner, tokens[i:i + n], cache)
            i += n
    return logits
