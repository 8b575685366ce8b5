"""The composition root: loading a pair, the kernels over it, and an engine (or a bare
core) built on them.

The runtime imports none of this: ``EngineCore(kernels, tokenizer, config)`` takes the
``scheduler.Kernels`` built here (the target runner, the drafter factory, both loops,
admission, the prompt cache) and builds its own machine over them. ``from_pretrained``
loads a pair (``kernels.pair``) and returns a started ``Engine`` (or a core).
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import os

import attrs
import mlx.core as mx
import structlog

from ..runtime.config import EngineConfig
from ..runtime.core import EngineCore
from ..runtime.engine import Engine, close_engines
from ..runtime.output import RoundOutput
from ..runtime.request import Request
from . import cpu
from .drafters.model import ModelDrafter
from .drafters.mtp import MTPDrafter, MTPHead
from .drafters.ngram import NGramDrafter, NGramSource
from .loops.admission import admit_each
from .loops.batch import BatchLoop, held_tokens, retires
from .loops.prefill import ChunkedPrefill
from .loops.scalar import ScalarLoop
from .models import LoadedModel, kv_bytes_per_token
from .paged_kv import KVLayout
from .pair import load_pair
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


def spare_core() -> bool:
    """Whether the host thread builds the next graph on a core the compute leaves free: a GPU
    computes, or the CPU kernels' threads number fewer than the process's cores. Where none is
    free, a pipelined plain round's build takes cycles from the compute threads: two-core Zen 4,
    the batch loop's plain rounds alternating with and without their successor, 1.06x the time at
    width 1, 1.09x at width 2, even within noise at 4-16."""
    if mx.default_device().type != mx.DeviceType.cpu:
        return True
    ext = cpu.extension()  # off: MLX's ops and the BLAS run on every core
    return ext is not None and ext.threads() < len(os.sched_getaffinity(0))


@attrs.define
class LoopKernels:
    """``scheduler.Kernels`` over a real target (and drafter source)."""

    target: LoadedModel
    drafter: object | None  # a draft model, an MTP head, an n-gram source (None: plain)
    runner: TargetRunner
    config: EngineConfig  # the verify mode, the prefill settings
    drafter_factory: object = make_drafter  # (source, runner, batch) -> Drafter
    prompt_cache: PromptCache = attrs.field(factory=PromptCache)
    token_bytes: int = 0
    chunks: ChunkedPrefill | None = None  # long arrivals prefilled between rounds (None: built here)
    spare_core: bool = attrs.field(factory=spare_core)  # plain rounds pipeline where the config leaves it to us

    def __attrs_post_init__(self):
        if self.chunks is None:
            self.chunks = ChunkedPrefill(self.runner, self.config.prefill.chunked_prefill, self.prompt_cache)

    @property
    def speculative(self) -> bool:
        return self.drafter is not None and self.config.speculation

    @property
    def drafter_name(self) -> str | None:
        return getattr(self.drafter, "name", None)  # a follower's remote drafter has none

    def _drafter(self, batch: bool):
        return self.drafter_factory(self.drafter, self.runner, batch)

    def scalar(self, request: Request) -> tuple[ScalarLoop, RoundOutput]:
        loop = ScalarLoop(self.runner, self._drafter(batch=False), request, self.config.verify, self._layout(),
                          self.config.drafts.prompt_lookup)
        partial, reused = self.chunks.take(request), 0
        if partial is not None:  # (some of) its prompt was prefilled between rounds
            out = loop.start(partial.cache, partial.logits, partial.hidden)
        else:
            cache, reused = self.prompt_cache.lookup(request.prompt)
            out = loop.start(cache)
        self.prompt_cache.offer(request, loop.singles)  # arrivals while it runs reuse its prompt
        log.info("admit", reused=reused, request=request.id, loop="scalar", prompt_tokens=len(request.prompt))
        return loop, out

    def _layout(self) -> KVLayout:
        return KVLayout(self.config.memory.kv_layout, self.config.memory.kv_bits)

    def batch(self, speculative: bool) -> BatchLoop:
        drafter = self._drafter(batch=True) if speculative else None
        loop = BatchLoop(self.runner, drafter, self.config.verify, self._layout())
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
            held = held_tokens(loop.request)
            self.prompt_cache.retire(held, loop.singles(len(held)))

    def gauges(self) -> dict:
        pc = self.prompt_cache
        return {"prompt_cache_hits": pc.hits, "prompt_cache_misses": pc.misses,
                "prompt_cache_bytes": pc.nbytes, "prompt_cache_entries": len(pc),
                "prefilling": len(self.chunks), "prefill_tokens": self.chunks.tokens,
                "prefill_kv_bytes": self.chunks.nbytes}


    def release_memory(self) -> None:
        """Hand freed memory back to the OS when the engine goes idle: MLX's buffer cache, and
        the free pages glibc's heap keeps (RSS grew ~120 MB over 1,000 requests without it,
        with MLX's active memory flat)."""
        mx.clear_cache()
        try:
            ctypes.CDLL(None).malloc_trim(0)  # glibc only; elsewhere there is nothing to call
        except (OSError, AttributeError):
            pass

    def end_thread(self) -> None:
        """The thread that ran the rounds is ending: MLX needs its streams cleared first."""
        mx.clear_streams()


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.cache
def retain_freed_memory() -> bool:
    """From the first engine on, glibc keeps freed memory for reuse (blocks up to 32 MB from its
    heap, the heap's top untrimmed) rather than mapping fresh pages each time: a finished
    1,900-token row's copy into the prompt cache faulted 17k pages, 55-60 ms, against 27-31 ms
    and none with them kept. ``release_memory`` trims when the engine goes idle.
    ``SPECBATCH_RETAIN_MEMORY=0`` leaves the process's allocator as it was."""
    if os.environ.get("SPECBATCH_RETAIN_MEMORY") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        kept = libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20) and libc.mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1)
    except (OSError, AttributeError):  # not glibc: nothing to set
        return False
    log.info("allocator", retain_freed=bool(kept))
    return bool(kept)


def build_kernels(target: LoadedModel, drafter=None, config: EngineConfig | None = None,
                  drafter_factory=make_drafter) -> LoopKernels:
    """Kernels over ``target``; ``drafter``: its source, or None."""
    config = config or EngineConfig()
    retain_freed_memory()
    runner = ModelRunner(target.model, config.prefill.prefill_chunk)
    return LoopKernels(target, drafter, runner, config, drafter_factory, PromptCache(config.memory.prompt_cache_bytes),
                       kv_bytes_per_token(target.model))


def new_core(target: LoadedModel, drafter=None, config: EngineConfig | None = None, *,
             drafter_factory=make_drafter, **options) -> EngineCore:
    """A core stepped by its caller over fresh kernels (``options``: ``EngineCore``'s)."""
    config = config or EngineConfig()
    return EngineCore(build_kernels(target, drafter, config, drafter_factory), target.tokenizer, config, **options)


def new_engine(target: LoadedModel, drafter=None, config: EngineConfig | None = None, *,
               drafter_factory=make_drafter, **options) -> Engine:
    """A started engine over fresh kernels (``options``: ``Engine``'s)."""
    config = config or EngineConfig()
    return Engine(build_kernels(target, drafter, config, drafter_factory), target.tokenizer, config, **options)


def from_pretrained(model: str | None = None, draft_model: str | None = None, *,
                    speculation: bool = True, speculative_width_cap: int | None = None,
                    num_draft_tokens: int | None = None, core: bool = False, **options):
    """Load a target (and drafter) as ``load_pair`` does and start an ``Engine`` on them
    (``core``: a bare ``EngineCore``); ``model=None``: the embedded pair."""
    target, drafter, config = load_pair(model, draft_model, speculation=speculation,
                                        speculative_width_cap=speculative_width_cap,
                                        num_draft_tokens=num_draft_tokens, **options)
    return (new_core if core else new_engine)(target, drafter, config)


@atexit.register
def _at_exit() -> None:
    # MLX aborts at exit if a thread still holds streams: stop engine threads first.
    close_engines()
    mx.clear_streams()
