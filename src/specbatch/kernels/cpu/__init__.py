"""specbatch's CPU kernels: MLX primitives written for this backend's small-M regime.

MLX's x86 CPU backend sends every float32 matmul to ``cblas_sgemm``, which at decode and
verify shapes (1-32 rows against a weight matrix) reads the weights at a fraction of the
memory bandwidth. ``small_linear`` streams each weight row once for all rows (AVX2+FMA, or
AVX-512 where the CPU has it, chosen at run time; threads over output columns); a row's
result is bitwise the same however many rows share the call; prefill's wider inputs take it
too where it beats the BLAS (:mod:`.wide`).

The extension (``_ext``, built at install by ``setup.py`` against the pinned MLX) is used
on the CPU device only. Where it cannot run (not built, built for another MLX, a CPU
without AVX2, ``SPECBATCH_CPU_KERNELS=0``) :func:`status` says why, one log line says so,
and :func:`linear` and :func:`attention` are plain MLX. ``SPECBATCH_CPU_ISA=avx2`` runs the
AVX2 kernels on an AVX-512 CPU.

``rms_norm`` and ``rope`` are one op each where MLX's CPU backend composes ~8 and ~20
(sines and cosines recomputed per call and head); ``swiglu`` is one op with a vectorised exp
(MLX's CPU exp runs one float at a time); ``gumbel`` is the sampler's keyed noise as one op.

``attention`` does softmax(q k^T) v for decode, verify and prefill queries over a strided
KV (no copy of the cache), with a vectorised exp, query blocks (every head of a KV group
together) that read and transpose each key once,
and keys past a block's causal limit never read.

Vocabulary: *rows* are the token rows of ``x`` (batch x positions) that share one read
of the weights; *small* means at most ``MAX_ROWS`` of them.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import attrs
import mlx.core as mx
import structlog

from .half import weight_ok
from .scoped import Scoped
from .wide import beside_blas, merged_rows_match, prefill_on_kernel, row_blocks, wide_linear  # noqa: F401 (re-exported)

log = structlog.get_logger(__name__)

MAX_ROWS = 32
_OFF = "SPECBATCH_CPU_KERNELS"


@attrs.frozen
class KernelStatus:
    active: bool
    isa: str  # "avx512", "avx2" or "" where inactive
    why: str  # the reason where inactive, "" otherwise


_loaded: dict = {}
_off = Scoped(False)  # inside `disabled()` on this thread


def disabled():
    """Run MLX's own ops inside this block (baselines measured on the same loaded model)."""
    return _off.within(True)


@contextlib.contextmanager
def narrowed(threads: int = 1):
    """Kernels evaluated while this block runs split over at most ``threads`` threads: a small
    graph handed to ``mx.async_eval`` computes on one core while this thread builds the next
    graph on the other (every sum is one thread's whole, so the bits never change)."""
    ext = _active()
    if ext is None:
        yield
        return
    ext.pool_cap(threads)
    try:
        yield
    finally:
        ext.pool_cap(0)


def _load() -> tuple[object | None, KernelStatus]:
    if os.environ.get(_OFF) == "0":
        return None, KernelStatus(False, "", f"{_OFF}=0")
    if mx.default_device() != mx.cpu:
        return None, KernelStatus(False, "", f"default device is {mx.default_device()}, not the CPU")
    try:
        ext = importlib.import_module(f"{__name__}._ext")
    except ImportError as exc:
        return None, KernelStatus(False, "", f"extension not built or not loadable ({exc})")
    if ext.built_for_mlx != mx.__version__:
        return None, KernelStatus(False, "", f"built for MLX {ext.built_for_mlx}, running {mx.__version__}")
    if ext.isa() == "none":
        return None, KernelStatus(False, "", "the CPU lacks AVX2/FMA")
    return ext, KernelStatus(True, ext.isa(), "")


def extension():
    """The loaded extension module, or None (once per process; logs the outcome once)."""
    if "ext" not in _loaded:
        ext, state = _load()
        _loaded["ext"], _loaded["status"] = ext, state
        if state.active:
            log.info("cpu_kernels", active=True, isa=state.isa, threads=ext.threads())
        else:
            log.info("cpu_kernels", active=False, why=state.why, fallback="mlx ops")
    return _loaded["ext"]


def status() -> KernelStatus:
    extension()
    return _loaded["status"]


def reset() -> None:
    """Forget the loaded state (tests flip ``SPECBATCH_CPU_KERNELS``)."""
    _loaded.clear()


def rows_of(x: mx.array) -> int:
    return x.size // max(1, x.shape[-1])


def _active():
    return None if _off.get() else extension()


def linear(x: mx.array, weight: mx.array) -> mx.array:
    """``x @ weight.T`` (``x`` [..., K], ``weight`` [N, K]): the small-M kernel where it
    applies, wide inputs as :func:`wide.wide_linear` says, MLX's matmul for other dtypes and
    other devices."""
    ext, rows = _active(), rows_of(x)
    if rows > MAX_ROWS:
        return wide_linear(ext, x, weight, rows)
    if ext is None or x.dtype != mx.float32 or not weight_ok(ext, weight) or rows == 0 or weight.ndim != 2:
        return x @ weight.T
    return ext.small_linear(x, weight)


def _merged(out: mx.array) -> mx.array:
    """[B, Hq, L, D] -> [B, L, Hq * D]."""
    B, H, L, D = out.shape
    return out.transpose(0, 2, 1, 3).reshape(B, L, H * D)


_NO_MASK = mx.array(False)


def attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask,
              merge_heads: bool = False, length: int = 0) -> mx.array:
    """softmax(queries keys^T * scale) values: ``queries`` [B, Hq, L, D], ``keys``/``values``
    [B, Hkv, T, D]; ``mask`` None, ``"causal"`` or a bool array [B or 1, 1, L, T]. The kernel
    where it applies, ``mx.fast.scaled_dot_product_attention`` otherwise (additive masks,
    other dtypes, other devices). ``merge_heads``: [B, L, Hq * D] out (the output
    projection's input, written so by the kernel), else [B, Hq, L, D]. ``length`` > 0: only
    the first ``length`` keys (a cache's buffer read in place; T is then ``length``)."""
    ext = _active()
    kind = "" if mask is None else mask if isinstance(mask, str) else "array"
    usable = (ext is not None and queries.dtype == keys.dtype == values.dtype == mx.float32
              and queries.ndim == 4 and queries.shape[-1] <= 256 and kind in ("", "causal", "array")
              and (kind != "array" or (mask.dtype == mx.bool_ and mask.ndim == 4 and mask.shape[1] == 1)))
    if not usable:
        if length:
            keys, values = keys[..., :length, :], values[..., :length, :]
        out = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        return _merged(out) if merge_heads else out
    T = length or keys.shape[2]
    if kind == "array" and mask.shape[2:] != (queries.shape[2], T):
        mask = mx.broadcast_to(mask, (mask.shape[0], 1, queries.shape[2], T))
    return ext.attention(queries, keys, values, scale, kind, mask if kind == "array" else _NO_MASK, merge_heads,
                         length)


def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``mx.fast.rms_norm`` as one kernel op (float32 on the CPU), MLX's op otherwise."""
    ext = _active()
    if ext is None or x.dtype != mx.float32 or weight.dtype != mx.float32 or x.ndim < 1:
        return mx.fast.rms_norm(x, weight, eps)
    return ext.rms_norm(x, weight, eps)


def add_rms_norm(x: mx.array, r: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array] | None:
    """``(h, rms_norm(h))`` for ``h = x + r`` as one kernel op (float32 on the CPU), each
    bitwise what the add and :func:`rms_norm` give apart; None where it does not apply."""
    ext = _active()
    if (ext is None or x.shape != r.shape or x.ndim < 1 or weight.ndim != 1
            or any(a.dtype != mx.float32 for a in (x, r, weight))):
        return None
    return tuple(ext.add_rms_norm(x, r, weight, eps))


def mlp_block(x: mx.array, r: mx.array, norm_weight: mx.array, eps: float, wg, wu, wd, wo=None) -> mx.array | None:
    """``h + down(swiglu(gate(n), up(n)))`` for ``h = x + r``, ``n = rms_norm(h)`` as one op (float32
    decode and verify rows; bitwise the separate kernels); with ``wo`` ``r`` is attention's merged
    heads, projected first (``r @ wo.T``, the output projection). None where it does not apply."""
    ext = _active()
    if (ext is None or (wo is None and x.shape != r.shape) or not 0 < rows_of(x) <= MAX_ROWS
            or any(a.dtype != mx.float32 for a in (x, r, norm_weight))
            or not all(weight_ok(ext, w) for w in (wg, wu, wd) + (() if wo is None else (wo,)))):
        return None
    return ext.mlp_block(x, r, norm_weight, eps, wg, wu, wd, wo)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` as one kernel op (float32 on the CPU, any shape; MLX computes its
    exps one at a time), mlx-lm's ``swiglu`` otherwise."""
    ext = _active()
    if ext is None or gate.dtype != mx.float32 or up.dtype != mx.float32 or gate.shape != up.shape:
        from mlx_lm.models.activations import swiglu as mlx_swiglu
        return mlx_swiglu(gate, up)
    return ext.swiglu(gate, up)


def _fmix(h: mx.array) -> mx.array:
    """murmur3's 32-bit finaliser on uint32 arrays (the kernel's hash, in MLX ops)."""
    h = h ^ (h >> 16)
    h = h * 0x85EBCA6B
    h = h ^ (h >> 13)
    h = h * 0xC2B2AE35
    return h ^ (h >> 16)


def gumbel(seeds: mx.array, positions: mx.array, vocab: int) -> mx.array:
    """Gumbel noise ``[B, N, vocab]`` keyed by (seed, position, token): ``seeds`` uint32
    ``[B]``, ``positions`` int32 ``[B, N]``. One kernel op on the CPU; elsewhere the same
    hash in MLX ops (equal up to the last bits of the two logs)."""
    ext = _active()
    if ext is not None:
        return ext.gumbel(seeds, positions, vocab)
    u32 = mx.uint32
    pos = positions.astype(u32)
    key = _fmix(seeds.astype(u32)[:, None] ^ _fmix(pos * 0x9E3779B9 + 0x7F4A7C15))  # [B, N]
    token = _fmix(mx.arange(vocab, dtype=u32) * 0x9E3779B9 ^ 0x85EBCA77)  # [V]
    h = _fmix(token[None, None, :] + key[..., None])  # [B, N, V]
    u = ((h >> 8).astype(mx.float32) + 0.5) * 2.0**-24  # in (0, 1)
    return -mx.log(-mx.log(u))


def sample_tokens(logits: mx.array, temperatures: mx.array, seeds: mx.array, positions: mx.array) -> mx.array | None:
    """Tokens ``[B, N]``, one op: per row the argmax of ``logits / max(T, 1e-6)`` plus
    :func:`gumbel`'s noise (``T = 0``: of ``logits``), bit for bit MLX's ops over the kernel's
    noise. ``logits`` float32 ``[B, N, V]``, ``temperatures`` float32 and ``seeds`` uint32
    ``[B]``, ``positions`` int32 ``[B, N]``; None off the kernels (the caller's ops)."""
    ext = _active()
    if ext is None or logits.dtype != mx.float32 or logits.ndim != 3:
        return None
    return ext.sample_tokens(logits, temperatures, seeds, positions)


def rope_positions(offset) -> mx.array:
    """An mlx-lm cache offset (an int, a scalar or a per-row ``[B]`` array) as the kernel's
    int32 ``[1]`` / ``[B]`` positions of each row's first token."""
    if isinstance(offset, int):
        return mx.array([offset], dtype=mx.int32)
    if offset.ndim == 1 and offset.dtype == mx.int32:
        return offset  # a ragged cache's [B] as it is: a reshape would be one more op per layer
    return offset.reshape(-1).astype(mx.int32)


def rope(x: mx.array, positions: mx.array, inv_freq: mx.array, dims: int, traditional: bool,
         scale: float = 1.0):
    """Rotary embedding of ``x`` [B, H, L, D] at ``positions`` (int32 ``[1]``/``[B]``
    offsets or ``[B, L]``), or None where the kernel does not apply (the caller runs
    ``mx.fast.rope``)."""
    ext = _active()
    if ext is None or x.dtype != mx.float32 or x.ndim != 4:
        return None
    return ext.rope(x, positions, inv_freq, dims, traditional, scale)

