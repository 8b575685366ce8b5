"""GGUF files (llama.cpp, Ollama) as ordinary mlx-lm model folders.

A GGUF holds the weights, the architecture's hyper-parameters, the BPE vocabulary and
merges, the special tokens and the chat template. ``convert`` writes all of it out as a
folder ``mlx_lm.load`` opens on its own (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json); ``cached_folder`` does it once per file, keyed by its sha256.

Supported: llama-family architectures (llama, mistral, qwen2), tensor types F32, F16,
BF16, Q8_0, Q4_0 and Q4_1 (MLX reads the quantized ones as affine-quantized
weight/scales/biases with group size 32), byte-level BPE vocabularies. Everything else
is refused with a ``GGUFError`` naming what is unsupported.

llama.cpp's converter stores the Q and K rows of llama models interleaved for its RoPE
kernel; ``_unpermute`` puts them back in the Hugging Face order mlx-lm expects.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import mlx.core as mx
import structlog

log = structlog.get_logger(__name__)

ARCHITECTURES = ("llama", "mistral", "qwen2")
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# llama.cpp's converter permutes Q/K rows for these architectures only
PERMUTED = ("llama", "mistral")
GROUP = 32  # the block size of Q4_0, Q4_1 and Q8_0

LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# llama.cpp pre-tokenizer names -> (digits split one by one, regex family)
PRE_TOKENIZERS = {"gpt2": (False, "gpt2"), "default": (False, "gpt2"), "smollm": (True, "gpt2"),
                  "starcoder": (True, "gpt2"), "refact": (True, "gpt2"), "qwen2": (False, "qwen2"),
                  "llama-bpe": (False, "llama3"), "llama3": (False, "llama3")}
SPLIT_REGEX = {
    "qwen2": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    "llama3": r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
}
CONTROL, USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values


class GGUFError(ValueError):
    """The file is not a GGUF this loader supports; the message names what is not."""


def is_gguf(path) -> bool:
    path = Path(path)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return False
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def sha256(path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def inspect(path) -> dict:
    """The metadata and each tensor's type, read from the header (no weights loaded);
    raises ``GGUFError`` for anything ``convert`` cannot handle."""
    from gguf import GGUFReader

    try:
        reader = GGUFReader(str(path))
    except Exception as exc:  # not a GGUF, truncated, a newer format version
        raise GGUFError(f"{path}: not a readable GGUF file ({exc})") from None
    meta = {name: field.contents() for name, field in reader.fields.items()}
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    bad = sorted({t.tensor_type.name for t in reader.tensors} - set(TENSOR_TYPES))
    if bad:
        raise GGUFError(f"{path}: tensor types {', '.join(bad)} are not supported "
                        f"(supported: {', '.join(TENSOR_TYPES)}); re-quantize the file to one of them")
    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise GGUFError(f"{path}: tokenizer model {meta.get('tokenizer.ggml.model')!r} is not supported "
                        "(only byte-level BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{path}: pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    return meta


def model_config(meta: dict) -> dict:
    """The mlx-lm config.json of the GGUF's model (tied output when it has no ``output``)."""
    arch = meta["general.architecture"]

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    vocab = key("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config = {
        "model_type": "qwen2" if arch == "qwen2" else "llama",
        "hidden_size": hidden, "num_hidden_layers": int(key("block_count")),
        "intermediate_size": int(key("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": int(key("attention.key_length", key("rope.dimension_count", hidden // heads))),
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(key("context_length", 4096)),
        "vocab_size": int(vocab),
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
    }
    if arch == "qwen2":
        config["attention_bias"] = True
    return {k: v for k, v in config.items() if v is not None}


def _unpermute(w: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's per-head interleave of Q/K rows (rows of w, scales or biases)."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _mlx_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in LAYER_NAMES:
            raise GGUFError(f"tensor {name!r} has no llama-family counterpart")
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{suffix}"
    if stem not in TOP_NAMES:
        raise GGUFError(f"tensor {name!r} has no llama-family counterpart")
    return f"{TOP_NAMES[stem]}.{suffix}"


def _bits(weights: dict, stem: str) -> int | None:
    """Bits per weight of a quantized matrix (None when it is stored unquantized)."""
    scales = weights.get(f"{stem}.scales")
    if scales is None:
        return None
    return weights[f"{stem}.weight"].shape[-1] * 32 // (scales.shape[-1] * GROUP)


def convert_weights(weights: dict, config: dict, arch: str, dequantize: bool):
    """GGUF tensors -> (mlx-lm weights, per-module quantization or None)."""
    out, quant = {}, {}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    stems = sorted({name.rpartition(".")[0] for name in weights})
    for stem in stems:
        bits = _bits(weights, stem)
        parts = {s: weights[f"{stem}.{s}"] for s in ("weight", "scales", "biases", "bias")
                 if f"{stem}.{s}" in weights}
        if bits is not None and dequantize:
            w = mx.dequantize(parts.pop("weight"), parts.pop("scales"), parts.pop("biases"), GROUP, bits)
            parts["weight"] = w.astype(mx.float32)
        elif bits is not None:
            quant[_mlx_name(f"{stem}.weight").rpartition(".")[0]] = {"group_size": GROUP, "bits": bits}
        part = stem.rpartition(".")[2]
        if arch in PERMUTED and part in heads:
            parts = {s: _unpermute(v, heads[part]) for s, v in parts.items()}
        for suffix, value in parts.items():
            out[_mlx_name(f"{stem}.{suffix}")] = value
    return out, (quant or None)


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    digits, family = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if family == "gpt2":
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(SPLIT_REGEX[family]), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    return pre_tokenizers.Sequence(steps)


def write_tokenizer(meta: dict, out: Path, context: int) -> None:
    """tokenizer.json (byte-level BPE, control tokens special) and tokenizer_config.json."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    tokens = list(meta["tokenizer.ggml.tokens"])
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    types = [int(t) for t in meta.get("tokenizer.ggml.token_type", [1] * len(tokens))]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"))
    tok.decoder = decoders.ByteLevel()
    added = [AddedToken(t, special=ty == CONTROL, normalized=False)
             for t, ty in zip(tokens, types) if ty in (CONTROL, USER_DEFINED)]
    tok.add_tokens(added)
    tok.save(str(out / "tokenizer.json"))

    def token(key):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(i)] if i is not None and int(i) < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
              "bos_token": token("bos"), "eos_token": token("eos"), "pad_token": token("padding"),
              "unk_token": token("unknown"), "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
              "clean_up_tokenization_spaces": False,
              "chat_template": meta.get("tokenizer.chat_template")}
    (out / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None},
                                                          indent=1))


def convert(path, out, *, dequantize: bool = False) -> Path:
    """Write the GGUF at ``path`` as an mlx-lm folder ``out``; ``dequantize``: fp32 weights."""
    meta = inspect(path)
    arch = meta["general.architecture"]
    config = model_config(meta)
    weights = mx.load(str(path))
    has_output = "output.weight" in weights
    config["tie_word_embeddings"] = not has_output
    tensors, quant = convert_weights(weights, config, arch, dequantize)
    if quant:
        config["quantization"] = {"group_size": GROUP, "bits": 4, **quant}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), tensors, metadata={"format": "mlx"})
    write_tokenizer(meta, out, config["max_position_embeddings"])
    (out / "config.json").write_text(json.dumps(config, indent=1))
    log.info("gguf_converted", source=str(path), out=str(out), arch=arch, dequantized=dequantize,
             quantized_modules=len(quant or {}))
    return out


def cache_root() -> Path:
    base = os.environ.get("SPECBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", str(Path.home() / ".cache")), "specbatch")
    return Path(base) / "gguf"


def cached_folder(path, *, dequantize: bool, expect_sha256: str | None = None) -> Path:
    """The converted folder of ``path``, converting once; keyed by the file's sha256."""
    digest = sha256(path)
    if expect_sha256 is not None and digest != expect_sha256:
        raise GGUFError(f"{path}: sha256 {digest} does not match the expected {expect_sha256}")
    folder = cache_root() / f"{digest[:20]}-{'fp32' if dequantize else 'native'}"
    if (folder / "config.json").exists():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    convert(path, tmp, dequantize=dequantize)
    try:
        tmp.rename(folder)
    except OSError:  # another process finished first: use theirs
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return folder
