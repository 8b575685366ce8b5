"""``specbatch bench``: seeded workloads measured side by side, interleaved in one run.

The machines are shared and noisy, so every suite interleaves the systems it compares
(round-robin within each repeat) and reports medians and their ratios, never one-off
timings. Suites: plain, scalar, widths (here), transitions, memory (``bench_serving``), serving
(``bench_http``), sharded (``bench_sharded``), trees (``bench_tree``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

from tqdm import tqdm

from . import workload
from .engine import Engine
from .sampling import SamplingParams


def code_prompts(tokenizer, n: int) -> list[list[int]]:
    """The benchmark workload: chat questions and code completions (``workload``)."""
    return workload.prompts(tokenizer, n)


def mlx_lm_folder(name: str):
    """A folder mlx-lm opens at the precision we run: a GGUF's fp32 conversion."""
    if str(name).lower().endswith(".gguf"):
        from .gguf import cached_folder
        return cached_folder(Path(name), dequantize=True)
    return name


def drafter_args(drafter) -> list[str]:
    """The ``specbatch serve`` flags that load ``drafter`` (a model, an MTP head, prompt lookup)."""
    from .drafters.ngram import NGramSource
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


def mlx_lm_batch_tok_s(model, prompts, tokens: int) -> float:
    """mlx-lm's own ``BatchGenerator`` on the same prompts (greedy, no EOS stop)."""
    from mlx_lm.generate import BatchGenerator
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
    """mlx-lm's single-sequence ``speculative_generate_step`` (greedy)."""
    import mlx.core as mx
    from mlx_lm.generate import speculative_generate_step
    t0 = time.perf_counter()
    n = sum(1 for _ in speculative_generate_step(mx.array(prompt), target, drafter, num_draft_tokens=k,
                                                 max_tokens=tokens))
    return n / (time.perf_counter() - t0)


def _median_rows(samples: dict) -> dict:
    return {name: statistics.median(v) for name, v in samples.items()}


def suite_plain(ctx) -> dict:
    """Plain decode tokens/s at each width: our batch loop vs mlx-lm's BatchGenerator."""
    engine = ctx.engine(speculation=False)
    prompts = code_prompts(ctx.target.tokenizer, max(ctx.widths))
    rows = []
    for width in tqdm(ctx.widths, desc="plain", unit="width"):
        samples = {"specbatch": [], "mlx_lm": []}
        for _ in range(ctx.repeats):
            samples["specbatch"].append(engine_tok_s(engine, prompts[:width], ctx.tokens))
            samples["mlx_lm"].append(mlx_lm_batch_tok_s(ctx.target.model, prompts[:width], ctx.tokens))
        m = _median_rows(samples)
        rows.append({"width": width, "specbatch_tok_s": m["specbatch"], "mlx_lm_tok_s": m["mlx_lm"],
                     "ratio": m["specbatch"] / m["mlx_lm"]})
    return {"rows": rows}


def suite_scalar(ctx) -> dict:
    """Width 1: speculative / plain at several temperatures, acceptance by verification
    mode, tokens per round against (1 - a^(k+1)) / (1 - a), and mlx-lm's speculative loop."""
    k = ctx.k
    prompt = code_prompts(ctx.target.tokenizer, 1)
    plain = ctx.engine(speculation=False)
    # speculate at every temperature with k drafts, whatever the calibration says: what it does
    always = dict(max_spec_temperature=None, draft_schedule=None)
    modes = {"coupled": ctx.engine(speculative_width_cap=1, **always),
             "rejection": ctx.engine(speculative_width_cap=1, verify="rejection", **always),
             "specbatch": ctx.engine()}  # the calibrated policy: plain where speculation loses
    greedy = ctx.engine(speculative_width_cap=0, **always)  # width-1 batch loop: greedy drafting
    rows = []
    for temp in tqdm([0.0, 0.7, 1.0], desc="scalar", unit="temp"):
        samples = {"plain": [], "coupled": [], "rejection": [], "specbatch": [], "batch_greedy": [], "mlx_lm_spec": []}
        acc = {}
        for _ in range(ctx.repeats):
            samples["plain"].append(engine_tok_s(plain, prompt, ctx.tokens, temp))
            for name, eng in modes.items():
                before = eng.stats()
                samples[name].append(engine_tok_s(eng, prompt, ctx.tokens, temp))
                acc.setdefault(name, []).append(_acceptance(before, eng.stats()))
            before = greedy.stats()
            samples["batch_greedy"].append(_forced_batch_tok_s(greedy, prompt[0], ctx.tokens, temp))
            acc.setdefault("batch_greedy", []).append(_acceptance(before, greedy.stats()))
            if temp == 0.0 and hasattr(ctx.drafter, "model"):
                samples["mlx_lm_spec"].append(mlx_lm_spec_tok_s(ctx.target.model, ctx.drafter.model, prompt[0],
                                                                ctx.tokens, k))
        m = _median_rows({n: v for n, v in samples.items() if v})
        a = statistics.median(acc["coupled"])
        row = {"temperature": temp, "plain_tok_s": m["plain"], "spec_tok_s": m["coupled"],
               "speedup": m["coupled"] / m["plain"], "acceptance_coupled": a,
               "acceptance_greedy_draft": statistics.median(acc["batch_greedy"]),
               "acceptance_rejection": statistics.median(acc["rejection"]),
               "rejection_speedup": m["rejection"] / m["plain"], "specbatch_speedup": m["specbatch"] / m["plain"],
               "tokens_per_round": modes["coupled"].stats()["tokens_per_round"],
               "expected_tokens_per_round": (1 - a ** (k + 1)) / (1 - a) if a < 1 else k + 1}
        if "mlx_lm_spec" in m:
            row["mlx_lm_spec_tok_s"] = m["mlx_lm_spec"]
            row["ours_vs_mlx_lm_spec"] = m["coupled"] / m["mlx_lm_spec"]
        rows.append(row)
    return {"k": k, "rows": rows}


def _acceptance(before: dict, after: dict) -> float:
    drafted = after["drafted_tokens"] - before["drafted_tokens"]
    return (after["accepted_tokens"] - before["accepted_tokens"]) / drafted if drafted else 0.0


def _forced_batch_tok_s(engine, prompt, tokens, temp) -> float:
    """One request through the batch loop (greedy drafting): a burst of two at idle, one tiny."""
    t0 = time.perf_counter()
    main = engine.submit(prompt, SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0, temperature=temp))
    engine.submit(prompt, SamplingParams(max_tokens=1, seed=1))
    n = main.result(3600).usage.completion_tokens
    return n / (time.perf_counter() - t0)


def suite_widths(ctx) -> dict:
    """Width sweep: plain batching, always-speculate batching, specbatch with its cap."""
    prompts = code_prompts(ctx.target.tokenizer, max(ctx.widths))
    engines = {"plain": ctx.engine(speculation=False),
               "always_spec": ctx.engine(speculative_width_cap=0, max_spec_temperature=None, draft_schedule=None),
               "specbatch": ctx.engine()}
    rows = []
    for width in tqdm(ctx.widths, desc="widths", unit="width"):
        samples = {name: [] for name in engines}
        for _ in range(ctx.repeats):
            for name, eng in engines.items():
                samples[name].append(engine_tok_s(eng, prompts[:width], ctx.tokens))
        m = _median_rows(samples)
        best = max(m["plain"], m["always_spec"])
        rows.append({"width": width, **{f"{n}_tok_s": v for n, v in m.items()},
                     "spec_over_plain": m["always_spec"] / m["plain"], "specbatch_over_best": m["specbatch"] / best})
    return {"cap": engines["specbatch"].config.speculative_width_cap, "rows": rows}


class Context:
    """What every suite needs: the pair, the sizes, and engines built on demand."""

    def __init__(self, target, drafter, config, widths, tokens, repeats):
        self.target, self.drafter, self.config = target, drafter, config
        self.widths, self.tokens, self.repeats = widths, tokens, repeats
        self.k = config.num_draft_tokens
        self.serving_requests = 12
        self.rates = {"low": 0.5, "medium": 1.5, "saturating": 6.0}  # requests per second
        self._engines = []

    def engine(self, **overrides) -> Engine:
        import attrs
        fields = {"prompt_cache_bytes": 0, **overrides}
        config = attrs.evolve(self.config, **fields)
        drafter = self.drafter if config.speculation else None
        engine = Engine(self.target, drafter, config)
        engine_tok_s(engine, code_prompts(self.target.tokenizer, 2), 8)  # warm up
        self._engines.append(engine)
        return engine

    def close(self) -> None:
        for engine in self._engines:
            engine.close()


def machine() -> dict:
    import mlx.core as mx

    from .blas import active_blas
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "device": str(mx.default_device()),
            "blas": active_blas(), "mlx": mx.__version__, "python": platform.python_version()}


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n== {title}")
    keys = list(dict.fromkeys(k for row in rows for k in row))
    print(" | ".join(keys))
    for row in rows:
        cells = (row.get(k, "") for k in keys)
        print(" | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in cells))


def run_bench(args) -> int:
    from . import bench_http, bench_memory, bench_prefix, bench_serving, bench_sharded, bench_tree
    from .config import load_pair
    suites = {"plain": suite_plain, "scalar": suite_scalar, "widths": suite_widths, **bench_serving.SUITES,
              **bench_http.SUITES, "drafters": bench_serving.suite_drafters, **bench_sharded.SUITES,
              **bench_memory.SUITES, **bench_prefix.SUITES, **bench_tree.SUITES}
    target, drafter, config = load_pair(args.model, args.draft_model, dtype=args.dtype,
                                        speculative_width_cap=args.speculative_width_cap,
                                        num_draft_tokens=args.num_draft_tokens, drafter=args.drafter,
                                        **({"tree_shape": args.tree_shape} if getattr(args, "tree_shape", None) else {}))
    ctx = Context(target, drafter, config, [int(w) for w in args.widths.split(",")], args.tokens, args.repeats)
    results = {"machine": machine(), "target": target.name, "drafter": getattr(drafter, "name", None),
               "k": config.num_draft_tokens, "cap": config.speculative_width_cap, "suites": {}}
    try:
        for name in args.suite.split(","):
            if name not in suites:
                raise ValueError(f"unknown bench suite {name!r}; choose from {sorted(suites)}")
            try:
                results["suites"][name] = suites[name](ctx)
            except Exception as exc:  # one failing suite must not lose the others' results
                print(f"\n== {name} failed: {exc!r}")
                results.setdefault("failed", {})[name] = repr(exc)
                continue
            print_table(name, results["suites"][name]["rows"])
    finally:
        ctx.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"\nresults: {path}")
    if args.report:
        from .bench_report import write_report
        write_report(results, path)
    return 0
