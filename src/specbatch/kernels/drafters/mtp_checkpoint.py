"""Loading an MTP head (`load_head`): our own format, or the MTP layers that real checkpoints
ship (and mlx-lm drops on load), mapped onto ``MTPHead``.

Two layouts, for dense llama/qwen-style attention and MLP inside the MTP layer:
- DeepSeek-V3 style: layer ``model.layers.{num_hidden_layers}`` with ``enorm``, ``hnorm``,
  ``eh_proj``, ``shared_head.norm`` (its ``embed_tokens`` and ``shared_head.head`` copies
  are skipped: the head shares the target's);
- Qwen3-Next style: ``mtp.fc``, ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``,
  ``mtp.layers.0.*``, ``mtp.norm``.
MLA attention or MoE MLPs inside the MTP layer are not covered (a clear error says so).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from .mtp import MTPHead, head_config
from ..cpu import blocks, extension
from ..cpu.modules import use_cpu_kernels

BLOCK_PARTS = ("self_attn.", "mlp.", "input_layernorm.", "post_attention_layernorm.")


def _rename(key: str, n_layers: int) -> str | None:
    ds = f"model.layers.{n_layers}."
    if key.startswith(ds):
        rest = key[len(ds):]
        simple = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                  "eh_proj.weight": "eh_proj.weight", "shared_head.norm.weight": "norm.weight"}
        if rest in simple:
            return simple[rest]
        return f"block.{rest}" if rest.startswith(BLOCK_PARTS) else None
    if key.startswith("mtp."):
        rest = key[len("mtp."):]
        simple = {"fc.weight": "eh_proj.weight", "pre_fc_norm_embedding.weight": "enorm.weight",
                  "pre_fc_norm_hidden.weight": "hnorm.weight", "norm.weight": "norm.weight"}
        if rest in simple:
            return simple[rest]
        if rest.startswith("layers.0."):
            inner = rest[len("layers.0."):]
            return f"block.{inner}" if inner.startswith(BLOCK_PARTS) else None
    return None


def head_from_checkpoint(folder: Path, target_args=None) -> MTPHead:
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text())
    n_layers = config["num_hidden_layers"]
    weights = {}
    for file in sorted(folder.glob("*.safetensors")):
        for key, value in mx.load(str(file)).items():
            name = _rename(key, n_layers)
            if name is not None:
                weights[name] = value
    if "eh_proj.weight" not in weights:
        raise ValueError(f"{folder} ships no MTP layer in a supported layout (DeepSeek-V3 or Qwen3-Next style)")
    if any(k.startswith("block.self_attn.") and ("kv_a_proj" in k or "q_a_proj" in k) for k in weights):
        raise ValueError("MLA attention in the MTP layer is not supported")
    if "block.mlp.gate_proj.weight" not in weights:
        raise ValueError("the MTP layer's MLP is not a dense gate/up/down MLP (MoE is not supported)")
    args = target_args
    if args is None:
        from mlx_lm.models import llama
        args = llama.ModelArgs.from_dict(config)
    head = MTPHead(head_config(args, intermediate_size=weights["block.mlp.gate_proj.weight"].shape[0]))
    head.load_weights(list(weights.items()), strict=False)
    missing = {k for k, _ in tree_flatten(head.parameters())} - set(weights)
    if missing:
        raise ValueError(f"MTP layer in {folder} lacks {sorted(missing)}")
    return head


def write_tiny_checkpoint(folder: Path, target, style: str = "deepseek", seed: int = 0) -> Path:
    """A target folder plus a random MTP layer in a real checkpoint's naming (for tests)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    args = target.model.args
    mx.random.seed(seed)
    head = MTPHead(head_config(args, intermediate_size=64))
    n = len(target.model.layers)
    weights = dict(tree_flatten(target.model.parameters()))
    for key, value in tree_flatten(head.parameters()):
        if style == "deepseek":
            outer = {"enorm.weight": "enorm.weight", "hnorm.weight": "hnorm.weight",
                     "eh_proj.weight": "eh_proj.weight", "norm.weight": "shared_head.norm.weight"}
            name = outer.get(key) or key[len("block."):]
            weights[f"model.layers.{n}.{name}"] = value
        else:
            outer = {"enorm.weight": "pre_fc_norm_embedding.weight", "hnorm.weight": "pre_fc_norm_hidden.weight",
                     "eh_proj.weight": "fc.weight", "norm.weight": "norm.weight"}
            name = outer.get(key) or f"layers.0.{key[len('block.'):]}"
            weights[f"mtp.{name}"] = value
    if style == "deepseek":
        weights[f"model.layers.{n}.embed_tokens.weight"] = target.model.model.embed_tokens.weight
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    config = {k: v for k, v in vars(args).items() if not k.startswith("_")}
    config["num_nextn_predict_layers" if style == "deepseek" else "num_mtp_layers"] = 1
    (folder / "config.json").write_text(json.dumps(config, default=str))
    return folder


def load_head(folder: Path, target_args=None) -> MTPHead:
    """Our own format (``mtp_config.json``), or the MTP layer a checkpoint ships."""
    folder = Path(folder)
    if (folder / "mtp_config.json").exists():
        head = MTPHead(json.loads((folder / "mtp_config.json").read_text()))
        head.load_weights(list(mx.load(str(folder / "mtp.safetensors")).items()))
    else:
        head = head_from_checkpoint(folder, target_args)
    head.set_dtype(mx.float32 if mx.default_device() == mx.cpu else head.eh_proj.weight.dtype)
    head.name = str(folder)
    mx.eval(head.parameters())
    # frozen for drafting: its linears read 8-bit blocks where the kernels read blocks (half the
    # float16 bytes a draft step streams), else float16 where exact (heads are saved float16)
    made = blocks.quantize_linears(extension(), head, bits=8)
    use_cpu_kernels(head, half_weights=True)
    blocks.register(extension(), head, made)
    return head
