"""The CPU kernels against MLX's own ops, and the fallback that runs without them."""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specbatch.kernels import cpu
from specbatch.kernels.cpu import paged, wide
from specbatch.kernels.cpu.modules import FastEmbedding, FastLinear, use_cpu_kernels

needs_kernels = pytest.mark.skipif(not cpu.status().active, reason=f"CPU kernels inactive: {cpu.status().why}")


def _close(y: mx.array, x: mx.array, w: mx.array) -> None:
    # fp32 sums in another order: within 1e-5 of the magnitude of the summed terms
    scale = np.abs(np.array(x)).reshape(-1, x.shape[-1]) @ np.abs(np.array(w)).T
    err = np.abs(np.array(y).reshape(scale.shape) - (np.array(x).reshape(-1, x.shape[-1]) @ np.array(w).T))
    assert (err <= 1e-5 * scale + 1e-30).all(), float((err / (scale + 1e-30)).max())


@needs_kernels
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 90), k=st.integers(1, 700), n=st.integers(1, 300), seed=st.integers(0, 2**16))
def test_small_linear_matches_matmul_on_random_shapes(rows, k, n, seed):  # past 32 rows: the blocked path
    key = mx.random.key(seed)
    x = mx.random.normal((rows, k), key=key)
    w = mx.random.normal((n, k), key=mx.random.split(key)[1])
    _close(cpu.extension().small_linear(x, w), x, w)


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(rows=st.integers(2, 90), k=st.integers(1, 300), n=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(rows, k, n, seed):
    x = mx.random.normal((rows, k), key=mx.random.key(seed))
    w = mx.random.normal((n, k), key=mx.random.key(seed + 1))
    linear = cpu.extension().small_linear  # past 32 rows too: a prefill token's bits are a decode step's
    together = linear(x, w)
    for r in {0, rows // 2, rows - 1}:
        assert mx.array_equal(linear(x[r:r + 1], w)[0], together[r]).item()
        assert mx.array_equal(linear(x[: r + 1], w)[r], together[r]).item()


@needs_kernels
def test_a_narrowed_pool_gives_the_same_bits_and_releases_its_cap():
    ext = cpu.extension()
    x, w = mx.random.normal((3, 4, 200)), mx.random.normal((700, 200))  # enough columns to split
    q, kv = mx.random.normal((2, 3, 5, 64)), mx.random.normal((2, 1, 40, 64))
    # a decode over 3 KV heads and 3 key chunks: two threads split the middle head's chunks
    q1, k1, v1 = mx.random.normal((1, 9, 1, 64)), mx.random.normal((1, 3, 300, 64)), mx.random.normal((1, 3, 300, 64))
    def run():
        out = [ext.small_linear(x, w), cpu.attention(q, kv, kv, 0.125, "causal"), cpu.swiglu(w, w),
               cpu.attention(q1, k1, v1, 0.125, None)]
        mx.eval(out)
        return out
    threads, want = ext.threads(), run()
    with cpu.narrowed():
        assert ext.threads() == 1
        got = run()
    assert ext.threads() == threads
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))
    with pytest.raises(RuntimeError), cpu.narrowed():
        raise RuntimeError("the cap goes even when the block fails")
    assert ext.threads() == threads
    try:
        ext.pool_spin(0)  # workers that sleep between every op: the same bits
        assert all(mx.array_equal(a, b).item() for a, b in zip(run(), want))
    finally:
        ext.pool_spin(2000)



@needs_kernels
@pytest.mark.parametrize("on_kernel", [False, True])
def test_beside_the_blas_workers_sleep_at_once_and_spin_again_after(monkeypatch, on_kernel):
    ext = cpu.extension()
    monkeypatch.setattr(wide, "prefill_on_kernel", lambda _: on_kernel)
    with pytest.raises(RuntimeError), cpu.beside_blas(ext):
        inside = ext.pool_spin(0)  # the setting inside, read by replacing it with the same
        ext.pool_spin(inside)
        raise RuntimeError("the spin comes back even when the block fails")
    assert inside == (2000 if on_kernel else 0)  # wide linears on the kernel: its workers spin as ever
    assert ext.pool_spin(2000) == 2000

_PLACEMENT_PROBE = """
import glob, mlx.core as mx
from specbatch.kernels import cpu
def single():  # this process's threads allowed on exactly one CPU (Linux's task status)
    out = 0
    for path in glob.glob("/proc/self/task/*/status"):
        allowed = next(l.split()[1] for l in open(path) if l.startswith("Cpus_allowed_list:"))
        out += allowed.isdigit()
    return out
ext = cpu.extension()
x, w = mx.random.normal((2, 300)), mx.random.normal((4096, 300))  # columns enough for every thread
runs = []
for on in (True, False, True):
    ext.pool_pin(on)
    runs.append(ext.small_linear(x, w))
    mx.eval(runs[-1])
    print(single(), end=" ")
print(ext.threads(), all(mx.array_equal(r, runs[0]).item() for r in runs))
"""


@needs_kernels
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pinned_pool_threads_each_take_a_core_and_give_the_same_bits():
    import os
    import subprocess
    ext = cpu.extension()
    if ext.threads() < 2 or len(os.sched_getaffinity(0)) < ext.threads():
        pytest.skip("pinning needs as many CPUs as pool threads")
    # a fresh process: this one's other MLX stream threads were pinned by earlier tests
    out = subprocess.run([sys.executable, "-c", _PLACEMENT_PROBE], capture_output=True, text=True, check=True)
    pinned, floating, again, threads, same = out.stdout.split()
    # MLX's stream thread and each worker on a core of its own, then all back to the OS, then pinned again
    assert (int(pinned), int(floating), int(again)) == (int(threads), 0, int(threads))
    assert same == "True"  # every sum is one thread's whole: placement never changes a bit


@needs_kernels
def test_the_fma_peak_probe_runs_on_any_thread_count():
    ext = cpu.extension()
    whole = ext.fma_peak_gflops(2_000_000)  # a rate: its size is the bench's to read, never a test's
    with cpu.narrowed():
        alone = ext.fma_peak_gflops(2_000_000)
    assert whole > 0.0 and alone > 0.0 and ext.fma_peak_gflops(0) == 0.0


@needs_kernels
@pytest.mark.parametrize("size", [1, 63, 4096 + 200, 1 << 20])  # short of a line, of a step, ragged, whole
def test_the_read_bandwidth_probe_reads_any_size_on_any_thread_count(size):
    ext = cpu.extension()
    assert ext.read_bandwidth_gbs(size, 2) > 0.0  # a rate: its size is the bench's to read
    assert ext.read_bandwidth_gbs(size, 2, small_pages=True) > 0.0  # on 4 KB pages, for comparison
    with cpu.narrowed():
        assert ext.read_bandwidth_gbs(size, 1) > 0.0
    assert ext.read_bandwidth_gbs(0, 3) == 0.0 and ext.read_bandwidth_gbs(size, 0) == 0.0


@needs_kernels
def test_batched_strided_and_sliced_inputs():
    x = mx.random.normal((4, 3, 64))  # [batch, positions, K]: 12 rows
    w = mx.random.normal((96, 64))
    y = cpu.linear(x, w)
    assert y.shape == (4, 3, 96)
    _close(y, x, w)
    xt = mx.random.normal((64, 5)).T  # a transposed view
    _close(cpu.linear(xt, w), xt, w)
    ws = mx.random.normal((200, 64))[::2]  # every other weight row
    _close(cpu.linear(x, ws), x, ws)


@pytest.mark.parametrize("on_kernel", ["0", "1"])
def test_wide_inputs_take_the_kernel_or_the_blas_as_decided(monkeypatch, on_kernel):
    from specbatch.kernels.cpu import wide
    monkeypatch.setenv("SPECBATCH_PREFILL_KERNEL", on_kernel)
    wide.prefill_on_kernel.cache_clear()
    w = mx.random.normal((16, 8))
    x = mx.random.normal((cpu.MAX_ROWS + 9, 8))
    ext = cpu.extension()
    got = cpu.linear(x, w)
    if on_kernel == "1" and ext is not None:
        assert mx.array_equal(got, ext.small_linear(x, w)).item()
    else:
        assert mx.array_equal(got, x @ w.T).item()
    wide.prefill_on_kernel.cache_clear()


def test_other_dtypes_and_empty_inputs_use_mlx():
    w = mx.random.normal((16, 8))
    half = mx.random.normal((2, 8)).astype(mx.float16)
    assert cpu.linear(half, w.astype(mx.float16)).dtype == mx.float16
    assert cpu.linear(mx.zeros((0, 8)), w).shape == (0, 16)


@needs_kernels
def test_gradients_flow_through_the_kernel():
    x, w = mx.random.normal((3, 7)), mx.random.normal((5, 7))
    ours = mx.grad(lambda x, w: (cpu.linear(x, w) ** 2).sum(), argnums=(0, 1))(x, w)
    plain = mx.grad(lambda x, w: ((x @ w.T) ** 2).sum(), argnums=(0, 1))(x, w)
    for a, b in zip(ours, plain):
        assert mx.allclose(a, b, rtol=1e-4, atol=1e-4).item()


@needs_kernels
def test_swapped_model_keeps_its_parameters_and_outputs(tiny):
    model = tiny.model
    assert any(isinstance(m, FastLinear) for _, m in model.named_modules())  # load() swapped them
    plain = nn.Linear(8, 4)
    mx.eval(plain.parameters())
    holder = nn.Module()
    holder.proj, holder.emb, holder.layers = plain, nn.Embedding(10, 8), [nn.Linear(8, 8, bias=False)]
    x = mx.random.normal((2, 8))
    before = holder.proj(x), holder.emb.as_linear(x), holder.layers[0](x)
    assert use_cpu_kernels(holder) == 3
    assert isinstance(holder.proj, FastLinear) and isinstance(holder.emb, FastEmbedding)
    assert isinstance(holder.layers[0], FastLinear) and holder.proj.weight is plain.weight
    for a, b in zip(before, (holder.proj(x), holder.emb.as_linear(x), holder.layers[0](x))):
        assert mx.allclose(a, b, atol=1e-5).item()


@pytest.fixture
def kernels_off(monkeypatch):
    monkeypatch.setenv("SPECBATCH_CPU_KERNELS", "0")
    cpu.reset()
    yield
    monkeypatch.delenv("SPECBATCH_CPU_KERNELS")
    cpu.reset()


def test_forced_fallback_runs_mlx_and_says_why(kernels_off, capsys):
    state = cpu.status()
    assert not state.active and "SPECBATCH_CPU_KERNELS=0" in state.why
    holder = nn.Module()
    holder.proj = nn.Linear(8, 4)
    assert use_cpu_kernels(holder) == 0 and type(holder.proj) is nn.Linear
    x, w = mx.random.normal((2, 8)), mx.random.normal((4, 8))
    assert mx.array_equal(cpu.linear(x, w), x @ w.T).item()


def test_an_extension_built_for_another_mlx_is_refused(monkeypatch):
    if cpu.status().active is False and "not built" in cpu.status().why:
        pytest.skip("extension not built here")
    monkeypatch.setattr(mx, "__version__", "0.0.1")
    cpu.reset()
    try:
        state = cpu.status()
        assert not state.active and "running 0.0.1" in state.why
    finally:
        monkeypatch.undo()
        cpu.reset()


def _sdpa_ref(q, k, v, scale, mask):
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


@needs_kernels
@settings(max_examples=50, deadline=None)
@given(b=st.integers(1, 3), kv=st.integers(1, 3), group=st.integers(1, 3), length=st.integers(1, 20),
       extra=st.integers(0, 150), d=st.sampled_from([8, 24, 64, 80]), kind=st.sampled_from(["", "causal", "array"]),
       seed=st.integers(0, 2**16))
def test_attention_matches_mlx_on_random_shapes(b, kv, group, length, extra, d, kind, seed):
    key = iter(mx.random.split(mx.random.key(seed), 4))
    t = length + extra
    q = mx.random.normal((b, kv * group, length, d), key=next(key))
    k = mx.random.normal((b, kv, t, d), key=next(key))
    v = mx.random.normal((b, kv, t, d), key=next(key))
    mask = None if kind == "" else kind
    if kind == "array":
        mask = mx.random.uniform(shape=(b, 1, length, t), key=next(key)) > 0.4
        mask[..., 0] = True  # no row masked whole (MLX's answer there is NaN)
    ours = cpu.attention(q, k, v, 0.3, mask)
    assert mx.allclose(ours, _sdpa_ref(q, k, v, 0.3, mask), rtol=1e-5, atol=1e-5).item()


@needs_kernels
def test_attention_reads_a_strided_cache_without_copying_it_wrong():
    buf_k = mx.random.normal((2, 3, 64, 64))  # a cache buffer with room to grow
    buf_v = mx.random.normal((2, 3, 64, 64))
    k, v = buf_k[:, :, :37], buf_v[:, :, :37]  # the filled part: strided views
    q = mx.random.normal((2, 5, 9, 64)).transpose(0, 2, 1, 3)  # [B, H, L, D] as a model makes it
    for mask in (None, "causal"):
        assert mx.allclose(cpu.attention(q, k, v, 0.125, mask), _sdpa_ref(q, k, v, 0.125, mask),
                           rtol=1e-5, atol=1e-5).item()


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(length=st.integers(1, 6), filled=st.integers(6, 60), room=st.integers(0, 30),
       kind=st.sampled_from(["", "causal", "array"]), seed=st.integers(0, 2**16))
def test_attention_over_a_buffers_first_keys_is_the_sliced_views_bits(length, filled, room, kind, seed):
    key = iter(mx.random.split(mx.random.key(seed), 4))
    buf_k, buf_v = (mx.random.normal((2, 3, filled + room, 64), key=next(key)) for _ in range(2))  # a cache's buffer
    q = mx.random.normal((2, 6, length, 64), key=next(key))
    mask = None if kind == "" else kind
    if kind == "array":
        mask = mx.random.uniform(shape=(2, 1, length, filled), key=next(key)) > 0.4
        mask[..., 0] = True
    sliced = cpu.attention(q, buf_k[:, :, :filled], buf_v[:, :, :filled], 0.125, mask, merge_heads=True)
    in_place = cpu.attention(q, buf_k, buf_v, 0.125, mask, merge_heads=True, length=filled)
    assert mx.array_equal(in_place, sliced).item()
    with cpu.disabled():  # MLX's own op takes the slice: the same keys
        assert mx.allclose(cpu.attention(q, buf_k, buf_v, 0.125, mask, merge_heads=True, length=filled), sliced,
                           rtol=1e-5, atol=1e-5).item()


@needs_kernels
def test_attention_refuses_a_length_past_the_keys():
    k = v = mx.zeros((1, 1, 8, 64))
    with pytest.raises(ValueError, match="length"):
        cpu.extension().attention(mx.zeros((1, 1, 1, 64)), k, v, 1.0, "", mx.array(False), False, 9)


@needs_kernels
def test_a_query_rows_attention_is_the_same_bits_alone_or_in_a_verify():
    k, v = mx.random.normal((1, 3, 50, 64)), mx.random.normal((1, 3, 50, 64))
    q = mx.random.normal((1, 9, 12, 64))
    verify = cpu.attention(q, k, v, 0.125, "causal")  # 12 positions ending at key 49
    for i in (0, 5, 11):
        alone = cpu.attention(q[:, :, i:i + 1], k[:, :, : 50 - 11 + i], v[:, :, : 50 - 11 + i], 0.125, None)
        assert mx.array_equal(alone[:, :, 0], verify[:, :, i]).item()


@needs_kernels
def test_a_prefill_chunk_matches_mlx_and_each_row_decoded_alone():
    k, v = mx.random.normal((2, 2, 130, 64)), mx.random.normal((2, 2, 130, 64))
    q = mx.random.normal((2, 6, 100, 64))  # a chunk: larger query blocks than a verify's
    chunk = cpu.attention(q, k, v, 0.125, "causal")
    assert mx.allclose(chunk, _sdpa_ref(q, k, v, 0.125, "causal"), rtol=1e-5, atol=1e-5).item()
    for i in (0, 31, 32, 99):
        alone = cpu.attention(q[:, :, i:i + 1], k[:, :, : 31 + i], v[:, :, : 31 + i], 0.125, None)
        assert mx.array_equal(alone[:, :, 0], chunk[:, :, i]).item()


def _blocked(pool: mx.array) -> mx.array:
    """A key pool ``[H, P, D]`` as the kernels store it: each 16-slot block as ``[D][16]``."""
    H, P, D = pool.shape
    return mx.contiguous(pool.reshape(H, P // 16, 16, D).transpose(0, 1, 3, 2)).reshape(H, P, D)


@needs_kernels
@settings(max_examples=40, deadline=None)
@given(b=st.integers(1, 3), kv=st.integers(1, 3), group=st.integers(1, 3), length=st.integers(1, 12),
       t=st.integers(12, 70), kind=st.sampled_from(["", "causal", "array"]), runs=st.booleans(),
       seed=st.integers(0, 2**16))
def test_paged_attention_reads_the_pools_as_the_gathered_view(b, kv, group, length, t, kind, runs, seed):
    """Keys through a row's blocks (a table's whole blocks, read in place) or any slots
    (gathered), against the same keys gathered into a dense buffer: the same bits."""
    rng = np.random.default_rng(seed)
    d, pool_rows = 64, 160
    k_pool = mx.array(rng.standard_normal((kv, pool_rows, d)), dtype=mx.float32)  # [Hkv, P, D]
    v_pool = mx.array(rng.standard_normal((kv, pool_rows, d)), dtype=mx.float32)
    if runs:  # a block table's rows: whole 16-slot blocks in any order
        rows = [np.concatenate([16 * blk + np.arange(16) for blk in rng.permutation(pool_rows // 16)])[:t]
                for _ in range(b)]
    else:
        rows = [rng.permutation(pool_rows)[:t] for _ in range(b)]
    slots = mx.array(np.stack(rows), dtype=mx.int32)  # [B, T]
    q = mx.array(rng.standard_normal((b, kv * group, length, d)), dtype=mx.float32)
    mask = None if kind == "" else kind
    if kind == "array":
        mask = mx.array(rng.random((b, 1, length, t)) > 0.4)
        mask[..., 0] = True
    gathered = [p[:, slots].transpose(1, 0, 2, 3) for p in (k_pool, v_pool)]  # [Hkv, B, T, D] -> [B, Hkv, T, D]
    read = paged.paged_attention(q, (_blocked(k_pool), v_pool, slots), 0.125, mask)
    assert mx.array_equal(read, cpu.attention(q, *gathered, 0.125, mask)).item()  # same keys, same order: same bits


@needs_kernels
@settings(max_examples=25, deadline=None)
@given(b=st.sampled_from([1, 3]), kv=st.sampled_from([1, 3]), group=st.integers(1, 3), length=st.integers(1, 8),
       t=st.integers(256, 700), d=st.sampled_from([32, 64, 128]), kind=st.sampled_from(["", "causal"]),
       seed=st.integers(0, 2**16))
def test_attention_over_many_value_chunks_is_each_rows_decode_bits(b, kv, group, length, t, d, kind, seed):
    """Decode and verify queries over hundreds of keys (softmax chunks of 128 keys folded in
    key order, a row's chunks split over the threads): MLX's values, paged the dense call's
    bits, each query row the bits of that row decoded alone, and on one thread the same bits."""
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((b, kv * group, length, d)), dtype=mx.float32)
    mask = None if kind == "" else kind
    pools = [mx.array(rng.standard_normal((kv, 768, d)), dtype=mx.float32) for _ in range(2)]
    blocks = [rng.permutation(768 // 16)[: (t + 15) // 16] for _ in range(b)]  # whole blocks, any order
    slots = mx.array(np.stack([(blk[:, None] * 16 + np.arange(16)).reshape(-1)[:t] for blk in blocks]),
                     dtype=mx.int32)  # [B, T]
    k, v = (p[:, slots].transpose(1, 0, 2, 3) for p in pools)  # [B, Hkv, T, D]
    dense = cpu.attention(q, k, v, 0.125, mask)
    assert mx.allclose(dense, _sdpa_ref(q, k, v, 0.125, mask), rtol=1e-5, atol=1e-5).item()
    assert mx.array_equal(paged.paged_attention(q, (_blocked(pools[0]), pools[1], slots), 0.125, mask), dense).item()
    i = length - 1 if kind else 0  # a causal row sees the keys up to its own
    seen = t - length + 1 + i if kind else t
    alone = cpu.attention(q[:, :, i:i + 1], k[:, :, :seen], v[:, :, :seen], 0.125, None)
    assert mx.array_equal(alone[:, :, 0], dense[:, :, i]).item()
    with cpu.narrowed():
        assert mx.array_equal(cpu.attention(q, k, v, 0.125, mask), dense).item()


@needs_kernels
def test_paged_attention_with_a_slot_outside_the_pool_gives_nan_not_a_stray_read():
    pools = mx.zeros((1, 16, 64)), mx.zeros((1, 16, 64))
    out = paged.paged_attention(mx.zeros((1, 1, 1, 64)), (*pools, mx.array([[0, 17]], dtype=mx.int32)), 1.0, None)
    assert mx.isnan(out).all().item()
    with pytest.raises(ValueError, match="multiple of 16"):  # key pools hold whole 16-slot blocks
        paged.paged_attention(mx.zeros((1, 1, 1, 64)), (mx.zeros((1, 8, 64)),) * 2 + (mx.zeros((1, 2), dtype=mx.int32),),
                            1.0, None)


@needs_kernels
@pytest.mark.parametrize("kind", ["", "causal", "additive"])
def test_attention_writes_heads_merged_as_the_transpose_would(kind):
    rng = np.random.default_rng(3)
    q = mx.array(rng.standard_normal((2, 6, 5, 16)), dtype=mx.float32)  # [B, Hq, L, D]
    k, v = (mx.array(rng.standard_normal((2, 2, 9, 16)), dtype=mx.float32) for _ in range(2))  # [B, Hkv, T, D]
    mask = {"": None, "causal": "causal", "additive": mx.zeros((1, 1, 5, 9))}[kind]  # additive: MLX's op
    split = cpu.attention(q, k, v, 0.25, mask)  # [B, Hq, L, D]
    merged = cpu.attention(q, k, v, 0.25, mask, merge_heads=True)  # [B, L, Hq * D]
    assert merged.shape == (2, 5, 96)
    assert mx.array_equal(merged, split.transpose(0, 2, 1, 3).reshape(2, 5, 96)).item()
    if kind != "additive":
        pools = [mx.pad(x.transpose(1, 0, 2, 3).reshape(2, 18, 16), [(0, 0), (0, 14), (0, 0)])
                 for x in (k, v)]  # [Hkv, B * T (+ 14), D]
        slots = mx.arange(18, dtype=mx.int32).reshape(2, 9)
        read = paged.paged_attention(q, (_blocked(pools[0]), pools[1], slots), 0.25, mask, merge_heads=True)
        assert mx.array_equal(read, merged).item()


@needs_kernels
@settings(max_examples=30, deadline=None)
@given(b=st.integers(1, 3), h=st.integers(1, 3), n=st.integers(1, 5), d=st.sampled_from([1, 8, 64]),
       seed=st.integers(0, 2**16))
def test_paged_write_stores_rows_as_the_scatter_does(b, h, n, d, seed):
    rng = np.random.default_rng(seed)
    pool_rows = 48
    pool = mx.array(rng.standard_normal((h, pool_rows, d)), dtype=mx.float32)  # [H, P, D]
    rows = mx.array(rng.standard_normal((b, h, n, d)), dtype=mx.float32)  # [B, H, N, D]
    slots = mx.array(rng.permutation(pool_rows)[:b * n], dtype=mx.int32)  # [B * N]
    expected = mx.array(pool)
    expected[:, slots] = rows.transpose(1, 0, 2, 3).reshape(h, b * n, d)
    assert mx.array_equal(paged.paged_write(pool, slots, rows), expected).item()
    # a key pool's 16-slot blocks: the same rows where its blocked layout puts them
    assert mx.array_equal(paged.paged_write(_blocked(pool), slots, rows, blocked=True), _blocked(expected)).item()
    # rows sliced out of a larger buffer (a cache's tokens: strided, read in place)
    buffer = mx.array(rng.standard_normal((b, h, n + 5, d)), dtype=mx.float32)
    buffer[:, :, 2:2 + n] = rows
    assert mx.array_equal(paged.paged_write(pool, slots, buffer[:, :, 2:2 + n]), expected).item()


@needs_kernels
def test_paged_write_keeps_a_pool_still_held_and_skips_slots_outside():
    held = mx.zeros((1, 4, 2))
    mx.eval(held)
    rows = mx.ones((1, 1, 2, 2))
    before = cpu.extension().paged_write_copies()
    out = paged.paged_write(held, mx.array([1, 7], dtype=mx.int32), rows)  # slot 7 is past the pool
    assert out.tolist() == [[[0, 0], [1, 1], [0, 0], [0, 0]]]
    assert held.tolist() == [[[0, 0]] * 4]  # still referenced here: copied, not written in place
    assert cpu.extension().paged_write_copies() == before + 1


def _resident() -> int:
    """This process's resident bytes."""
    import os

    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGESIZE")


@needs_kernels
@pytest.mark.parametrize("axis, shape, dtype", [(1, (3, 40, 8), mx.float32), (1, (2, 4000, 64), mx.float32),
                                                (0, (5000, 24), mx.uint32), (0, (300, 6), mx.float16)])
def test_pool_reserve_keeps_the_held_slots_and_zeroes_the_rest(axis, shape, dtype):
    """Each outer index's first ``keep`` slots copied, every later slot zero, also where the
    new buffer's memory held other numbers before (a recycled allocation) and where the
    zeros are whole pages handed back rather than written (the larger shapes)."""
    rng = np.random.default_rng(0)
    old = mx.array(rng.integers(1, 1000, shape)).astype(dtype)
    for keep, slots in ((shape[axis], 2 * shape[axis]), (shape[axis] // 3, shape[axis] + 17), (0, 64)):
        new_shape = shape[:axis] + (slots,) + shape[axis + 1:]
        garbage = mx.full(new_shape, 7, dtype)  # an array of the same size to free just before
        mx.eval(garbage)
        del garbage
        grown = paged.pool_reserve(old, axis, slots, keep)
        expected = np.zeros(new_shape, np.asarray(old).dtype)
        index = (slice(None),) * axis + (slice(0, keep),)
        expected[index] = np.asarray(old)[index]
        assert grown.shape == new_shape and grown.dtype == dtype
        assert np.array_equal(np.asarray(grown), expected), (keep, slots)


@needs_kernels
def test_pool_reserve_headroom_takes_no_memory_until_written():
    """A 384 MB reserve over 3 held slots: the process grows by far less than the reserve."""
    held = mx.ones((3, 3, 64))
    mx.eval(held)
    before = _resident()
    grown = paged.pool_reserve(held, 1, 1 << 19, 3)  # [3, 2^19, 64] float32: 384 MB
    mx.eval(grown)
    assert _resident() - before < 16 << 20
    assert grown[:, :3].tolist() == held.tolist() and grown[:, 3:].sum().item() == 0


@needs_kernels
def test_pool_reserve_refuses_a_keep_past_either_size():
    with pytest.raises(ValueError, match="keep"):
        paged.pool_reserve(mx.zeros((2, 8, 4)), 1, 16, 9)
    with pytest.raises(ValueError, match="keep"):
        paged.pool_reserve(mx.zeros((2, 8, 4)), 1, 4, 6)
    with pytest.raises(ValueError, match="axis"):
        paged.pool_reserve(mx.zeros((2, 8, 4)), 3, 16, 0)


@needs_kernels
def test_a_paged_decode_step_writes_its_pools_in_place(tiny):
    from mlx_lm.models.cache import KVCache

    from specbatch.kernels.kv import BatchKV
    from specbatch.kernels.paged_kv import batch_kv
    model = tiny.model
    kv = batch_kv(len(model.layers), layout="paged")
    for prompt in ([5, 6, 7], [8, 9]):
        single = [KVCache() for _ in model.layers]
        model(mx.array(prompt)[None], cache=single)
        kv.extend(BatchKV.from_singles(single))
    mx.eval(kv.arrays())
    for _ in range(3):
        before = cpu.extension().paged_write_copies()
        mx.eval(model(mx.array([[9], [10]]), cache=kv.layers))
        assert cpu.extension().paged_write_copies() == before  # every pool donated to its write


_TWO_STREAMS = """
import threading, specbatch, mlx.core as mx
from specbatch.kernels import cpu
w, x = mx.random.normal((4096, 576)), mx.random.normal((4, 576))
ref = x @ w.T
mx.eval(w, x, ref)
wrong = []
def work():
    with mx.stream(mx.new_stream(mx.cpu)):
        for _ in range(200):
            y = cpu.linear(x, w)
            wrong.append(not mx.allclose(y, ref, atol=1e-3).item())
threads = [threading.Thread(target=work) for _ in range(2)]
[t.start() for t in threads]
[t.join() for t in threads]
print(sum(wrong))
"""


@needs_kernels
def test_kernels_on_two_streams_at_once_take_turns_in_the_pool():
    # two engines' streams computing together (one finishing a lookahead as the next starts)
    # overwrote each other's job in the pool and crashed; in a child, so a crash is a failure
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _TWO_STREAMS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "0", (out.returncode, out.stderr[-2000:])


def test_additive_masks_and_half_precision_use_mlx():
    q, k, v = (mx.random.normal((1, 2, 3, 8)) for _ in range(3))
    additive = mx.zeros((1, 1, 3, 3))
    assert mx.allclose(cpu.attention(q, k, v, 0.5, additive), _sdpa_ref(q, k, v, 0.5, additive)).item()
    half = [a.astype(mx.float16) for a in (q, k, v)]
    assert cpu.attention(*half, 0.5, None).dtype == mx.float16


def test_disabled_runs_mlx_ops_on_this_thread_only():
    x, w = mx.random.normal((2, 8)), mx.random.normal((4, 8))
    with cpu.disabled():
        assert mx.array_equal(cpu.linear(x, w), x @ w.T).item()
        q = mx.random.normal((1, 2, 3, 8))
        ref = mx.fast.scaled_dot_product_attention(q, q, q, scale=0.5, mask="causal")
        assert mx.array_equal(cpu.attention(q, q, q, 0.5, "causal"), ref).item()
    assert not cpu._off.get()


@needs_kernels
def test_the_avx2_kernels_pass_the_same_checks():
    # on an AVX-512 CPU the AVX2 path runs only when asked: rerun this file's checks there
    import os
    import subprocess
    import sys

    from helpers import assert_passes_on_avx2
    assert_passes_on_avx2(__file__)
    env = {**os.environ, "SPECBATCH_CPU_ISA": "avx2"}
    probe = subprocess.run([sys.executable, "-c", "import specbatch; from specbatch.kernels import cpu; "
                            "print(cpu.status().isa)"], env=env, capture_output=True, text=True, timeout=120)
    assert probe.stdout.strip() == "avx2", probe.stderr


@needs_kernels
def test_the_wide_linear_probe_measures_once_and_says_what_it_chose(monkeypatch):
    from specbatch.kernels.cpu import wide
    monkeypatch.delenv("SPECBATCH_PREFILL_KERNEL", raising=False)
    wide.prefill_on_kernel.cache_clear()
    calls = []
    real = cpu.extension()

    class Counting:  # the extension, counting the probe's kernel calls
        def small_linear(self, x, w):
            calls.append(x.shape)
            return real.small_linear(x, w)

        def half_weights(self):
            return real.half_weights()
    ext = Counting()
    chosen = wide.prefill_on_kernel(ext)
    assert isinstance(chosen, bool) and calls and all(shape == (256, 576) for shape in calls)
    assert wide.prefill_on_kernel(ext) is chosen and len(calls) == 6  # warm-up and 5 timed, once
    wide.prefill_on_kernel.cache_clear()
