"""Tiny random-weight mlx-lm model folders with a real tokenizer, for tests and benchmarks.

Untied output heads (``tie=False``) keep random models from merely echoing their input
token, so greedy streams vary and exactness tests test something.
"""

from __future__ import annotations

import importlib
import json
import sysconfig
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}<|user|>\n{{ m['content'] }}\n"
    "{% elif m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}<|endoftext|>\n"
    "{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(out: Path, vocab: int = 512) -> None:
    """A byte-level BPE trained on a few standard-library modules (fast, deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = [(stdlib / n).read_text(encoding="utf-8") for n in ("textwrap.py", "bisect.py", "heapq.py")]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "model_max_length": 2048,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}))


def tiny_config(arch: str = "llama", *, vocab: int = 512, hidden: int = 64, layers: int = 2,
                heads: int = 4, kv_heads: int = 2, intermediate: int = 128,
                context: int = 2048, tie: bool = True) -> dict:
    base = dict(model_type=arch, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv_heads,
                intermediate_size=intermediate, rms_norm_eps=1e-5, rope_theta=10000.0,
                max_position_embeddings=context, tie_word_embeddings=tie)
    if arch == "qwen3":
        base["head_dim"] = hidden // heads
    elif arch not in ("llama", "qwen2"):
        raise ValueError(f"tiny models come in llama, qwen2 and qwen3, not {arch!r}")
    return base


def build_tiny_model(out: Path, arch: str = "llama", seed: int = 0, half_values: bool = False,
                     quantized: bool = False, **shape) -> Path:
    """Write a random-weight mlx-lm model folder (config, safetensors, tokenizer) to ``out``;
    ``half_values``: every float32 weight rounded to a float16 value, as a dequantized GGUF's are;
    ``quantized``: float16 with its linears as affine 4-bit blocks of 32 and its embedding as 8-bit
    ones (the embedded target's GGUF layout: Q4_1 linears, a Q8_0 tied embedding)."""
    config = tiny_config(arch, **shape)
    module = importlib.import_module(f"mlx_lm.models.{arch}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(config))
    if half_values:
        model.update(tree_map(lambda p: p.astype(mx.float16).astype(mx.float32), model.parameters()))
    if quantized:
        model.set_dtype(mx.float16)
        eight = {"group_size": 32, "bits": 8}
        nn.quantize(model, group_size=32, bits=4,
                    class_predicate=lambda _, m: isinstance(m, nn.Linear) or (isinstance(m, nn.Embedding) and dict(eight)))
        config["quantization"] = {"group_size": 32, "bits": 4, "model.embed_tokens": eight}
    mx.eval(model.parameters())
    out = Path(out)
    write_tokenizer(out, vocab=config["vocab_size"])
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out
