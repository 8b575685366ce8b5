"""``specbatch bench --suite trees``: chain vs tree drafting at width 1, side by side.

For each drafter (prompt lookup, the draft model, the MTP head where one loads) and each
temperature, plain decoding, a chain of ``k`` drafts and each tree shape decode the same
held-out chat prompts one request at a time, round-robin within each repeat (the machine
is shared: systems see the same moment's noise). Rows report tokens/s, the speedup over
plain, tokens per verify round, and the tree's throughput over the chain's.
"""

from __future__ import annotations

import statistics

import attrs
import structlog

from ...runtime.tree_shape import TreeShape

log = structlog.get_logger(__name__)

TREE_SHAPES = ("2,1", "2,1,1", "4,1", "3,2,1@0.08", "3,2,1@0.15", "2,2,2@0.1", "2,1,1,1@0.2")
TEMPERATURES = (0.0, 0.7)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` held-out chat questions (``workload``'s; none is in the drafters' data)."""
    from ..workload import prompts
    return prompts(tokenizer, 2 * n)[::2]


def width1_config(config, shape: TreeShape | None, k: int):
    """``config`` speculating alone with a chain of ``k`` (``shape`` None) or a tree, at any
    temperature, with a fixed draft length (the shape is what is measured)."""
    depth = k if shape is None else shape.depth
    return attrs.evolve(config, speculation=True, speculative_width_cap=1, num_draft_tokens=depth,
                        tree_shape=shape, adaptive_k=False, draft_schedule=None, max_spec_temperature=None,
                        prompt_cache_bytes=0)


def systems(target, drafter, config, k: int, shapes) -> dict:
    """Engines by name: plain, ``chain k=..``, ``tree b1,b2,..``; warmed up."""
    from ...runtime.engine import Engine
    from .harness import code_prompts, engine_tok_s
    configs = {"plain": (None, attrs.evolve(config, speculation=False, prompt_cache_bytes=0)),
               f"chain k={k}": (drafter, width1_config(config, None, k))}
    for shape in shapes:
        configs[f"tree {shape}"] = (drafter, width1_config(config, TreeShape.parse(str(shape)), k))
    engines = {}
    for name, (source, cfg) in configs.items():
        engines[name] = Engine(target, source, cfg)
        engine_tok_s(engines[name], code_prompts(target.tokenizer, 1), 8)  # warm up
    return engines


def width1_runs(engines: dict, prompts, tokens: int, temperature: float, repeats: int) -> dict:
    """Per system: median tokens/s over (repeat, prompt) runs, each prompt alone, and its
    tokens per verify round over the whole run (1.0 for plain)."""
    from .harness import engine_tok_s
    before = {name: e.stats() for name, e in engines.items()}
    speeds = {name: [] for name in engines}
    for _ in range(repeats):
        for prompt in prompts:
            for name, engine in engines.items():
                speeds[name].append(engine_tok_s(engine, [prompt], tokens, temperature))
    out = {}
    for name, engine in engines.items():
        after = engine.stats()
        rounds = sum(after["acceptance_histogram"].values()) - sum(before[name]["acceptance_histogram"].values())
        accepted = after["accepted_tokens"] - before[name]["accepted_tokens"]
        out[name] = {"tok_s": statistics.median(speeds[name]),
                     "tokens_per_round": (accepted + rounds) / rounds if rounds else 1.0}
    return out


def drafter_sources(ctx) -> dict:
    """Prompt lookup, the draft model and the MTP head (installed, else the candidate)."""
    from ...kernels.drafters.ngram import NGramSource
    from ...kernels.models import ModelNotFound, demo_pair, load, load_mtp_head
    pair = demo_pair() if ctx.target.name == str(demo_pair()["target"]) else None
    out = {"ngram": NGramSource(ctx.target.vocab_size)}
    try:
        out["model"] = ctx.drafter if hasattr(ctx.drafter, "model") else load(pair["drafter"])
    except (ModelNotFound, TypeError) as exc:
        print(f"trees: no draft model ({exc})")
    for folder in ([pair["mtp"], pair["mtp"].with_name("mtp-candidate")] if pair else [None]):
        try:
            out["mtp"] = load_mtp_head(folder, ctx.target)
            break
        except ModelNotFound as exc:
            print(f"trees: no MTP head ({exc})")
    return out


def suite_trees(ctx, shapes=TREE_SHAPES, temperatures=TEMPERATURES, n_prompts: int = 4) -> dict:
    """Rows per (drafter, temperature, system): tok/s, speedup, tokens per round, vs chain."""
    prompts = chat_prompts(ctx.target.tokenizer, n_prompts)
    k = ctx.k
    rows = []
    for name, source in drafter_sources(ctx).items():
        # only the MTP head prunes a dynamic shape; the others would draft its whole bound
        mine = [s for s in shapes if name == "mtp" or not TreeShape.parse(s).dynamic]
        engines = systems(ctx.target, source, ctx.config, k, mine)
        try:
            for t in temperatures:
                got = width1_runs(engines, prompts, ctx.tokens, t, ctx.repeats)
                chain = got[f"chain k={k}"]["tok_s"]
                for system, m in got.items():
                    rows.append({"drafter": name, "temperature": t, "system": system, "tok_s": m["tok_s"],
                                 "speedup": m["tok_s"] / got["plain"]["tok_s"],
                                 "tokens_per_round": m["tokens_per_round"], "vs_chain": m["tok_s"] / chain})
                log.info("trees", drafter=name, temperature=t,
                         best=max(got, key=lambda s: got[s]["tok_s"]))
        finally:
            for engine in engines.values():
                engine.close()
    return {"k": k, "shapes": list(shapes), "rows": rows}


SUITES = {"trees": suite_trees}
