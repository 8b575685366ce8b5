"""``n`` > 1: one prompt, ``n`` completions, each its own engine request.

Completion ``i`` samples with seed ``derive_seed(seed, i)`` (``i = 0`` keeps the request's
seed), so each equals the same request sent alone with that seed: position-keyed sampling
makes a stream a function of (seed, position) only. The ``n`` requests arrive at the
engine together, so their prompts are prefilled in one batched forward, and they decode in
one batch. Their events are merged into one stream of (index, event).
"""

from __future__ import annotations

import asyncio
import hashlib
from typing import AsyncIterator

import attrs

MAX_N = 16


def derive_seed(seed: int, index: int) -> int:
    """Completion ``index``'s seed: the request's own for 0, a hash of (seed, index) after."""
    if index == 0:
        return seed
    digest = hashlib.sha256(f"{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:4], "little")


def siblings(params, n: int) -> list:
    """``n`` copies of ``params`` (already seeded), each with its derived seed."""
    return [attrs.evolve(params, seed=derive_seed(params.seed, i)) for i in range(n)]


async def merge(streams: list) -> AsyncIterator[tuple[int, object]]:
    """(index, event) from every stream as they come; ends when all have ended."""
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, stream):
        try:
            async for event in stream:
                await queue.put((i, event))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, event = await queue.get()
            if event is done:
                left -= 1
            else:
                yield i, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
