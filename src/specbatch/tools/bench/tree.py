"""``specbatch bench --suite trees``: chain vs tree drafting, side by side, per width.

For each drafter (prompt lookup, the draft model, the MTP head where one loads), width and
temperature, plain decoding, a chain of ``k`` drafts and each tree shape decode the same
held-out chat prompts (alone at width 1; in groups of ``width`` submitted together, a tree
per row, for the drafters that draft one per row), round-robin within each repeat (the
machine is shared: systems see the same moment's noise). Rows report tokens/s, the
speedup over plain, tokens per verify round, and the tree's throughput over the chain's.
"""

from __future__ import annotations

import statistics

import attrs
import structlog

from ...runtime.tree_shape import BatchTree, TreeShape

log = structlog.get_logger(__name__)

TREE_SHAPES = ("2,1", "2,1,1", "4,1", "3,2,1@0.08", "3,2,1@0.15", "2,2,2@0.1", "2,1,1,1@0.2")
TEMPERATURES = (0.0, 0.7)
BATCH_WIDTHS = (2, 4)  # batches measured beside width 1 (a tree per row against chains)


def chat_prompts(tokenizer, n: int) -> list[list[int]]:
    """``n`` held-out chat questions (``workload``'s; none is in the drafters' data)."""
    from ..workload import prompts
    return prompts(tokenizer, 2 * n)[::2]


def tree_config(config, shape: TreeShape | None, k: int):
    """``config`` speculating at every width with a chain of ``k`` (``shape`` None) or a
    tree (alone: the scalar loop's; in a batch: one per row), at any temperature, with a
    fixed draft length (the shape is what is measured)."""
    depth = k if shape is None else shape.depth
    batch_tree = None if shape is None else BatchTree(shape, max_width=64)
    return attrs.evolve(config, speculation=True, speculative_width_cap=0, num_draft_tokens=depth,
                        tree_shape=shape, batch_tree=batch_tree, fixed_draft=True,
                        max_spec_temperature=None, prompt_cache_bytes=0, prompt_lookup=0)


def systems(target, drafter, config, k: int, shapes) -> dict:
    """Engines by name: plain, ``chain k=..``, ``tree b1,b2,..``; warmed up."""
    from ...kernels.build import new_engine
    from .harness import code_prompts, engine_tok_s
    configs = {"plain": (None, attrs.evolve(config, speculation=False, prompt_cache_bytes=0)),
               f"chain k={k}": (drafter, tree_config(config, None, k))}
    for shape in shapes:
        configs[f"tree {shape}"] = (drafter, tree_config(config, TreeShape.parse(str(shape)), k))
    engines = {}
    for name, (source, cfg) in configs.items():
        engines[name] = new_engine(target, source, cfg)
        engine_tok_s(engines[name], code_prompts(target.tokenizer, 1), 8)  # warm up
    return engines


def width_runs(engines: dict, prompts, tokens: int, temperature: float, repeats: int, width: int = 1) -> dict:
    """Per system: median tokens/s over (repeat, group) runs, each group of ``width``
    prompts submitted together (width 1: each prompt alone), and its tokens per verify
    round over the whole run (1.0 for plain)."""
    from .harness import engine_tok_s
    groups = [prompts[i:i + width] for i in range(0, len(prompts) - width + 1, width)]
    before = {name: e.stats() for name, e in engines.items()}
    speeds = {name: [] for name in engines}
    for _ in range(repeats):
        for group in groups:
            for name, engine in engines.items():
                speeds[name].append(engine_tok_s(engine, group, tokens, temperature))
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


def suite_trees(ctx, shapes=TREE_SHAPES, temperatures=TEMPERATURES, n_prompts: int = 4,
                batch_widths=BATCH_WIDTHS) -> dict:
    """Rows per (drafter, width, temperature, system): tok/s, speedup, tokens per round, vs
    chain. Batches (widths > 1) only with drafters that draft a tree per row."""
    prompts = chat_prompts(ctx.target.tokenizer, max(n_prompts, *batch_widths))
    k = ctx.k
    rows = []
    for name, source in drafter_sources(ctx).items():
        # only the MTP head prunes a dynamic shape; the others would draft its whole bound
        mine = [s for s in shapes if name == "mtp" or not TreeShape.parse(s).dynamic]
        widths = [1] + (list(batch_widths) if name in ("mtp", "ngram") else [])
        engines = systems(ctx.target, source, ctx.config, k, mine)
        try:
            for width in widths:
                for t in temperatures:
                    got = width_runs(engines, prompts[:max(n_prompts, width)], ctx.tokens, t, ctx.repeats, width)
                    rows += compare_rows(got, name, width, t, k)
        finally:
            for engine in engines.values():
                engine.close()
    return {"k": k, "shapes": list(shapes), "rows": rows}


def compare_rows(got: dict, drafter: str, width: int, temperature: float, k: int) -> list[dict]:
    chain, plain = got[f"chain k={k}"]["tok_s"], got["plain"]["tok_s"]
    log.info("trees", drafter=drafter, width=width, temperature=temperature,
             best=max(got, key=lambda s: got[s]["tok_s"]))
    return [{"drafter": drafter, "width": width, "temperature": temperature, "system": system,
             "tok_s": m["tok_s"], "speedup": m["tok_s"] / plain, "tokens_per_round": m["tokens_per_round"],
             "vs_chain": m["tok_s"] / chain} for system, m in got.items()]


SUITES = {"trees": suite_trees}
