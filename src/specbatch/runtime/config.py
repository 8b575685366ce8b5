"""Engine configuration and environment switches (loading a pair: ``kernels.pair``).

Switches (both names work): ``SPECBATCH_PREEMPT`` / ``GMLX_MTP_PREEMPT`` (0: a lone
speculating stream makes arrivals wait), ``SPECBATCH_RESUME`` / ``GMLX_MTP_RESUME`` (0: a
gated batch stays plain until it finishes), ``SPECBATCH_WIDTH_CAP`` / ``GMLX_MTP_WIDTH_CAP``
(the cap; beats the config).
"""

from __future__ import annotations

import os

import attrs

from .policy import Prior, SpecPolicy, to_prior
from .tree_shape import BatchTree, TreeShape

DEFAULT_K = 4
DEFAULT_CAP = 2  # a separate drafter on a dense target, until calibration says otherwise
DEFAULT_PREFILL_CHUNK = 128  # ~0.4 s a chunk on the embedded target here, until calibration says otherwise
# the batch loop's KV: "paged" (16-token blocks read in place by the attention kernel:
# allocation 1.03x of need against dense's 1.48-1.80x at widths 4-16, decode 0.95-1.01x
# dense's tok/s at widths 1-16 with the prompt cache off, 1.13-1.33x with it on) or
# "dense" (one buffer per layer, rows padded to the longest)
KV_LAYOUTS = ("dense", "paged")
DEFAULT_KV_LAYOUT = "paged"


def _flag(*names: str, default: bool = True) -> bool:
    for name in names:
        value = os.environ.get(name)
        if value is not None:
            return value.strip().lower() not in ("0", "false", "no", "off")
    return default


def _positive(inst, attr, value):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{attr.name} must be a positive integer, got {value!r}")


def to_tree(value) -> TreeShape | None:
    """None, a ``TreeShape``, ``"2,1,1"`` or ``[2, 1, 1]``; a chain shape means chains (None)."""
    if value is None or isinstance(value, TreeShape):
        shape = value
    elif isinstance(value, str):
        shape = TreeShape.parse(value) if value.strip().lower() not in ("", "chain", "none") else None
    else:
        shape = TreeShape(value)
    return None if shape is None or shape.is_chain else shape


def check_cap(value) -> int:
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ValueError(f"speculative_width_cap must be an integer >= 0, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"speculative_width_cap must be an integer >= 0 (0 = uncapped), got {value!r}")
    return value


def _group(cls):
    """A converter: a settings group as itself, or its ``attrs.asdict`` form (over the wire)."""
    return lambda value: cls(**value) if isinstance(value, dict) else value


@attrs.frozen(kw_only=True)
class Drafts:
    """What the policy decides each round's draft from, and the overrides for A/B runs."""

    # False: the policy picks each round's draft (plain, k <= num_draft_tokens, a tree) from
    # the cost model and live acceptance; True: every speculating round drafts exactly
    # num_draft_tokens (or the tree shape), the explicit override for A/B runs
    fixed_draft: bool = False
    # requests sampled hotter than this gate the batch (None: any temperature speculates)
    max_spec_temperature: float | None = None
    # the calibrated cost model and acceptance prior the policy decides from
    prior: Prior = attrs.field(factory=Prior, converter=to_prior)
    # a candidate token tree for a lone (width-1) request (None: chains); the policy drafts
    # it where it expects more tokens per second than any chain; cut to num_draft_tokens
    tree_shape: TreeShape | None = attrs.field(default=None, converter=to_tree)
    # requests sampled hotter than this draft chains even alone (None: any temperature)
    tree_max_temperature: float | None = None
    # the tree batches of 2 or more draft per row, and up to which width (None: chains);
    # calibrated per pair where a tree beat the chain at that width
    batch_tree: BatchTree | None = attrs.field(default=None, converter=BatchTree.of)
    # a lone stream whose last this-many tokens occurred before drafts what followed them
    # there (prompt lookup, up to lookup_k tokens) where the policy expects it to pay, instead
    # of asking the MTP head (0: never; drafters keeping drafted state never do)
    prompt_lookup: int = attrs.field(default=4, validator=attrs.validators.ge(0))
    lookup_k: int = attrs.field(default=4, validator=_positive)


@attrs.frozen(kw_only=True)
class Memory:
    """Where the KV lives and how much of it there may be."""

    kv_budget_bytes: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # 0: unbounded
    prompt_cache_bytes: int = attrs.field(default=256 << 20, validator=attrs.validators.ge(0))
    kv_layout: str = attrs.field(default=DEFAULT_KV_LAYOUT, validator=attrs.validators.in_(KV_LAYOUTS))
    # the batch's target KV stored quantized per token (None: the model's dtype; paged only)
    kv_bits: int | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.in_((4, 8))))


@attrs.frozen(kw_only=True)
class Prefill:
    """Prompt tokens per prefill forward. While requests decode, a longer prompt is prefilled
    one chunk between two of their rounds and joins once all of it is in; a scalar stream
    keeps speculating meanwhile. Calibrated per target and machine (``specbatch calibrate``)."""

    prefill_chunk: int = attrs.field(default=DEFAULT_PREFILL_CHUNK, validator=_positive)
    chunked_prefill: bool = True  # False: a long arrival prefills whole at admission (live rows wait)


@attrs.frozen(kw_only=True)
class Rearm:
    """When a gated batch back within the cap re-arms."""

    rearm_min_remaining: int = attrs.field(default=8, validator=attrs.validators.ge(0))  # the longest row's budget left
    rearm_patience: int = attrs.field(default=0, validator=attrs.validators.ge(0))  # hysteresis, rounds


GROUPS = {"drafts": Drafts, "memory": Memory, "prefill": Prefill, "rearm": Rearm}


@attrs.frozen(kw_only=True, init=False)
class EngineConfig:
    """How the engine schedules; every field has a sensible default. The settings of a
    group are given by their own names too (``EngineConfig(kv_layout="paged")``)."""

    speculation: bool = True
    num_draft_tokens: int = attrs.field(default=DEFAULT_K, validator=_positive)
    speculative_width_cap: int = attrs.field(default=DEFAULT_CAP, converter=check_cap)
    max_batch: int = attrs.field(default=64, validator=_positive)
    max_queue: int = attrs.field(default=1024, validator=_positive)
    preempt: bool = attrs.field(factory=lambda: _flag("SPECBATCH_PREEMPT", "GMLX_MTP_PREEMPT"))
    resume: bool = attrs.field(factory=lambda: _flag("SPECBATCH_RESUME", "GMLX_MTP_RESUME"))
    # plain rounds dispatch their successor before reading (async eval); None: where the host
    # builds on a core the compute leaves free (``Kernels.spare_core``)
    pipeline: bool | None = None
    verify: str = attrs.field(default="coupled", validator=attrs.validators.in_(("coupled", "rejection")))
    # the longest prompt + completion served (None: the model's context); a longer prompt
    # is refused naming both lengths, a longer budget is clamped to the room left
    max_model_len: int | None = attrs.field(default=None, validator=attrs.validators.optional(_positive))
    drafts: Drafts = attrs.field(factory=Drafts, converter=_group(Drafts))
    memory: Memory = attrs.field(factory=Memory, converter=_group(Memory))
    prefill: Prefill = attrs.field(factory=Prefill, converter=_group(Prefill))
    rearm: Rearm = attrs.field(factory=Rearm, converter=_group(Rearm))

    def __init__(self, **settings):
        for name, group in GROUPS.items():
            mine = {f.name: settings.pop(f.name) for f in attrs.fields(group) if f.name in settings}
            whole = _group(group)(settings.pop(name, None) or group())
            settings[name] = attrs.evolve(whole, **mine) if mine else whole
        self.__attrs_init__(**settings)

    def policy(self) -> SpecPolicy:
        """The speculation policy these settings describe (the one place a draft is decided)."""
        d = self.drafts
        return SpecPolicy(prior=d.prior, max_k=self.num_draft_tokens, speculation=self.speculation,
                          fixed=d.fixed_draft, cap=self.speculative_width_cap, max_temperature=d.max_spec_temperature,
                          tree=d.tree_shape, tree_max_temperature=d.tree_max_temperature, batch_tree=d.batch_tree,
                          trees=self.verify == "coupled", lookup_k=d.lookup_k if d.prompt_lookup else 0)


def env_cap() -> int | None:
    for name in ("SPECBATCH_WIDTH_CAP", "GMLX_MTP_WIDTH_CAP"):
        if os.environ.get(name, "").strip():
            return check_cap(os.environ[name].strip())
    return None
