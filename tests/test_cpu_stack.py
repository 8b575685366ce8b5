"""The decoder stack with its checks made once (kernels.cpu.stack): every forward it takes gives
the bits the model's own call gives (the per-layer fused path), over dense, ragged and paged
caches, with kept layers; over a paged cache or KVCache buffers it is one ``decoder_stack`` op,
with the same bits, buffers, lengths and table; every forward it cannot take is left to the
model, nothing built."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from specbatch.kernels import cpu
from specbatch.kernels.cpu import stack
from specbatch.kernels.paged_kv import PagedKV
from specbatch.kernels.runner import ModelRunner

from helpers import run_batch

needs_kernels = pytest.mark.skipif(cpu.extension() is None, reason="the CPU kernels are not built here")


def _forwards(runner: ModelRunner, steps: list[list[list[int]]]):
    """Each step's logits (and the kept layers' outputs) over one dense cache, evaluated."""
    cache = runner.make_cache()
    outs = []
    for tokens in steps:
        logits = runner.forward(mx.array(tokens, dtype=mx.int32), cache)
        kept = runner.layer_hidden if runner.kept else None
        mx.eval(logits, kept if kept is not None else [])
        outs.append((logits, kept))
    return outs, cache


STEPS = [[[3, 5, 7, 9, 11]], [[13]], [[2, 4, 6]], [[8]], [[1] * 20]]  # a prompt, steps, verifies


@needs_kernels
@pytest.mark.parametrize("name", ["tiny", "tiny_draft"])  # llama; qwen2 (q, k, v with biases)
def test_the_stack_gives_the_models_own_bits(name, request, monkeypatch):
    model = request.getfixturevalue(name).model
    plan = stack.Stack.of(model)
    assert plan is not None and len(plan.layers) == len(model.layers)
    fast, slow = ModelRunner(model), ModelRunner(model)
    slow._stack = False  # the model's own call: every layer's checks, then the same ops
    calls, ops = [], []
    original, op = stack.LayerPlan.__call__, cpu.extension().decoder_stack
    monkeypatch.setattr(stack.LayerPlan, "__call__", lambda *a: calls.append(1) or original(*a))
    monkeypatch.setattr(cpu.extension(), "decoder_stack", lambda *a: ops.append(1) or op(*a))
    got, cache = _forwards(fast, STEPS)
    want, own = _forwards(slow, STEPS)
    # the first forward fills an empty KVCache layer by layer; the others are one op each
    assert len(calls) == len(model.layers) and len(ops) == len(STEPS) - 1
    for (a, _), (b, _) in zip(got, want):
        assert mx.array_equal(a, b).item()
    assert all(mx.array_equal(c.keys[..., :c.offset, :], d.keys[..., :d.offset, :]).item() for c, d in zip(cache, own))


@needs_kernels
def test_kept_layers_are_the_taps_outputs(tiny):
    fast, slow = ModelRunner(tiny.model), ModelRunner(tiny.model)
    slow._stack = False
    for runner in (fast, slow):
        runner.keep_layers([1, 0])  # in the asked order, not the layers'
    got, _ = _forwards(fast, STEPS[:3])
    want, _ = _forwards(slow, STEPS[:3])
    for (_, a), (_, b) in zip(got, want):
        assert a.shape[-1] == 2 * tiny.model.args.hidden_size and mx.array_equal(a, b).item()


@needs_kernels
@pytest.mark.parametrize("layout", ["paged", "dense"])
def test_batch_streams_and_verifies_are_the_models_own(tiny, tiny_draft, layout, monkeypatch):
    """Ragged rows in one batch (each its own offset), speculative rounds rolled back per row."""
    prompts = [[3, 5, 7], [9, 11, 13, 15, 17, 19], [2]]
    params = [{"max_tokens": 12}, {"max_tokens": 9, "temperature": 0.8, "seed": 3}, {"max_tokens": 14}]
    calls = []
    original = stack.LayerPlan.__call__
    monkeypatch.setattr(stack.LayerPlan, "__call__", lambda *a: calls.append(1) or original(*a))
    fast = run_batch(tiny, tiny_draft, prompts, k=3, params=params, kv_layout=layout)
    assert calls  # the stack built the verifies
    monkeypatch.setattr(stack.Stack, "of", classmethod(lambda cls, model: None))
    slow = run_batch(tiny, tiny_draft, prompts, k=3, params=params, kv_layout=layout)
    assert fast[0] == slow[0]
    assert [(r.accepted, r.emitted) for r in fast[1]] == [(r.accepted, r.emitted) for r in slow[1]]


@needs_kernels
def test_forwards_it_cannot_take_build_nothing(tiny):
    plan = stack.Stack.of(tiny.model)
    cache = [KVCache() for _ in tiny.model.layers]
    wide = mx.zeros((1, cpu.MAX_ROWS + 1), dtype=mx.int32)
    assert plan(wide, cache) is None and cache[0].offset == 0  # more rows than the kernels take
    with cpu.disabled():
        assert plan(wide[:, :2], cache) is None
    quantized = [QuantizedKVCache() for _ in tiny.model.layers]
    assert plan(wide[:, :2], quantized) is None
    assert plan(wide[:, :2], cache[:1]) is None
    attn = tiny.model.layers[1].self_attn
    rope = attn.rope
    attn.rope = nn.RoPE(rope.dims, base=10000.0)  # a module swapped in (as a tree forward wraps the RoPE)
    try:
        assert plan(wide[:, :2], cache) is None and cache[0].offset == 0
    finally:
        attn.rope = rope
    hidden, kept = plan(wide[:, :2], cache, (0,))
    assert hidden.shape == (1, 2, tiny.model.args.hidden_size) and len(kept) == 1 and cache[0].offset == 2


def test_a_model_whose_blocks_are_not_all_fused_has_no_stack(tiny_qwen):
    """qwen3's per-head q / k norms keep its attention on the module's own call."""
    assert stack.Stack.of(tiny_qwen.model) is None
    with cpu.disabled():
        assert stack.Stack.of(tiny_qwen.model) is None


def _paged_forwards(runner: ModelRunner, steps, trims):
    """Each step's logits and kept outputs over one two-row paged cache (``trims[i]``: tokens
    each row then gives back, so the rows go ragged), evaluated; the cache."""
    kv = PagedKV.empty(len(runner.model.layers), 2)
    outs = []
    for tokens, trim in zip(steps, trims):
        logits = runner.forward(mx.array(tokens, dtype=mx.int32), kv.layers)
        kept = runner.layer_hidden if runner.kept else mx.array(0)
        mx.eval(logits, kept, kv.arrays())
        outs.append((logits, kept))
        kv.trim_rows(trim)
    return outs, kv


PAGED = [[[3, 5, 7, 9, 11] * 4] * 2, [[13], [14]], [[2, 4, 6], [1, 8, 9]], [[8], [7]], [[1] * 16] * 2, [[5], [6]]]
TRIMS = [[0, 3], [0, 0], [2, 0], [0, 0], [0, 15], [0, 0]]  # equal, ragged single tokens, ragged verifies


@needs_kernels
@pytest.mark.parametrize("name", ["tiny", "tiny_draft"])
def test_paged_forwards_build_in_one_call_with_the_layers_bits(name, request, monkeypatch):
    """Ragged rows (an array mask), verifies (causal and ragged), kept layers: the one-call graph
    gives the per-layer path's logits, kept outputs, pools, lengths and blocks, and writes
    every pool in place (no copy: the old pools were dropped before the writes ran)."""
    model = request.getfixturevalue(name).model
    ext = cpu.extension()
    calls = []
    original = ext.decoder_stack
    monkeypatch.setattr(ext, "decoder_stack", lambda *a: calls.append(1) or original(*a))
    fast, slow = ModelRunner(model), ModelRunner(model)
    for runner in (fast, slow):
        runner.keep_layers([len(model.layers) - 1, 0])  # a one-layer model keeps its layer twice
    copies = ext.paged_write_copies()
    got, kv = _paged_forwards(fast, PAGED, TRIMS)
    assert ext.paged_write_copies() == copies
    assert len(calls) == len(PAGED) - 1  # the 20-token prompt is wider than the small-M kernels
    monkeypatch.setattr(stack.Stack, "_whole", lambda *a: None)
    want, own = _paged_forwards(slow, PAGED, TRIMS)
    for (a, ka), (b, kb) in zip(got, want):
        assert mx.array_equal(a, b).item() and mx.array_equal(ka, kb).item()
    assert kv.lengths() == own.lengths() and kv.table.rows == own.table.rows
    for mine, theirs in zip(kv.layers, own.layers):
        assert mx.array_equal(mine.keys, theirs.keys).item() and mx.array_equal(mine.values, theirs.values).item()


@needs_kernels
def test_decoder_stack_refuses_inputs_that_do_not_fit(tiny):
    """Wrong counts, a dense buffer without room, slots of the wrong shape: a clear error at
    build time, nothing run."""
    ext, model = cpu.extension(), tiny.model
    plan = stack.Stack.of(model)
    weights = [m[k] for m, k in zip(*plan.sources)]
    heads, kv_heads, head_dim, dims, traditional, rope_scale, attn_scale, bias = plan.shared
    h = mx.zeros((1, 2, model.args.hidden_size))
    dense = [mx.zeros((1, kv_heads, 8, head_dim))] * (2 * len(model.layers))
    pools = [mx.zeros((kv_heads, 16, head_dim))] * (2 * len(model.layers))
    slots = mx.zeros((2,), dtype=mx.int32)

    def held(weights=weights, eps=plan.eps):
        return ext.stack_weights(weights, list(eps), heads, kv_heads, dims, traditional, rope_scale, attn_scale, bias)

    def call(buffers=dense, write=None, read=None, start=0, x=h):
        return ext.decoder_stack(x, held(), mx.array([start], dtype=mx.int32), plan.layers[0].rope["_sb_inv_freq"],
                                 buffers, write, read, start, "causal", mx.array(False), [])

    assert call()[0].shape == h.shape  # fits: built
    with pytest.raises(ValueError, match="two eps and its weights"):
        held(weights=weights[:-1])
    with pytest.raises(ValueError, match="two eps and its weights"):
        held(eps=plan.eps[:-1])
    with pytest.raises(ValueError, match="two KV buffers"):
        call(buffers=dense[:-2])
    with pytest.raises(ValueError, match="K the stack's"):
        call(x=mx.zeros((1, 2, model.args.hidden_size + 1)))
    with pytest.raises(ValueError, match="with room for the tokens"):
        call(start=7)
    with pytest.raises(ValueError, match="write_slots int32"):
        call(buffers=pools, write=slots, read=slots)


@needs_kernels
def test_a_pool_held_elsewhere_is_copied_and_left_as_it_was(tiny):
    """The one-call op writes a pool in place only where nothing else holds it: a reader's
    reference keeps its values, and the write goes to a copy (counted)."""
    runner = ModelRunner(tiny.model)
    kv = PagedKV.empty(len(tiny.model.layers), 1)
    mx.eval(runner.forward(mx.array([[3, 5, 7]], dtype=mx.int32), kv.layers), kv.arrays())
    held = kv.layers[1].vpool.parts[0]
    before = mx.array(held)
    copies = cpu.extension().paged_write_copies()
    mx.eval(runner.forward(mx.array([[9]], dtype=mx.int32), kv.layers), kv.arrays())
    assert cpu.extension().paged_write_copies() == copies + 1
    assert mx.array_equal(held, before).item()
    assert not mx.array_equal(kv.layers[1].vpool.parts[0], before).item()


@needs_kernels
def test_weights_are_read_again_only_after_a_swapped_module_was_written(tiny):
    """A forward reuses the weights the last one read while no swapped module's items were written
    (``cpu.edits``); a weight replaced through ``update`` (as ``load_weights`` does) is the next
    forward's, with the model's own bits."""
    from specbatch.kernels.cpu import edits

    model = tiny.model
    fast, slow = ModelRunner(model), ModelRunner(model)
    slow._stack = False
    down = model.layers[1].mlp.down_proj
    kept = down.weight
    try:
        _forwards(fast, STEPS[:2])
        plan = fast._fast_stack()
        read, at = plan.read["weights"], plan.read["at"]
        _forwards(fast, STEPS[:2])
        assert plan.read["weights"] is read and plan.read["at"] == at == edits.count()
        down.update({"weight": kept * 0.5})
        assert edits.count() > at
        got, _ = _forwards(fast, STEPS[:3])
        want, _ = _forwards(slow, STEPS[:3])
        assert plan.read["weights"] is not read and any(w is down["weight"] for w in plan.read["weights"])
        assert all(mx.array_equal(a, b).item() for (a, _), (b, _) in zip(got, want))
    finally:
        down.update({"weight": kept})
