"""The bench harness: seeded workloads, tokens/s of the engine and of mlx-lm, the ``Context``
every suite gets.

The machines are shared and noisy, so every suite interleaves the systems it compares
(round-robin within each repeat) and reports medians and their ratios, never one-off
timings. Suites live beside this module (``basic``, ``serving``, ``http``, ``sharded``,
``memory``, ``prefix``, ``long``); ``run`` picks them by name.
"""

from __future__ import annotations

import functools
import statistics
import time
from pathlib import Path

import attrs

from ...kernels.build import new_core, new_engine
from ...runtime.engine import Engine
from ...runtime.params import SamplingParams
from .. import workload


def code_prompts(tokenizer, n: int) -> list[list[int]]:
    """The benchmark workload: chat questions and code completions (``workload``)."""
    return workload.prompts(tokenizer, n)


def mlx_lm_folder(name: str):
    """A folder mlx-lm opens at the precision we run: a GGUF's fp32 conversion, or an fp32
    copy of a folder with half-precision weights (mlx-lm keeps a checkpoint's dtype; we
    load fp32 on the CPU, and mlx_lm.server's fp16 draft model measured ~2 s a token)."""
    if str(name).lower().endswith(".gguf"):
        from ...kernels.gguf import cached_folder
        return cached_folder(Path(name), dequantize=True)
    folder = Path(name)
    if folder.is_dir() and any(folder.glob("*.safetensors")):
        return fp32_copy(folder)
    return name


def fp32_copy(folder: Path) -> Path:
    """``folder`` itself when its floating weights are fp32; else a cached fp32 copy."""
    import hashlib
    import shutil

    import mlx.core as mx

    from ...kernels.gguf import cache_root
    files = sorted(folder.glob("*.safetensors"))
    weights = {f: mx.load(str(f)) for f in files}
    half = any(v.dtype in (mx.float16, mx.bfloat16) for w in weights.values() for v in w.values())
    if not half:
        return folder
    key = hashlib.sha256("".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files).encode())
    out = cache_root().parent / "fp32" / f"{folder.name}-{key.hexdigest()[:16]}"
    if (out / "config.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in folder.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, out / f.name)
    for f, w in weights.items():
        mx.save_safetensors(str(out / f.name), {k: v.astype(mx.float32) if v.dtype in (mx.float16, mx.bfloat16) else v
                                                for k, v in w.items()})
    shutil.copy(folder / "config.json", out / "config.json")  # last: its presence marks a whole copy
    return out


def drafter_args(drafter) -> list[str]:
    """The ``specbatch serve`` flags that load ``drafter`` (a model, an MTP head, prompt lookup)."""
    from ...kernels.drafters.ngram import NGramSource
    if drafter is None:
        return ["--no-speculation"]
    if isinstance(drafter, NGramSource):
        return ["--drafter", "ngram"]
    kind = "model" if hasattr(drafter, "model") else "mtp"
    return ["--drafter", kind, "--draft-model", str(drafter.name)]


def engine_tok_s(engine, prompts, tokens: int, temperature: float = 0.0, stagger: float = 0.0) -> float:
    """Tokens/s of ``engine`` decoding ``tokens`` per prompt (wall time, prefill included)."""
    t0 = time.perf_counter()
    handles = []
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, temperature=temperature)
        handles.append(engine.submit(p, sp))
        if stagger:
            time.sleep(stagger)
    total = sum(h.result(timeout=3600).usage.completion_tokens for h in handles)
    return total / (time.perf_counter() - t0)


@attrs.frozen
class CoreRun:
    """One batch decoded on a steppable core: its tokens over its time end to end (from
    ``add``, prefill included), and decoding alone (the tokens after every row has its first
    one, over the time after that: what the rounds cost, which calibrate prices)."""

    tokens: int
    seconds: float
    decode_tokens: int
    decode_seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_tokens else 0.0


def core_tok_s(core, prompts, tokens: int, temperature: float = 0.0) -> CoreRun:
    """``prompts`` added to ``core`` before one step (admitted together, unlike an engine's
    racing submissions) and stepped to the end, each decoding ``tokens``."""
    t_add = time.perf_counter()
    ids = {core.add(p, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=i, temperature=temperature))
           for i, p in enumerate(prompts)}
    started, total, after, t_all = set(), 0, 0, None
    while core.has_work():
        events = core.step()
        got = sum(len(e.token_ids) for e in events)
        total += got
        if t_all is not None:
            after += got
        else:
            started |= {e.request_id for e in events if e.token_ids}
            t_all = time.perf_counter() if started >= ids else None
    end = time.perf_counter()
    return CoreRun(total, end - t_add, after, end - (t_all or end))


def mlx_lm_batch_tok_s(model, prompts, tokens: int) -> float:
    """mlx-lm's own ``BatchGenerator`` on the same prompts (greedy, no EOS stop), on MLX's
    own ops (our CPU kernels off for it)."""
    from mlx_lm.generate import BatchGenerator

    from ...kernels.cpu import disabled
    with disabled():
        return _mlx_lm_batch(BatchGenerator, model, prompts, tokens)


def _mlx_lm_batch(BatchGenerator, model, prompts, tokens: int) -> float:
    gen = BatchGenerator(model, max_tokens=tokens, stop_tokens=[], completion_batch_size=max(32, len(prompts)),
                         prefill_batch_size=max(8, len(prompts)))
    t0 = time.perf_counter()
    gen.insert(prompts, [tokens] * len(prompts))
    total = 0
    while responses := gen.next_generated():
        total += sum(1 for r in responses if r.finish_reason != "stop")
    gen.close()
    return total / (time.perf_counter() - t0)


def mlx_lm_spec_tok_s(target, drafter, prompt, tokens: int, k: int) -> float:
    """mlx-lm's single-sequence ``speculative_generate_step`` (greedy; MLX's own ops)."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step

    from ...kernels.cpu import disabled
    t0 = time.perf_counter()
    with disabled():
        n = sum(1 for _ in speculative_generate_step(mx.array(prompt), target, drafter, num_draft_tokens=k,
                                                     max_tokens=tokens))
    return n / (time.perf_counter() - t0)


def _median_rows(samples: dict) -> dict:
    return {name: statistics.median(v) for name, v in samples.items()}


def acceptance(before: dict, after: dict) -> float:
    drafted = after["drafted_tokens"] - before["drafted_tokens"]
    return (after["accepted_tokens"] - before["accepted_tokens"]) / drafted if drafted else 0.0


class Context:
    """What every suite needs: the pair, the sizes, and engines built on demand."""

    def __init__(self, target, drafter, config, widths, tokens, repeats, k: int | None = None):
        self.target, self.drafter, self.config = target, drafter, config
        self.widths, self.tokens, self.repeats = widths, tokens, repeats
        self.k = k or config.num_draft_tokens  # the chain length of "always speculate" engines
        self.serving_requests = 12
        self.rates = {"low": 0.5, "medium": 1.5, "saturating": 6.0}  # requests per second
        self.request_timeout = 120.0  # seconds a serving request may take before it is cut
        self.long_prompt_tokens, self.long_arrivals = 2000, 2  # long_prompts: prompts arriving while streams decode
        self._engines, self._cores = [], []

    @functools.cached_property
    def mlx_lm_model(self):
        """The target as mlx-lm runs it, weights float32: ours may be half-stored
        (``kernels.cpu.half``), and MLX's own ops would widen those at every call."""
        from ...kernels.cpu.half import float32_kept, half_stored
        from ...kernels.models import load
        if not half_stored(self.target.model):
            return self.target.model
        with float32_kept():
            return load(self.target.name).model

    def engine(self, **overrides) -> Engine:
        """A started engine with ``overrides`` over the context's config (prompt cache off)."""
        engine = new_engine(self.target, *self._kernels(overrides))
        engine_tok_s(engine, code_prompts(self.target.tokenizer, 2), 8)  # warm up
        self._engines.append(engine)
        return engine

    def core(self, **overrides):
        """A steppable core (``core_tok_s``), as ``engine`` builds one."""
        core = new_core(self.target, *self._kernels(overrides))
        core_tok_s(core, code_prompts(self.target.tokenizer, 2), 8)  # warm up
        self._cores.append(core)
        return core

    def _kernels(self, overrides: dict) -> tuple:
        """(drafter or None, config) for ``overrides`` over the context's config."""
        config = attrs.evolve(self.config, **{"prompt_cache_bytes": 0, **overrides})
        return (self.drafter if config.speculation else None), config

    def always(self, **more) -> dict:
        """Overrides for an engine that speculates with chains of ``k`` whatever the
        calibration says (no schedule, no temperature limit, no trees, no prompt lookup)."""
        return {"max_spec_temperature": None, "fixed_draft": True, "num_draft_tokens": self.k,
                "tree_shape": None, "batch_tree": None, "prompt_lookup": 0, **more}

    def close(self) -> None:
        for engine in self._engines:
            engine.close()
        for core in self._cores:
            core.close()

