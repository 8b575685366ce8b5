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


async def _one(client, url, prompt, tokens, delay) -> dict:
    await asyncio.sleep(delay)
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, "stream": True}
    sent = time.perf_counter()
    stamps = []
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"text": ""' not in line:
                stamps.append(time.perf_counter())
    return {"sent": sent, "stamps": stamps}


async def poisson_load(base: str, prompts: list[str], rate: float, tokens: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    delays, t = [], 0.0
    for _ in prompts:
        delays.append(t)
        t += rng.expovariate(rate)
    async with httpx.AsyncClient(timeout=600) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*[_one(client, f"{base}/v1/completions", p, tokens, d)
                                      for p, d in zip(prompts, delays)])
        makespan = time.perf_counter() - t0
    ttft = [r["stamps"][0] - r["sent"] for r in runs if r["stamps"]]
    gaps = [b - a for r in runs for a, b in zip(r["stamps"], r["stamps"][1:])]
    tpot = [(r["stamps"][-1] - r["stamps"][0]) / (len(r["stamps"]) - 1) for r in runs if len(r["stamps"]) > 1]
    total = sum(len(r["stamps"]) for r in runs)
    return {"ttft": ttft, "gaps": gaps, "tpot": tpot, "tok_s": total / makespan}


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
    if hasattr(ctx.drafter, "model"):  # mlx-lm speculates only with a separate draft model
        systems["mlx_lm_draft"] = mlx + ["--draft-model", str(mlx_lm_folder(ctx.drafter.name)),
                                         "--num-draft-tokens", str(ctx.k)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(ctx.serving_requests)]
    rows = []
    for name, cmd in systems.items():
        port = _port()
        proc = start(cmd + ["--port", str(port)], port)
        try:
            base = f"http://127.0.0.1:{port}"
            asyncio.run(poisson_load(base, prompts[:2], 100.0, 4))  # warm up
            for label, rate in ctx.rates.items():
                out = asyncio.run(poisson_load(base, prompts, rate, ctx.tokens))
                rows.append({"system": name, "rate": label, "req_per_s": rate, "tok_s": out["tok_s"],
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
