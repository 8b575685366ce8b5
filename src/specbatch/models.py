"""Loading target and draft models (mlx-lm folders or Hugging Face ids), dtype, vocab checks.

fp32 on the CPU backend (half precision has no fast CPU path), the checkpoint's own
dtype on Metal/CUDA, unless a dtype is asked for.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
import structlog

from .kv import check_supported

log = structlog.get_logger(__name__)

DEMO_DIR = Path(__file__).parent / "demo_models"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


class ModelNotFound(ValueError):
    """The model path or id does not exist (and cannot be fetched here)."""


@attrs.define
class LoadedModel:
    """A model, its tokenizer (mlx-lm ``TokenizerWrapper``) and where it came from."""

    model: nn.Module
    tokenizer: object
    name: str
    context_length: int

    @property
    def vocab_size(self) -> int:
        return int(self.model.args.vocab_size)

    @property
    def n_layers(self) -> int:
        return len(self.model.layers)


def default_dtype() -> mx.Dtype | None:
    """fp32 on CPU; None (keep the checkpoint's dtype) on a GPU."""
    return mx.float32 if mx.default_device() == mx.cpu else None


def resolve_dtype(dtype: str | None) -> mx.Dtype | None:
    if dtype is None or dtype == "auto":
        return default_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def demo_path(role: str) -> Path:
    """The embedded demo pair shipped with the package ('target' or 'drafter')."""
    return DEMO_DIR / role


def has_demo_pair() -> bool:
    return (demo_path("target") / "config.json").exists() and (demo_path("drafter") / "config.json").exists()


def demo_pair() -> dict[str, Path]:
    """The embedded pair; where a checkout lacks it, a tiny random pair built once."""
    if has_demo_pair():
        return {"target": demo_path("target"), "drafter": demo_path("drafter"), "mtp": demo_path("mtp")}
    from .tiny import build_tiny_model
    root = Path.home() / ".cache" / "specbatch" / "tiny-pair"
    shapes = {"target": dict(hidden=256, layers=4, intermediate=768, heads=4),
              "drafter": dict(hidden=64, layers=1, intermediate=128, heads=2, kv_heads=1)}
    for role, shape in shapes.items():
        if not (root / role / "config.json").exists():
            log.warning("demo_pair_missing", building=str(root / role))
            build_tiny_model(root / role, seed=0 if role == "target" else 1, **shape)
    return {**{role: root / role for role in shapes}, "mtp": root / "mtp"}


def load_mtp_head(path, target: LoadedModel):
    """An MTP head for ``target``: our head folder, or MTP layers a checkpoint ships."""
    from .drafters.mtp import load_head
    candidates = [Path(path)] if path else [Path(target.name) / "mtp", Path(target.name)]
    for folder in candidates:
        if (folder / "mtp_config.json").exists() or (folder / "config.json").exists():
            try:
                return load_head(folder, target.model.args)
            except ValueError:
                if path:
                    raise
    raise ModelNotFound(f"no MTP head for {target.name!r} (looked in {[str(c) for c in candidates]})")


def _context_length(model: nn.Module, tokenizer) -> int:
    args = model.args
    for name in ("max_position_embeddings", "max_seq_len", "n_ctx"):
        value = getattr(args, name, None)
        if isinstance(value, int) and value > 0:
            return value
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**7 else 4096


def load(path_or_id: str | Path, dtype: str | None = None) -> LoadedModel:
    """Load an mlx-lm model folder, or a Hugging Face id where a network exists."""
    from mlx_lm.utils import load as mlx_load

    name = str(path_or_id)
    local = Path(name).expanduser()
    # not a folder here, and not shaped like a hub id ("org/name"): no hub to ask either
    if not local.exists() and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise ModelNotFound(f"model not found: {name!r}")
    try:
        model, tokenizer = mlx_load(str(local) if local.exists() else name)
    except Exception as exc:  # hub errors, missing files: one clear message
        raise ModelNotFound(f"could not load model {name!r}: {exc}") from exc
    check_supported(model)
    target_dtype = resolve_dtype(dtype)
    if target_dtype is not None:
        model.set_dtype(target_dtype)
    mx.eval(model.parameters())
    loaded = LoadedModel(model, tokenizer, name, _context_length(model, tokenizer))
    log.debug("model_loaded", model=name, layers=loaded.n_layers, vocab=loaded.vocab_size,
              dtype=str(target_dtype), context=loaded.context_length)
    return loaded


def kv_bytes_per_token(model) -> int:
    """Target KV bytes one token costs across all layers (0 when the shape is unknown)."""
    args = model.args
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (args.hidden_size // heads if heads else None)
    if not kv_heads or not head_dim:
        return 0
    leaves = [p for _, p in tree_flatten(model.parameters())]
    itemsize = leaves[0].dtype.size if leaves else 4
    return 2 * len(model.layers) * kv_heads * head_dim * itemsize


def check_pair(target: LoadedModel, drafter: LoadedModel) -> None:
    """Target and drafter must share a vocabulary (the same token ids mean the same text)."""
    tv, dv = target.tokenizer.vocab_size, drafter.tokenizer.vocab_size
    same = tv == dv and target.tokenizer.get_vocab() == drafter.tokenizer.get_vocab()
    if not same or target.vocab_size < tv or drafter.vocab_size < dv:
        raise ValueError(
            f"target {target.name!r} and drafter {drafter.name!r} do not share a vocabulary "
            f"(tokenizer sizes {tv} vs {dv}); speculative decoding needs the same tokenizer")
