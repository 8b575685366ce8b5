"""The plain, scalar and widths suites: the engine against mlx-lm's BatchGenerator and
``speculative_generate_step``, side by side."""

from __future__ import annotations

import statistics
import time

from tqdm import tqdm

from ...runtime.params import SamplingParams
from .harness import _median_rows, acceptance, code_prompts, engine_tok_s, mlx_lm_batch_tok_s, mlx_lm_spec_tok_s


def suite_plain(ctx) -> dict:
    """Plain decode tokens/s at each width: our batch loop (dense and paged KV) vs mlx-lm's
    BatchGenerator. ``specbatch_tok_s`` and ``ratio`` are the dense layout's (the key earlier
    results use); the default layout, paged, is ``paged_tok_s`` (``paged_vs_dense`` of it)."""
    engine = ctx.engine(speculation=False, kv_layout="dense")
    paged = ctx.engine(speculation=False, kv_layout="paged")
    prompts = code_prompts(ctx.target.tokenizer, max(ctx.widths))
    rows = []
    for width in tqdm(ctx.widths, desc="plain", unit="width"):
        samples = {"specbatch": [], "paged": [], "mlx_lm": []}
        for rep in range(ctx.repeats):
            # the layouts alternate which goes first (in a fixed pair the second read 0.945x the
            # first at width 1, where they differ by ~1% decoding alone)
            for name, eng in [("specbatch", engine), ("paged", paged)][:: 1 if rep % 2 == 0 else -1]:
                samples[name].append(engine_tok_s(eng, prompts[:width], ctx.tokens))
            samples["mlx_lm"].append(mlx_lm_batch_tok_s(ctx.mlx_lm_model, prompts[:width], ctx.tokens))
        m = _median_rows(samples)
        rows.append({"width": width, "specbatch_tok_s": m["specbatch"], "paged_tok_s": m["paged"],
                     "mlx_lm_tok_s": m["mlx_lm"], "ratio": m["specbatch"] / m["mlx_lm"],
                     "paged_vs_dense": m["paged"] / m["specbatch"]})
    return {"rows": rows}


def suite_scalar(ctx) -> dict:
    """Width 1: speculative / plain at several temperatures, acceptance by verification
    mode, tokens per round against (1 - a^(k+1)) / (1 - a), and mlx-lm's speculative loop."""
    k = ctx.k
    prompt = code_prompts(ctx.target.tokenizer, 1)
    plain = ctx.engine(speculation=False)
    # speculate at every temperature with k drafts, whatever the calibration says: what it does
    always = ctx.always()
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
                acc.setdefault(name, []).append(acceptance(before, eng.stats()))
            before = greedy.stats()
            samples["batch_greedy"].append(_forced_batch_tok_s(greedy, prompt[0], ctx.tokens, temp))
            acc.setdefault("batch_greedy", []).append(acceptance(before, greedy.stats()))
            if temp == 0.0 and hasattr(ctx.drafter, "model"):
                samples["mlx_lm_spec"].append(mlx_lm_spec_tok_s(ctx.mlx_lm_model, ctx.drafter.model, prompt[0],
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
               "always_spec": ctx.engine(**ctx.always(speculative_width_cap=0)),
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
