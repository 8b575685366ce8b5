"""Serving benchmark: Poisson arrivals against ``specbatch serve`` and ``mlx_lm.server``
(with ``--draft-model``, which serialises, and without, which batches), same prompts.

Every server runs in its own process on loopback with OpenBLAS preloaded; the load is
bounded in count and time. Reported per system and rate: TTFT, time per output token,
inter-token latency p50/p99 and aggregate throughput, with ratios.
"""

from __future__ import annotations

import asyncio
import random
import socket
import subprocess
import sys
import time

import httpx

from ...blas import preload_env


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(cmd: list[str], port: int, timeout: float = 180) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, env=preload_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early: {' '.join(cmd)}")
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"server did not come up: {' '.join(cmd)}")


async def _one(client, url, prompt, tokens, delay, timeout: float) -> dict:
    """One streamed request sent after ``delay``; cut at ``timeout`` seconds from sending
    (a server that serialises can leave a Poisson queue waiting for minutes)."""
    await asyncio.sleep(delay)
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True}
    sent = time.perf_counter()
    stamps: list[float] = []

    async def read() -> None:
        async with client.stream("POST", url, json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {") and '"text": ""' not in line:
                    stamps.append(time.perf_counter())
    try:
        await asyncio.wait_for(read(), timeout)
        return {"sent": sent, "stamps": stamps, "timed_out": False}
    except asyncio.TimeoutError:
        return {"sent": sent, "stamps": stamps, "timed_out": True}


async def poisson_load(base: str, prompts: list[str], rate: float, tokens: int, seed: int = 0,
                       timeout: float = 600.0) -> dict:
    """Requests at Poisson arrivals; throughput is the tokens received over the makespan
    (a timed-out request counts what it received and ends the makespan at its cut)."""
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate)
    async with httpx.AsyncClient(timeout=timeout + 30) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[_one(client, f"{base}/v1/completions", p, tokens, d, timeout)
                                      for p, d in zip(prompts, delays)])
        makespan = time.perf_counter() - t0
    ttft = [r["stamps"][0] - r["sent"] for r in runs if r["stamps"]]
    gaps = [b - a for r in runs for a, b in zip(r["stamps"], r["stamps"][1:])]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) for r in runs if len(r["stamps"]) > 1]
    total = sum(len(r["stamps"]) for r in runs)
    return {"ttft": ttft, "gaps": gaps, "tpot": tpot, "tok_s": total / makespan,
            "timed_out": sum(r["timed_out"] for r in runs)}


def draft_model_folder(ctx):
    """The separate draft model mlx-lm can speculate with: the bench's drafter when it is
    one, else the demo pair's draft model (when the target is the embedded one)."""
    from ...kernels.models import demo_pair
    from .harness import mlx_lm_folder
    if hasattr(ctx.drafter, "model"):
        return mlx_lm_folder(ctx.drafter.name)
    folder = demo_pair()["drafter"]
    if ctx.target.name == str(demo_pair()["target"]) and folder.exists():
        return mlx_lm_folder(str(folder))
    return None


def suite_serving(ctx) -> dict:
    from ..workload import texts
    from .serving import _pct
    PROMPTS = texts(ctx.target.tokenizer, 8)
    from .harness import drafter_args, mlx_lm_folder
    target = ctx.target.name
    # the engine's own calibrated schedule and cap: no --num-draft-tokens / cap override
    me = [sys.executable, "-m", "specbatch.serving.cli", "serve", "--model", target, *drafter_args(ctx.drafter),
          "--served-model-name", "default"]
    mlx = [sys.executable, "-m", "mlx_lm.server", "--model", str(mlx_lm_folder(target))]
    systems = {"specbatch": me, "mlx_lm": mlx}
    draft = draft_model_folder(ctx)
    if draft is not None:  # mlx-lm speculates only with a separate draft model (and one request at a time)
        # our k when the bench drafts with that model; else mlx-lm's own default length
        k = ["--num-draft-tokens", str(ctx.k)] if hasattr(ctx.drafter, "model") else []
        systems["mlx_lm_draft"] = mlx + ["--draft-model", str(draft), *k]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(ctx.serving_requests)]
    rows = []
    for name, cmd in systems.items():
        port = _port()
        proc = start(cmd + ["--port", str(port)], port)
        try:
            base = f"http://127.0.0.1:{port}"
            asyncio.run(poisson_load(base, prompts[:2], 100.0, 4))  # warm up
            for label, rate in ctx.rates.items():
                out = asyncio.run(poisson_load(base, prompts, rate, ctx.tokens, timeout=ctx.request_timeout))
                rows.append({"system": name, "rate": label, "req_per_s": rate, "tok_s": out["tok_s"],
                             "requests": len(prompts), "timed_out": out["timed_out"],
                             "ttft_p50_s": _pct(out["ttft"], 0.5), "ttft_p99_s": _pct(out["ttft"], 0.99),
                             "tpot_p50_s": _pct(out["tpot"], 0.5), "itl_p50_s": _pct(out["gaps"], 0.5),
                             "itl_p99_s": _pct(out["gaps"], 0.99)})
        finally:
            proc.terminate()
            proc.wait(30)
    by = {(r["system"], r["rate"]): r for r in rows}
    ratios = {label: {f"over_{other}": by[("specbatch", label)]["tok_s"] / by[(other, label)]["tok_s"]
                      for other in systems if other != "specbatch"} for label in ctx.rates}
    return {"rows": rows, "throughput_ratios": ratios}


SUITES = {"serving": suite_serving}
