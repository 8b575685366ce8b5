"""One rank of a sharded-target run, for tests/test_dist.py (start it with mlx.launch).

    python dist_rank.py OUT_DIR TARGET DRAFT VERIFY [fault]

Rank 0 drives a schedule that takes Scalar, preempt, gate and re-arm at temperature 0 and
0.8 and writes each stream to OUT_DIR/rank0.json; followers write their summary. With
``fault``, rank 0 streams one long request and prints each event as a JSON line.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from specbatch.runtime.params import SamplingParams

PROMPTS = ["def f(x):", "import os\nimport sys\n", "class A:\n    pass\n", "x = 1"]


def config(verify: str) -> dict:
    return dict(speculative_width_cap=2, num_draft_tokens=3, rearm_min_remaining=4, verify=verify)


def schedule(engine, temperature: float) -> list[list[int]]:
    """A lone request (Scalar); after its first token three arrive (preempt, then gate over
    the cap of 2); a fifth is cancelled after two tokens; the short ones finish and the
    long one re-arms. The cancelled stream comes last."""
    def params(n, seed):
        return SamplingParams(max_tokens=n, temperature=temperature, seed=seed, ignore_eos=True)
    lone = engine.submit(PROMPTS[0], params(48, 7))
    next(iter(lone))  # the first token is out: the scalar loop is live
    rest = engine.submit_many(PROMPTS[1:], params(6, 11))
    dropped = engine.submit("x = 1\n" * 300, params(40, 5))  # its plan outgrows one message
    events = iter(dropped)
    next(events), next(events)
    engine.cancel(dropped)  # every rank must drop it at the same step
    cut = dropped.result(timeout=300)
    assert cut.finish_reason == "cancelled", cut.finish_reason
    return [h.result(timeout=300).token_ids for h in [lone, *rest]] + [cut.token_ids]


def run_schedules(engine) -> dict:
    return {"t0": schedule(engine, 0.0), "t08": schedule(engine, 0.8)}


def fault_stream(engine) -> None:
    handle = engine.submit(PROMPTS[0], SamplingParams(max_tokens=2000, ignore_eos=True))
    for event in handle:
        print(json.dumps({"token": event.token, "finish": event.finish_reason, "error": event.error}), flush=True)
    print(json.dumps({"failure": engine.failure}), flush=True)


def main() -> None:
    out, target, draft, verify = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    fault = len(sys.argv) > 5
    from specbatch.kernels.models import load
    from specbatch.serving.dist import Peers, follow, sharded_engine

    peers = Peers.init("ring", timeout_s=4.0 if fault else 60.0)
    if not peers.driver:
        (out / f"pid{peers.rank}").write_text(str(__import__("os").getpid()))
        summary = follow(peers, load(target))
        (out / f"rank{peers.rank}.json").write_text(json.dumps(summary))
        return
    engine = sharded_engine(target, draft, peers=peers, **config(verify))
    if fault:
        fault_stream(engine)
        return
    t0 = time.perf_counter()
    streams = run_schedules(engine)
    elapsed = time.perf_counter() - t0
    transitions = engine.stats()["transitions"]
    engine.close(drain=True)
    (out / "rank0.json").write_text(json.dumps({"streams": streams, "transitions": transitions,
                                                "seconds": elapsed}))


if __name__ == "__main__":
    main()
