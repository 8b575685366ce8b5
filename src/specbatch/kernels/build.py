"""The kernels the machine drives, built here and handed in behind ``scheduler``'s
Protocols: the target runner, the drafter factory, both loops, admission, the prompt cache.

This is the only place that joins the MLX side to the machine; ``machine.py`` imports
none of it, so the machine and its chart load without MLX.
"""

from __future__ import annotations

import attrs
import structlog

from ..runtime.output import RoundOutput
from ..runtime.request import Request
from .drafters.model import ModelDrafter
from .drafters.mtp import MTPDrafter, MTPHead
from .drafters.ngram import NGramDrafter, NGramSource
from .loops.admission import admit_each
from .loops.batch import BatchLoop, held_tokens, retires
from .loops.prefill import ChunkedPrefill
from .loops.scalar import ScalarLoop
from .models import kv_bytes_per_token
from .prompt_cache import PromptCache
from .runner import ModelRunner, TargetRunner

log = structlog.get_logger(__name__)


def make_drafter(source, runner, batch: bool):
    """A Drafter from its source: an MTP head on ``runner``, prompt lookup, or a draft model."""
    if isinstance(source, MTPHead):
        return MTPDrafter(source, runner)
    if isinstance(source, NGramSource):
        return NGramDrafter(source)
    return ModelDrafter(source.model, batch=batch)


@attrs.define
class LoopKernels:
    """``scheduler.Kernels`` over a real target (and drafter source)."""

    runner: TargetRunner
    config: object  # EngineConfig: the verify mode, the prefill settings
    drafter_source: object | None  # a draft model, an MTP head, an n-gram source; None: plain
    drafter_factory: object = make_drafter  # (source, runner, batch) -> Drafter
    prompt_cache: PromptCache = attrs.field(factory=PromptCache)
    token_bytes: int = 0
    chunks: ChunkedPrefill | None = None  # long arrivals prefilled between rounds (None: built here)

    def __attrs_post_init__(self):
        if self.chunks is None:
            self.chunks = ChunkedPrefill(self.runner, getattr(self.config, "chunked_prefill", True),
                                         self.prompt_cache)

    @property
    def speculative(self) -> bool:
        return self.drafter_source is not None and self.config.speculation

    def _drafter(self, batch: bool):
        return self.drafter_factory(self.drafter_source, self.runner, batch)

    def scalar(self, request: Request) -> tuple[ScalarLoop, RoundOutput]:
        loop = ScalarLoop(self.runner, self._drafter(batch=False), request, self.config.verify)
        partial, reused = self.chunks.take(request), 0
        if partial is not None:  # (some of) its prompt was prefilled between rounds
            out = loop.start(partial.cache, partial.logits, partial.hidden)
        else:
            cache, reused = self.prompt_cache.lookup(request.prompt)
            out = loop.start(cache)
        self.prompt_cache.offer(request, loop.cache)  # arrivals while it runs reuse its prompt
        log.info("admit", reused=reused, request=request.id, loop="scalar", prompt_tokens=len(request.prompt))
        return loop, out

    def batch(self, speculative: bool) -> BatchLoop:
        drafter = self._drafter(batch=True) if speculative else None
        loop = BatchLoop(self.runner, drafter, self.config.verify)
        loop.retire = self.prompt_cache.retire
        return loop

    def admit(self, loop: BatchLoop, requests: list[Request]) -> RoundOutput:
        prefilled = {r.id: p for r in requests if (p := self.chunks.take(r)) is not None}
        fresh = [r.prompt for r in requests if r.id not in prefilled]
        self.prompt_cache.warm(self.runner, fresh)  # a shared prefix, once
        out = admit_each(loop, requests, self.prompt_cache, prefilled)
        self.prompt_cache.offer_rows(loop)  # later arrivals reuse these prompts
        return out

    # -- chunked prefill (the machine asks; ``loops/prefill.py`` runs it) ----------------
    def ready(self, request: Request) -> bool:
        return self.chunks.ready(request)

    def prefill_cost(self, request: Request) -> int:
        return self.chunks.cost(request)

    def prefill_step(self, waiting) -> RoundOutput:
        return self.chunks.step(waiting)

    def forget(self, waiting) -> None:
        self.chunks.forget(waiting)

    def retire(self, loop: ScalarLoop) -> None:
        if retires(loop.request):
            self.prompt_cache.retire(held_tokens(loop.request), loop.cache)

    def gauges(self) -> dict:
        pc = self.prompt_cache
        return {"prompt_cache_hits": pc.hits, "prompt_cache_misses": pc.misses,
                "prompt_cache_bytes": pc.nbytes, "prompt_cache_entries": len(pc),
                "prefilling": len(self.chunks), "prefill_tokens": self.chunks.tokens,
                "prefill_kv_bytes": self.chunks.nbytes}


def build_kernels(target, drafter, config, drafter_factory=make_drafter) -> LoopKernels:
    """Kernels over ``target`` (a LoadedModel); ``drafter``: its source, or None."""
    runner = ModelRunner(target.model, config.prefill_chunk)
    runner.kv_bits = config.kv_bits  # the batch loop's KV storage (batch_kv reads it)
    runner.kv_layout = config.kv_layout
    return LoopKernels(runner, config, drafter if config.speculation else None,
                       drafter_factory, PromptCache(config.prompt_cache_bytes),
                       kv_bytes_per_token(target.model))


def build_scheduler(target, drafter, config, stats, deliver, drafter_factory=make_drafter):
    """The state machine over fresh kernels: what ``EngineCore`` builds by default."""
    from ..runtime.machine import SpecMachine

    return SpecMachine(build_kernels(target, drafter, config, drafter_factory), config, stats, deliver)
