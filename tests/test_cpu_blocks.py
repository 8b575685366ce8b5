"""Quantized blocks for decode and verify rows (kernels.cpu.blocks): a matrix holding its 4- or
8-bit blocks' float32 values (q * scale + bias, one rounding) read as those blocks, which sum
their own way (each group's partial sum scaled once) within rounding of the exact product; a
row's bits never depend on the rows beside it: in the kernel, the fused ops, a reduced head's
gathered rows, a whole model and its streams."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu
from specbatch.kernels.cpu import blocks as quantized
from specbatch.kernels.cpu.modules import FastEmbedding, FastLinear

from helpers import run_plain, run_scalar

ext = cpu.extension()
needs_blocks = pytest.mark.skipif(not quantized.reads_here(ext), reason="blocks are read where the kernels run")
LAYER_MATRICES = 2 * 7  # the tiny model's two layers' q, k, v, o, gate, up and down (4-bit)


def _blocks(n: int, k: int, seed: int, bits: int = 4):
    """A float32 matrix holding affine blocks' values (float16 scales and biases, widened before
    the arithmetic, as MLX's quantized_matmul takes them), and those blocks."""
    w = mx.random.normal((n, k), key=mx.random.key(seed)).astype(mx.float16)
    qw, scales, biases = mx.quantize(w, group_size=32, bits=bits)
    values = mx.dequantize(qw, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=bits)
    return values, qw, scales, biases


def _rounding(x: mx.array, w: mx.array, y: mx.array) -> float:
    """The worst error of ``y`` against the exact ``x @ w.T``, over each element's sum of |x w|
    (the scale any float32 summation order's rounding has)."""
    x64, w64 = np.asarray(x).astype(np.float64), np.asarray(w).astype(np.float64)
    return float((np.abs(np.asarray(y) - x64 @ w64.T) / (np.abs(x64) @ np.abs(w64).T)).max())


@needs_blocks
@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 200), groups=st.integers(1, 40), seed=st.integers(0, 2**16), bits=st.sampled_from((4, 8)))
# a part of one 64-row tile group, tile groups split between threads at 16 rows, several whole
@example(n=5, groups=19, seed=1, bits=4)
@example(n=150, groups=3, seed=2, bits=8)
@example(n=192, groups=18, seed=3, bits=4)
def test_blocks_sum_each_row_alone_within_rounding_of_the_exact_product(n, groups, seed, bits):
    w, qw, scales, biases = _blocks(n, 32 * groups, seed, bits)
    x = mx.random.normal((40, 32 * groups), key=mx.random.key(seed + 1))
    assert ext.blocks_register(w, qw, scales, biases, bits)
    try:
        full = ext.small_linear(x, w)  # 40 rows: passes of 8 (AVX-512) or 4 (AVX2) token rows
        alone = mx.concatenate([ext.small_linear(x[i:i + 1], w) for i in range(40)])
        assert mx.array_equal(full, alone).item()
        for m in (2, 3, 4, 5, 6, 7, 8, 9, 13, 32, 33):
            assert mx.array_equal(ext.small_linear(x[:m], w), full[:m]).item(), m
        # ~5e-8 measured; MLX's quantized_matmul and the BLAS ~1.5e-7; one wrong weight ~1e-3
        assert _rounding(x, w, full) < 1e-6
    finally:
        ext.blocks_clear()


@needs_blocks
@pytest.mark.parametrize("bits", [4, 8])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(bits):
    w, qw, scales, biases = _blocks(70, 96, 5, bits)
    assert ext.blocks_register(w, qw, scales, biases, bits)
    try:
        x = mx.random.normal((32, 96), key=mx.random.key(2))
        alone = mx.concatenate([ext.small_linear(x[i:i + 1], w) for i in range(32)])
        for m in (2, 4, 6, 8, 13, 32):
            assert mx.array_equal(ext.small_linear(x[:m], w), alone[:m]).item(), m
    finally:
        ext.blocks_clear()


@pytest.mark.parametrize("bits", [4, 8])
def test_the_values_are_what_mlxs_quantized_matmul_multiplies(bits):
    w, qw, scales, biases = _blocks(48, 128, 9, bits)
    x = mx.random.normal((3, 128), key=mx.random.key(4))
    ours = x @ w.T
    theirs = mx.quantized_matmul(x, qw, scales, biases, transpose=True, group_size=32, bits=bits)
    assert mx.allclose(ours, theirs, rtol=1e-6, atol=1e-5).item()
    rounded = mx.dequantize(qw, scales, biases, group_size=32, bits=bits)  # float16 arithmetic: other values
    assert not mx.array_equal(rounded.astype(mx.float32), w).item()


@needs_blocks
@pytest.mark.parametrize("bits", [4, 8])
def test_the_fused_ops_read_blocks_row_by_row(bits):
    keys = mx.random.split(mx.random.key(7), 4)
    mats = {name: _blocks(rows, cols, i, bits) for i, (name, rows, cols) in
            enumerate((("q", 64, 64), ("k", 32, 64), ("v", 32, 64), ("g", 96, 64), ("u", 96, 64), ("d", 64, 96)))}
    x, r = mx.random.normal((1, 6, 64), key=keys[0]), mx.random.normal((1, 6, 64), key=keys[1])
    norm = mx.random.normal((64,), key=keys[2])
    inv, pos = mx.exp(-mx.arange(8, dtype=mx.float32)), mx.array([9], dtype=mx.int32)
    w = {name: parts[0] for name, parts in mats.items()}

    def run(rows):
        xs, rs = x[:, :rows], r[:, :rows]
        out = [*ext.qkv_rope(xs, w["q"], w["k"], w["v"], [], pos, inv, 4, 2, 16, False, 1.0),
               *ext.gate_up(xs, w["g"], w["u"]), ext.mlp_block(xs, rs, norm, 1e-5, w["g"], w["u"], w["d"])]
        mx.eval(out)
        return out
    before = run(6)  # the float32 matrices
    for parts in mats.values():
        assert ext.blocks_register(*parts, bits)
    try:
        six = run(6)
        # within float32 rounding of the float32 matrices' outputs (~4e-7 of the largest measured)
        assert all((mx.abs(a - b).max() < 1e-5 * mx.abs(b).max()).item() for a, b in zip(six, before))
        assert not all(mx.array_equal(a, b).item() for a, b in zip(six, before))  # the blocks were read
        for rows in (1, 2):  # a row's bits whatever rows follow it
            assert all(mx.array_equal(a, b[..., :rows, :]).item() for a, b in zip(run(rows), six)), rows
    finally:
        ext.blocks_clear()


@needs_blocks
@pytest.mark.parametrize("bits", [4, 8])
def test_blocks_that_do_not_rebuild_the_matrix_are_refused(bits):
    w, qw, scales, biases = _blocks(40, 64, 3, bits)
    assert not ext.blocks_register(w * 1.5, qw, scales, biases, bits)
    assert not ext.blocks_register(w, qw, scales * 2, biases, bits)
    assert not ext.blocks_register(w.astype(mx.float16), qw, scales, biases, bits)  # rounded: not the blocks' values
    assert not ext.blocks_register(w[:, :32], qw, scales, biases, bits)  # shapes that do not match
    assert not ext.blocks_register(w, qw, scales.astype(mx.float32), biases, bits)  # blocks as a checkpoint ships them
    assert not ext.blocks_register(w, qw, scales, biases, 12 - bits)  # read at the other width
    assert not ext.blocks_register(w, qw, scales, biases, 2)  # widths without a tile
    assert ext.blocks_count() == 0


@needs_blocks
@pytest.mark.parametrize("bits", [4, 8])
def test_gathered_rows_read_their_blocks_with_the_same_bits(bits):
    """A reduced-vocabulary head's rows (``weight[ids]``) read as those rows of the blocks."""
    w, qw, scales, biases = _blocks(300, 96, 11, bits)
    ids = mx.array([299, 0, 17, 17, 150, 3], dtype=mx.int32)
    rows = w[ids]
    x = mx.random.normal((9, 96), key=mx.random.key(6))
    assert not ext.blocks_register_rows(rows, w, ids)  # the whole matrix reads no blocks yet
    assert ext.blocks_register(w, qw, scales, biases, bits)
    try:
        before = [ext.small_linear(x[:m], w)[:, ids] for m in (1, 4, 9)]  # those rows of the whole
        mx.eval(before)
        assert not ext.blocks_register_rows(rows * 2, w, ids)  # not its rows
        assert not ext.blocks_register_rows(rows, w, ids[:-1])
        assert ext.blocks_register_rows(rows, w, ids)
        assert ext.blocks_count() == 2
        for m, want in zip((1, 4, 9), before):
            assert mx.array_equal(ext.small_linear(x[:m], rows), want).item(), m
    finally:
        ext.blocks_clear()


def _unregistered(model: nn.Module) -> nn.Module:
    """``model`` with its blocks forgotten: its float32 matrices read as they are stored."""
    for _, m in model.named_modules():
        if quantized.reads_blocks(m):
            ext.blocks_forget(m["weight"])
            del m._sb_q_bytes
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny model shipped as blocks (4-bit linears, an 8-bit tied embedding), loaded twice: one
    reads the blocks, the other its float32 matrices (the same values)."""
    from specbatch.kernels.models import load
    from specbatch.testing.tiny import build_tiny_model
    folder = build_tiny_model(tmp_path_factory.mktemp("blocks") / "llama", "llama", seed=6, quantized=True)
    ext and ext.blocks_clear()
    blocks = load(folder)
    assert ext is None or ext.blocks_count() == LAYER_MATRICES + 1  # and the embedding
    plain = load(folder)
    _unregistered(plain.model)
    yield plain, blocks
    ext and ext.blocks_clear()


@needs_blocks
def test_a_model_reading_blocks_keeps_each_rows_bits_near_its_float32_matrices(pair, tiny_draft):
    plain, blocks = pair
    assert ext.blocks_count() == LAYER_MATRICES + 1
    assert all(m.weight.dtype == mx.float32 for _, m in blocks.model.named_modules()
               if isinstance(m, (FastLinear, FastEmbedding)))
    for rows, positions in ((1, 1), (1, 2), (1, 4), (3, 1), (4, 1), (8, 2), (1, 40)):
        tokens = mx.random.randint(0, 200, (rows, positions), key=mx.random.key(rows * 100 + positions))
        logits = blocks.model(tokens)  # [rows, positions, vocab]
        assert mx.allclose(logits, plain.model(tokens), rtol=1e-4, atol=1e-4).item(), (rows, positions)
        for i in range(rows):  # each sequence's bits whatever sequences share the forward
            assert mx.array_equal(logits[i:i + 1], blocks.model(tokens[i:i + 1])).item(), (rows, positions, i)
    from specbatch.tools.bench import kernels
    assert kernels.weight_bytes(blocks.model) < kernels.weight_bytes(plain.model) / 2  # what a width-1 step reads
    for params in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 4}):
        want = run_plain(blocks, "blocks", max_tokens=20, **params)
        assert run_scalar(blocks, tiny_draft, "blocks", k=2, max_tokens=20, **params)[0] == want
        assert run_scalar(blocks, tiny_draft, "blocks", k=4, max_tokens=20, **params)[0] == want


@needs_blocks
def test_a_reduced_heads_rows_read_the_embeddings_blocks(pair):
    """An MTP head's kept vocabulary (``head_rows``) streams the tied head's 8-bit blocks too."""
    plain, blocks = pair
    ids = mx.array([5, 400, 7, 511, 5], dtype=mx.int32)
    before = ext.blocks_count()
    rows = blocks.model.model.embed_tokens.rows(ids)
    assert blocks.model.model.embed_tokens.rows(ids) is rows and ext.blocks_count() == before + 1  # once per ids
    stored = plain.model.model.embed_tokens.rows(ids)  # the same values, read as stored
    assert ext.blocks_count() == before + 1
    h = mx.random.normal((6, 64), key=mx.random.key(12))
    whole = blocks.model.model.embed_tokens["weight"]  # the tied head, read as its blocks
    for m in (1, 2, 6):
        got = ext.small_linear(h[:m], rows)
        assert mx.array_equal(got, ext.small_linear(h[:m], whole)[:, ids]).item(), m  # those rows' bits
        assert not mx.array_equal(got, ext.small_linear(h[:m], stored)).item(), m  # not the stored matrix's sums
        assert mx.allclose(got, ext.small_linear(h[:m], stored), rtol=1e-5, atol=1e-5).item(), m


def test_without_the_block_kernel_mlx_lms_dequantization_stands(tmp_path, monkeypatch):
    """``SPECBATCH_BLOCKS=0`` (or a CPU without the kernels): the linears and the embedding hold
    mlx-lm's float16-arithmetic values, half-stored where the kernels widen float16."""
    from specbatch.kernels.cpu import half
    from specbatch.kernels.models import load
    from specbatch.testing.tiny import build_tiny_model
    monkeypatch.setenv(quantized.ENV, "0")
    loaded = load(build_tiny_model(tmp_path / "m", "llama", seed=6, quantized=True))
    linears = [m for _, m in loaded.model.named_modules() if isinstance(m, (FastLinear, FastEmbedding))]
    assert len(linears) == LAYER_MATRICES + 1 and not any(quantized.reads_blocks(m) for m in linears)
    if half.supported(ext):
        assert all(m.weight.dtype == mx.float16 for m in linears)


def test_the_linears_and_the_embedding_are_collected_at_their_widths(tmp_path):
    from mlx_lm.utils import load as mlx_load

    from specbatch.testing.tiny import build_tiny_model
    model, _ = mlx_load(str(build_tiny_model(tmp_path / "m", "llama", seed=1, quantized=True)))
    found = quantized.blocks_of(model)
    assert {name: b.bits for name, b in found.items() if not name.endswith("proj")} == {"model.embed_tokens": 8}
    assert sum(b.bits == 4 for b in found.values()) == LAYER_MATRICES
    assert all(b.scales.dtype == mx.float16 for b in found.values())
    model.model.layers[0].mlp.up_proj.scales = model.model.layers[0].mlp.up_proj.scales.astype(mx.float32)
    assert len(quantized.blocks_of(model)) == LAYER_MATRICES  # another layout: left to mlx-lm


@needs_blocks
def test_a_models_blocks_are_released_with_it(tmp_path):
    import gc

    from specbatch.kernels.models import load
    from specbatch.testing.tiny import build_tiny_model
    from mlx_lm.models.cache import KVCache

    from specbatch.kernels.runner import ModelRunner
    before = ext.blocks_count()
    loaded = load(build_tiny_model(tmp_path / "gone", "llama", seed=8, quantized=True))
    assert ext.blocks_count() == before + LAYER_MATRICES + 1
    runner, cache = ModelRunner(loaded.model), [KVCache() for _ in loaded.model.layers]
    for tokens in ([3, 5, 7], [9]):  # the second a decoder stack op, which keeps its weights resolved
        mx.eval(runner.forward(mx.array([tokens], dtype=mx.int32), cache))
    weights = sum(v.nbytes for _, v in nn.utils.tree_flatten(loaded.model.parameters()))
    held = mx.get_active_memory()
    del loaded, runner, cache
    gc.collect()
    assert ext.blocks_count() == before
    assert mx.get_active_memory() < held - weights * 9 // 10  # the resolved weights went with their blocks


_PAGES = """
import json, sys
import mlx.core as mx
sys.path.insert(0, {tests!r})
from test_cpu_blocks import _blocks, ext
w, qw, scales, biases = _blocks(1536, 576, 23, 4)
read = ext.blocks_register(w, qw, scales, biases, 4)
held = ext.blocks_pages()
mx.save({out!r}, ext.small_linear(mx.random.normal((3, 576), key=mx.random.key(24)), w))
ext.blocks_clear()
print(json.dumps(dict(read=read, held=held, cleared=ext.blocks_pages())))
"""


@needs_blocks
def test_the_records_lie_in_the_arena_on_the_pages_asked_for(tmp_path):
    """The records live in huge-page chunks (arena.cpp) unless SPECBATCH_HUGE_PAGES=0, where the
    kernel is told never to back them with huge pages; a chunk is unmapped with its last records,
    and the pages never change a result's bits."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path
    runs = {}
    for advice in ("1", "0"):
        out = tmp_path / f"{advice}.npy"
        script = _PAGES.format(tests=str(Path(__file__).parent), out=str(out))
        done = subprocess.run([sys.executable, "-c", script], env={**os.environ, "SPECBATCH_HUGE_PAGES": advice},
                              check=True, timeout=120, capture_output=True, text=True)
        runs[advice] = json.loads(done.stdout.strip().splitlines()[-1]), mx.load(str(out))
    for advice, (pages, _) in runs.items():
        assert pages["held"]["advised"] is (advice == "1")
        assert pages["read"] <= pages["held"]["bytes"] < 2 * pages["read"]  # the records, padded to whole tiles
        assert pages["held"]["huge_bytes"] % (2 << 20) == 0 and pages["held"]["huge_bytes"] <= 32 << 20
        assert pages["cleared"]["bytes"] == 0 and pages["cleared"]["huge_bytes"] == 0
    assert runs["0"][0]["held"]["huge_bytes"] == 0
    assert mx.array_equal(runs["1"][1], runs["0"][1]).item()


@needs_blocks
def test_a_stack_reads_the_blocks_registered_at_each_call(tmp_path, monkeypatch):
    """The decoder stack keeps its weights resolved between calls (blocks included), never past a
    change to the registry: once a model's blocks are forgotten it reads its float32 matrices."""
    from mlx_lm.models.cache import KVCache

    from specbatch.kernels.models import load
    from specbatch.kernels.runner import ModelRunner
    from specbatch.testing.tiny import build_tiny_model
    folder = build_tiny_model(tmp_path / "m", "llama", seed=6, quantized=True)
    calls, op = [], ext.decoder_stack
    monkeypatch.setattr(ext, "decoder_stack", lambda *a: calls.append(1) or op(*a))

    def last_logits(model):
        runner, cache = ModelRunner(model), [KVCache() for _ in model.layers]
        for tokens in ([3, 5, 7, 9], [11], [13]):
            logits = runner.forward(mx.array([tokens], dtype=mx.int32), cache)
            mx.eval(logits)
        return logits

    model, floats = load(folder).model, _unregistered(load(folder).model)
    try:
        read_as_blocks = last_logits(model)
        assert mx.array_equal(last_logits(model), read_as_blocks).item() and calls
        want = last_logits(floats)
        assert not mx.array_equal(read_as_blocks, want).item()  # the blocks sum their own way
        _unregistered(model)
        assert mx.array_equal(last_logits(model), want).item()
    finally:
        del model, floats


_BOTH_ISAS = """
import sys
import mlx.core as mx
sys.path.insert(0, {tests!r})
from test_cpu_blocks import _blocks, ext
w, qw, scales, biases = _blocks(150, 96, 21, {bits})
assert ext.blocks_register(w, qw, scales, biases, {bits})
x = mx.random.normal((7, 96), key=mx.random.key(22))
mx.save({out!r}, ext.small_linear(x, w))
"""


@needs_blocks
@pytest.mark.parametrize("bits", [4, 8])
def test_the_tiles_give_the_same_bits_on_both_isas(tmp_path, bits):
    """The AVX-512 and AVX2 tiles run each row's FMAs in the same order: the same bits."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    if cpu.status().isa != "avx512":
        pytest.skip("one ISA here")
    outs = []
    for isa in ("avx512", "avx2"):
        out = tmp_path / f"{isa}.npy"
        script = _BOTH_ISAS.format(tests=str(Path(__file__).parent), out=str(out), bits=bits)
        subprocess.run([sys.executable, "-c", script], env={**os.environ, "SPECBATCH_CPU_ISA": isa}, check=True, timeout=120)
        outs.append(mx.load(str(out)))
    assert mx.array_equal(*outs).item()


@needs_blocks
def test_the_avx2_tile_passes_the_same_checks():
    """The 8-lane tiles pass the same checks."""
    from helpers import assert_passes_on_avx2
    assert_passes_on_avx2(__file__)


@needs_blocks
def test_a_loaded_heads_linears_read_8_bit_blocks_of_their_own(tiny, mtp_head, tmp_path):
    """A drafter's head saved in float16 loads with its linears' 8-bit blocks (their float32
    values, one rounding) and streams them; its drafts still leave the target's streams as they were."""
    from specbatch.kernels.drafters.mtp import save_head
    from specbatch.kernels.drafters.mtp_checkpoint import load_head
    save_head(mtp_head, tmp_path / "h")
    saved = mx.load(str(tmp_path / "h" / "mtp.safetensors"))
    head = load_head(tmp_path / "h")
    linears = {name: m for name, m in head.named_modules() if isinstance(m, FastLinear)}
    assert linears and all(quantized.reads_blocks(m) for m in linears.values())
    for name, m in linears.items():
        q, scales, biases = mx.quantize(saved[f"{name}.weight"].astype(mx.float16), group_size=32, bits=8)
        want = mx.dequantize(q, scales.astype(mx.float32), biases.astype(mx.float32), group_size=32, bits=8)
        assert m.weight.dtype == mx.float32 and mx.array_equal(m.weight, want).item(), name
        assert quantized.decode_bytes(m) < 0.6 * m.weight.size * 2  # under the float16 bytes
    for params in ({"temperature": 0.0}, {"temperature": 0.9, "seed": 2}):
        assert run_scalar(tiny, head, "def f(x):", k=3, max_tokens=16, ignore_eos=True, **params)[0] == \
            run_plain(tiny, "def f(x):", max_tokens=16, ignore_eos=True, **params)


def test_nothing_is_quantized_where_no_kernel_reads_blocks(mtp_head, monkeypatch):
    monkeypatch.setenv(quantized.ENV, "0")
    from mlx.utils import tree_flatten
    before = dict(tree_flatten(mtp_head.parameters()))
    assert quantized.quantize_linears(ext, mtp_head) == {}
    after = dict(tree_flatten(mtp_head.parameters()))
    assert after.keys() == before.keys() and all(after[name] is p for name, p in before.items())
