"""Wide linears: prefill's rows past the small-M kernel's 32, on the kernel or on the BLAS.

The small-M kernel also takes any number of rows (8-row slabs against L2-sized blocks of the
weights) with each row's bits independent of the rows around it, so a prefill chunk then has
the bits it has inside any larger forward, and a prompt token the bits a decode step would
give it. Whether it beats this process's BLAS depends on the BLAS: an AVX-512 OpenBLAS sgemm
runs ~1.2x faster than the kernel on this project's machines, the same library pinned to its
Haswell kernels (``OPENBLAS_CORETYPE``) ~1.4x slower. :func:`prefill_on_kernel` measures once
a process and says. On the BLAS, :func:`row_blocks` keeps a merged prefill's chunks apart where
the sgemm would change their bits (:func:`merged_rows_match`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import time

import mlx.core as mx
import structlog

from .half import supported, weight_ok, widened
from .scoped import Scoped

log = structlog.get_logger(__name__)

_blocks = Scoped(0)  # inside `row_blocks(n)` on this thread: its rows
MARGIN = 1.1  # the kernel takes wide linears only this much faster than the BLAS (noise)


def row_blocks(rows: int):
    """Inside this block a wide ``linear`` whose rows are a multiple of ``rows`` gives each
    block of ``rows`` the bits a matmul of that block alone gives: one call where this BLAS
    keeps them (``merged_rows_match``), else a batched matmul over a broadcast weight (one
    sgemm per block, 10-20% slower), so a merged prefill equals its chunks on any CPU."""
    return _blocks.within(rows)


@functools.lru_cache(maxsize=None)
def merged_rows_match(chunk: int, big: int, shapes: tuple) -> bool:
    """Whether ``x[i:i + chunk] @ W.T`` has the bits of those rows of ``x[:big] @ W.T`` at every
    chunk boundary, for each weight shape ``(out, in)``: probed once a process, since sgemm
    kernels differ (an AVX-512 OpenBLAS kept them at every size measured; its Zen AVX2
    kernels kept 48-row chunks of 480 for some shapes only)."""
    keys = mx.random.split(mx.random.key(0))
    for out, inp in shapes:
        w, x = mx.random.normal((out, inp), key=keys[0]), mx.random.normal((big, inp), key=keys[1])
        full = x @ w.T  # [big, out]
        for i in range(0, big, chunk):
            if not mx.array_equal(x[i:i + chunk] @ w.T, full[i:i + chunk]).item():
                log.info("blas_rows_differ", chunk=chunk, merged=big, shape=(out, inp),
                         then="one sgemm per chunk")
                return False
    return True


@functools.lru_cache(maxsize=None)
def prefill_on_kernel(ext) -> bool:
    """Whether wide linears run on the kernel (``ext.small_linear``), one answer a process for
    every weight dtype (so a half-stored model and its float32 twin take the same path and keep
    the same bits): measured once (when a model's layers are swapped, ``use_cpu_kernels``), a
    256-row product against a 1536 x 576 weight both ways in turn, 5 times, the weight float16
    where the CPU takes half weights (what ``models.load`` stores; the BLAS arm widens it first,
    as :func:`wide_linear` does); the kernel only at ``MARGIN`` times the BLAS's speed.
    ``SPECBATCH_PREFILL_KERNEL=1`` / ``0`` decides instead."""
    forced = os.environ.get("SPECBATCH_PREFILL_KERNEL", "")
    if forced in ("0", "1"):
        return forced == "1"
    keys = mx.random.split(mx.random.key(1))
    x, w = mx.random.normal((256, 576), key=keys[0]), mx.random.normal((1536, 576), key=keys[1])
    w = w.astype(mx.float16) if supported(ext) else w
    mx.eval(x, w, ext.small_linear(x, w), x @ widened(w).T)  # warm both
    kernel, blas = [], []
    for _ in range(5):
        t0 = time.perf_counter()
        mx.eval(ext.small_linear(x, w))
        kernel.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        mx.eval(x @ widened(w).T)
        blas.append(time.perf_counter() - t0)
    chosen = min(blas) >= MARGIN * min(kernel)
    log.info("prefill_linears", on="kernel" if chosen else "blas", kernel_ms=round(min(kernel) * 1e3, 3),
             blas_ms=round(min(blas) * 1e3, 3), weights=str(w.dtype))
    return chosen


@contextlib.contextmanager
def beside_blas(ext):
    """Kernels evaluated while this block runs leave their idle workers asleep at once: a
    prefill's wide linears run on the BLAS's own threads between them, and a worker spinning
    2 ms after each op took a core from those (a 1,440-token prefill on a Zen 3: 0.90x the
    time without the spin). Where wide linears run on the kernel the workers spin as ever."""
    if ext is None or prefill_on_kernel(ext):
        yield
        return
    before = ext.pool_spin(0)
    try:
        yield
    finally:
        ext.pool_spin(before)


def wide_linear(ext, x: mx.array, weight: mx.array, rows: int) -> mx.array:
    """``x @ weight.T`` for more rows than the small-M kernel's: the kernel where it is the
    faster (``prefill_on_kernel``; float32 or float16 weights), else the BLAS, each
    ``row_blocks`` block apart where this BLAS would change its bits inside the larger product."""
    if (ext is not None and x.dtype == mx.float32 and weight_ok(ext, weight) and weight.ndim == 2
            and prefill_on_kernel(ext)):
        return ext.small_linear(x, weight)
    weight = widened(weight)  # a half-stored weight: the BLAS multiplies its exact float32 values
    block = _blocks.get()
    if (block and rows > block and rows % block == 0 and weight.ndim == 2
            and not merged_rows_match(block, rows, (tuple(weight.shape),))):
        n, k = weight.shape
        w = mx.broadcast_to(weight.T, (rows // block, k, n))  # batched: MLX folds a 2-D weight's batch into M
        return (x.reshape(rows // block, block, k) @ w).reshape(*x.shape[:-1], n)
    return x @ weight.T
