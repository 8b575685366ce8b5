"""Loading a target/drafter pair and the configuration its calibration implies.

The settings a caller leaves unset come from the calibration file (``kernels.calibration``)
for this pair on this machine: the policy's prior, the longest chain, the prefill chunk,
the trees and the temperature limit; the cap is the environment's, else the caller's,
else the widest width at which the policy expects speculation to pay.
"""

from __future__ import annotations

from . import models
from .calibration import lookup, prior_for
from ..runtime.config import EngineConfig, env_cap, to_tree
from ..runtime.tree_shape import BatchTree

DRAFTERS = ("model", "mtp", "ngram")


def load_pair(model=None, draft_model=None, *, speculation=True, speculative_width_cap=None,
              num_draft_tokens=None, dtype=None, drafter=None, **options):
    """Load target and drafter (the embedded target and its default drafter when ``model``
    is None); returns (target, drafter source or None, EngineConfig).

    ``drafter=None``: ``"model"`` when a ``draft_model`` is given, else the embedded
    target's default (its trained MTP head where one ships) or, for another target,
    prompt lookup. ``drafter="model"``: ``draft_model`` is a separate mlx-lm model. ``drafter="mtp"``: an
    MTP head, from ``draft_model`` (our head folder, or a checkpoint that ships MTP
    layers), else the target folder's ``mtp/`` or the target checkpoint itself.
    ``drafter="ngram"``: prompt lookup in each request's own tokens (no weights)."""
    if drafter is None:
        drafter = "model" if draft_model is not None else (models.default_drafter() if model is None else "ngram")
    if drafter not in DRAFTERS:
        raise ValueError(f"drafter must be 'model', 'mtp' or 'ngram', got {drafter!r}")
    if model is None:
        pair = models.demo_pair()
        model = str(pair["target"])
        if draft_model is None:
            draft_model = str(pair["mtp" if drafter == "mtp" else "drafter"])
    target = models.load(model, dtype=dtype)
    source = _drafter(drafter, draft_model, target, dtype) if speculation else None
    fields = dict(calibrated(target.name, source and source.name, options), speculation=source is not None)
    if num_draft_tokens is None and source is not None:
        num_draft_tokens = lookup(target.name, source.name, "max_k")
    if num_draft_tokens is not None:
        fields["num_draft_tokens"] = num_draft_tokens
    cap = _cap(speculative_width_cap, fields)
    if cap is not None:
        fields["speculative_width_cap"] = cap
    return target, source, EngineConfig(**fields)


def _drafter(kind: str, draft_model, target, dtype):
    if kind == "mtp":
        return models.load_mtp_head(draft_model, target)
    if kind == "ngram":
        from .drafters.ngram import NGramSource
        return NGramSource(target.vocab_size)
    if draft_model is None:
        return None
    drafter = models.load(draft_model, dtype=dtype)
    models.check_pair(target, drafter)
    return drafter


def calibrated(target: str, drafter: str | None, options: dict) -> dict:
    """``options`` with what the caller left unset filled in from the calibration."""
    options = dict(options)
    if options.get("prefill_chunk") is None:  # set, else calibrated for this target, else the default
        options.pop("prefill_chunk", None)
        chunk = lookup(target, None, "prefill_chunk")
        if chunk is not None:
            options["prefill_chunk"] = chunk
    if drafter is None:
        return options
    options.setdefault("prior", prior_for(target, drafter))
    if "tree_shape" not in options:
        options["tree_shape"] = lookup(target, drafter, "tree", to_tree)
        options.setdefault("tree_max_temperature", lookup(target, drafter, "tree_max_temperature", float))
    if "batch_tree" not in options:
        options["batch_tree"] = lookup(target, drafter, "batch_tree", BatchTree.of)
    if "max_spec_temperature" not in options:
        options["max_spec_temperature"] = lookup(target, drafter, "max_temperature", float)
    return options


def _cap(explicit, fields: dict) -> int | None:
    """The environment, then the argument, then where the policy expects speculation to pay."""
    cap = env_cap()
    if cap is None:
        cap = explicit
    if cap is None and fields["speculation"]:
        unset = EngineConfig(**fields)  # nothing pays: the cap is 1 and the policy decodes plain
        cap = max(1, unset.policy().paying_width(unset.max_batch))
    return cap
