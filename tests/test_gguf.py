"""GGUF loading: files the tests write themselves (llama.cpp's layout, each tensor type)
give the logits of their source weights; unsupported files fail with a clear message."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

gguf = pytest.importorskip("gguf")

from specbatch.kernels import cpu  # noqa: E402
from specbatch.kernels.cpu import blocks as quantized  # noqa: E402
from specbatch.kernels import gguf as loader  # noqa: E402
from specbatch.kernels.models import load  # noqa: E402

Q = gguf.GGMLQuantizationType
# relative logit error allowed per tensor type (quantization noise on random weights)
TOLERANCE = {"F32": 1e-5, "F16": 5e-3, "BF16": 3e-2, "Q8_0": 2e-2, "Q4_0": 0.25, "Q4_1": 0.2}
LAYER = {v: k for k, v in loader.LAYER_NAMES.items()}
TOP = {v: k for k, v in loader.TOP_NAMES.items()}


def gguf_name(mlx_name: str) -> str:
    stem, _, suffix = mlx_name.rpartition(".")
    if stem.startswith("model.layers."):
        _, _, n, part = stem.split(".", 3)
        return f"blk.{n}.{LAYER[part]}.{suffix}"
    return f"{TOP[stem]}.{suffix}"


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf row order for Q/K (interleaved RoPE halves)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(folder, path, tensor_type: str = "F32", arch: str = "llama", tokenizer_model: str = "gpt2"):
    """Write the mlx-lm folder's model as llama.cpp would, with matrices in ``tensor_type``."""
    config = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre("gpt2")
    vocab = sorted(tok["model"]["vocab"].items(), key=lambda kv: kv[1])
    specials = {t["content"] for t in tok["added_tokens"] if t["special"]}
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_types([3 if t in specials else 1 for t, _ in vocab])
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]])
    writer.add_eos_token_id(0)
    writer.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    weights = dict(mx.load(str(folder / "model.safetensors")))
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, value in sorted(weights.items()):
        w = np.array(value.astype(mx.float32))
        proj = name.split(".")[-2]
        if proj in heads:
            w = permute(w, heads[proj])
        if w.ndim == 1 or tensor_type == "F32":
            writer.add_tensor(gguf_name(name), w.astype(np.float32))
        elif tensor_type == "F16":
            writer.add_tensor(gguf_name(name), w.astype(np.float16))
        else:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, Q[tensor_type]), raw_dtype=Q[tensor_type])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def source(model_dir):
    return model_dir["llama"]


def logits(model, ids):
    return np.array(model.model(mx.array([ids]))[0].astype(mx.float32))


@pytest.mark.parametrize("tensor_type", list(TOLERANCE))
def test_each_tensor_type_gives_the_source_logits(source, tmp_path, monkeypatch, tensor_type):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    path = write_gguf(source, tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    ref, got = load(source), load(path)
    ids = ref.tokenizer.encode("def f(x):\n    return x + 1\n")
    assert got.tokenizer.encode("def f(x):\n    return x + 1\n") == ids
    a, b = logits(ref, ids), logits(got, ids)
    error = np.abs(a - b).max() / np.abs(a).max()
    assert error <= TOLERANCE[tensor_type], (tensor_type, error)
    if tensor_type == "F32":  # Q/K rows un-permuted exactly: the same greedy choice everywhere
        assert (a.argmax(-1) == b.argmax(-1)).all()
    # CPU: float32 activations; a linear whose values are all float16 values (F16 and the
    # quantized types) is stored half (exact: kernels.cpu.half), the rest float32; quantized
    # blocks the kernels read hold their float32 values (kernels.cpu.blocks), read as blocks
    dtypes = {k: v.dtype for k, v in tree_flatten(got.model.parameters())}
    assert all(d == mx.float32 for k, d in dtypes.items() if "norm" in k)
    assert set(dtypes.values()) <= {mx.float32, mx.float16}
    down = got.model.model.layers[0].mlp.down_proj
    if tensor_type in ("Q8_0", "Q4_0", "Q4_1") and quantized.reads_here(cpu.extension()):
        assert dtypes["model.layers.0.mlp.down_proj.weight"] == mx.float32 and quantized.reads_blocks(down)
        assert quantized.reads_blocks(got.model.model.embed_tokens)  # the tied head too
    elif tensor_type in ("F16", "Q8_0", "Q4_0", "Q4_1") and cpu.extension() is not None:
        assert dtypes["model.layers.0.mlp.down_proj.weight"] == mx.float16
    assert got.model.model(mx.array([ids])).dtype == mx.float32


def test_quantized_weights_stay_quantized_when_asked(source, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    path = write_gguf(source, tmp_path / "tiny-q8.gguf", "Q8_0")
    model = load(path, dtype="quantized").model
    assert model.model.layers[0].self_attn.q_proj.__class__.__name__ == "QuantizedLinear"
    assert model.model.layers[0].self_attn.q_proj.bits == 8


def test_convert_writes_a_folder_mlx_lm_opens(source, tmp_path):
    from mlx_lm import load as mlx_load
    out = loader.convert(write_gguf(source, tmp_path / "t.gguf", "Q4_1"), tmp_path / "folder")
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["quantization"]["group_size"] == 32
    assert "chat_template" in json.loads((out / "tokenizer_config.json").read_text())
    model, tokenizer = mlx_load(str(out))
    assert tokenizer.encode("x = 1") == load(source).tokenizer.encode("x = 1")
    assert model(mx.array([[1, 2, 3]])).shape == (1, 3, 512)


def test_conversion_is_cached_by_hash(source, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    path = write_gguf(source, tmp_path / "t.gguf")
    first = loader.cached_folder(path, dequantize=False)
    monkeypatch.setattr(loader, "convert", lambda *a, **k: pytest.fail("converted twice"))
    assert loader.cached_folder(path, dequantize=False) == first
    with pytest.raises(loader.GGUFError, match="sha256"):
        loader.cached_folder(path, dequantize=False, expect_sha256="0" * 64)


def test_unsupported_architecture_and_types_are_refused(tmp_path):
    arch = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    arch.add_tokenizer_model("gpt2")
    arch.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    for w in (arch,):
        w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(loader.GGUFError, match="architecture 'phi3' is not supported"):
        loader.inspect(tmp_path / "phi.gguf")
    kq = gguf.GGUFWriter(str(tmp_path / "k.gguf"), "llama")
    kq.add_tokenizer_model("gpt2")
    size = gguf.GGML_QUANT_SIZES[Q.Q4_K][1]
    kq.add_tensor("token_embd.weight", np.zeros((4, size), np.uint8), raw_dtype=Q.Q4_K)
    kq.write_header_to_file(), kq.write_kv_data_to_file(), kq.write_tensors_to_file(), kq.close()
    with pytest.raises(loader.GGUFError, match="tensor types Q4_K are not supported"):
        loader.inspect(tmp_path / "k.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 20)
    with pytest.raises(loader.GGUFError, match="not a readable GGUF"):
        loader.inspect(tmp_path / "junk.gguf")


def test_cli_names_what_is_unsupported_without_a_traceback(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    run = subprocess.run([sys.executable, "-m", "specbatch.serving.cli", "generate", "--prompt", "x",
                          "--model", str(tmp_path / "phi.gguf")], capture_output=True, text=True,
                         env={"SPECBATCH_NO_OPENBLAS": "1", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert run.returncode == 2
    assert "architecture 'phi3' is not supported" in run.stderr and "Traceback" not in run.stderr
