"""Chunked prefill between rounds: a long arrival's prompt, one chunk between two rounds.

While requests decode, a prompt longer than one chunk is not prefilled at admission (a
2,000-token prompt takes ~8 s on the embedded target, and every live stream would stall
for all of it). Instead one chunk forward of the oldest such arrival, on its own
single-sequence cache, runs between two of the live rows' rounds; once the whole prompt
is in (``ready``) the arrival joins like any other, its first token sampled from the
logits kept from its last chunk. Chunk boundaries start at the prompt's first uncached token and
are those of a whole prefill (``runner.prefill``), so a stream prefilled this way equals
the same request prefilled at once.

The machine decides who joins and when; this only runs chunks and answers ``ready``.
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import structlog

from ...runtime.output import RoundOutput
from ...runtime.request import Request
from ..runner import TargetRunner, prefill_chunk
from .verify import last_hidden

log = structlog.get_logger(__name__)


@attrs.define(eq=False)
class Partial:
    """A long arrival's prefill so far: its caches hold ``prompt[:done]``."""

    request: Request
    cache: list  # single-sequence target caches, one per layer
    done: int  # prompt tokens in ``cache``
    logits: mx.array | None = None  # [1, V] at the last prompt token, once complete
    hidden: mx.array | None = None  # [1, D] there (head drafters), where the runner keeps it
    chunks: int = 0  # chunk forwards run here

    @property
    def complete(self) -> bool:
        return self.logits is not None


class ChunkedPrefill:
    """Long arrivals' partial prefills; ``step`` runs one chunk of the oldest one."""

    def __init__(self, runner: TargetRunner, enabled: bool = True, prompt_cache=None):
        self.runner, self.enabled = runner, enabled
        self.chunk = runner.prefill_chunk  # the whole prefill's chunks too: the same boundaries
        self.prompt_cache = prompt_cache  # a head start from a cached prefix (looked up once)
        self._partials: dict[str, Partial] = {}  # request id -> its prefill so far

    def long(self, request: Request) -> bool:
        """Its prompt takes more than one chunk: it prefills between rounds, not at admission."""
        return self.enabled and len(request.prompt) > self.chunk

    def ready(self, request: Request) -> bool:
        """It may join now: short, or its whole prompt is prefilled (pure)."""
        partial = self._partials.get(request.id)
        return not self.long(request) or (partial is not None and partial.complete)

    def cost(self, request: Request) -> int:
        """Prompt tokens its admission would prefill (an upper bound: cache hits are unknown)."""
        partial = self._partials.get(request.id)
        return 0 if partial is not None and partial.complete else len(request.prompt) - (partial.done if partial else 0)

    def step(self, waiting) -> RoundOutput:
        """One chunk of the oldest of ``waiting`` still prefilling (the machine passes those
        within the KV budget; it forgets cancelled ones itself); a failure aborts it."""
        request = next((r for r in waiting if not self.ready(r)), None)
        out = RoundOutput()
        if request is None:
            return out
        try:
            self._chunk(self._partial(request))
        except Exception as exc:  # one bad prompt never takes the live streams down
            log.exception("prefill_chunk_failed", request=request.id, error=str(exc))
            self._partials.pop(request.id, None)
            request.abort("error", f"prefill failed: {exc}")
            out.done.append(request)
        return out

    def take(self, request: Request) -> Partial | None:
        """Hand over (and forget) its prefill so far, for admission."""
        return self._partials.pop(request.id, None)

    def forget(self, waiting=()) -> None:
        """Drop the partial prefills of requests no longer waiting (cancelled, failed)."""
        keep = {r.id for r in waiting}
        for rid in [rid for rid in self._partials if rid not in keep]:
            del self._partials[rid]

    @property
    def tokens(self) -> int:
        """Prompt tokens prefilled so far, over all partial prefills."""
        return sum(p.done for p in self._partials.values())

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for p in self._partials.values() for c in p.cache)

    def __len__(self) -> int:
        return len(self._partials)

    def _partial(self, request: Request) -> Partial:
        partial = self._partials.get(request.id)
        if partial is None:
            cache, reused = self.prompt_cache.lookup(request.prompt) if self.prompt_cache else (None, 0)
            partial = Partial(request, cache if cache is not None else self.runner.make_cache(), reused)
            self._partials[request.id] = partial
        return partial

    def _chunk(self, p: Partial) -> None:
        prompt = p.request.prompt
        end = min(len(prompt), p.done + self.chunk)
        logits = prefill_chunk(self.runner, prompt[p.done:end], p.cache)  # [1, V]
        p.done, p.chunks = end, p.chunks + 1
        last = end == len(prompt)
        if last:
            p.logits, p.hidden = logits, last_hidden(self.runner)  # [1, V], [1, D] or None
            if p.hidden is not None:
                mx.eval(p.hidden)
        log.info("prefill_chunk", request=p.request.id, done=end, prompt_tokens=len(prompt), chunk=p.chunks)
        if last:
            log.info("prefill_ready", request=p.request.id, prompt_tokens=len(prompt), chunks=p.chunks)
