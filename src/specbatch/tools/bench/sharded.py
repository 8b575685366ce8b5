"""Bench suite ``sharded``: the same workload on 1 process and on a target sharded over 2.

Each repeat measures the in-process engine, then launches a 2-rank job on loopback with
``mlx.launch --backend ring`` that runs the same workload on ``sharded_engine`` (this
module's ``__main__`` is the rank program). Both run the pair and config the bench
loaded; medians over repeats and their ratio are reported.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import attrs

WIDTHS = (1, 4)


def workload(engine, tokenizer, tokens: int) -> dict[int, float]:
    from .harness import code_prompts, engine_tok_s
    engine_tok_s(engine, code_prompts(tokenizer, 2), 8)  # warm up
    return {w: engine_tok_s(engine, code_prompts(tokenizer, w), tokens) for w in WIDTHS}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1] + 1  # the ring takes this port and the next


def shardable(ctx) -> tuple[object, dict]:
    """The bench's drafter and how a rank loads it; prompt lookup in place of an MTP head,
    which reads the target's KV that the ranks split (both sides run the same drafter)."""
    from ...kernels.drafters.mtp import MTPHead
    from ...kernels.drafters.ngram import NGramSource
    if isinstance(ctx.drafter, MTPHead):
        return NGramSource(ctx.target.vocab_size), {"draft": None, "drafter": "ngram"}
    return ctx.drafter, {"draft": getattr(ctx.drafter, "name", None)}


def two_ranks(ctx, tokens: int) -> dict[int, float]:
    config = {k: v for k, v in attrs.asdict(ctx.config).items()}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        job = {"model": ctx.target.name, **shardable(ctx)[1], "config": config, "tokens": tokens, "out": str(out)}
        cmd = [str(Path(sys.executable).with_name("mlx.launch")), "--backend", "ring", "-n", "2",
               "--starting-port", str(_port()), sys.executable, "-m", "specbatch.tools.bench.sharded", json.dumps(job)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if not out.exists():
            raise RuntimeError(f"2-rank job failed: {proc.stdout[-1500:]} {proc.stderr[-1500:]}")
        return {int(w): v for w, v in json.loads(out.read_text()).items()}


def suite_sharded(ctx) -> dict:
    from ...kernels.build import new_engine
    from ...serving.dist.sharded import unshardable
    why = unshardable(ctx.target, 2)
    if why is not None:  # say so instead of launching ranks that refuse it
        return {"rows": [], "skipped": why}
    drafter, how = shardable(ctx)
    one = new_engine(ctx.target, drafter if ctx.config.speculation else None, ctx.config)
    samples = {(r, w): [] for r in (1, 2) for w in WIDTHS}
    for _ in range(ctx.repeats):
        for w, v in workload(one, ctx.target.tokenizer, ctx.tokens).items():
            samples[(1, w)].append(v)
        for w, v in two_ranks(ctx, ctx.tokens).items():
            samples[(2, w)].append(v)
    rows = []
    for w in WIDTHS:
        a, b = statistics.median(samples[(1, w)]), statistics.median(samples[(2, w)])
        rows.append({"width": w, "ranks_1_tok_s": a, "ranks_2_tok_s": b, "two_over_one": b / a})
    one.close()
    return {"rows": rows, "drafter": how.get("drafter") or how["draft"],
            "note": "2 ranks on one machine over loopback (ring backend)"}


SUITES = {"sharded": suite_sharded}


def _rank_main(job: dict) -> None:
    """One rank of the 2-rank job: rank 0 measures, the follower replays."""
    from ...blas import ensure_openblas
    ensure_openblas()
    from ...serving.dist import sharded_engine
    config = dict(job["config"])
    if job.get("drafter"):
        config["drafter"] = job["drafter"]
    engine = sharded_engine(job["model"], job["draft"], **config)
    if engine is None:
        return
    try:
        result = workload(engine, engine.tokenizer, job["tokens"])
    finally:
        engine.close()
    Path(job["out"]).write_text(json.dumps(result))


if __name__ == "__main__":
    _rank_main(json.loads(sys.argv[1]))
