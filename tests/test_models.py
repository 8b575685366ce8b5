"""Loading model folders, dtype, vocabulary checks."""

from __future__ import annotations

import mlx.core as mx
import pytest

from specbatch.kernels.models import ModelNotFound, check_pair, load


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_folders_load_in_fp32(model_dir, arch):
    loaded = load(model_dir[arch])
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == mx.float32
    assert loaded.vocab_size == 512 and loaded.context_length == 2048


def test_dtype_option(model_dir):
    loaded = load(model_dir["llama"], dtype="float16")
    assert loaded.model.layers[0].self_attn.q_proj.weight.dtype == mx.float16
    with pytest.raises(ValueError, match="dtype"):
        load(model_dir["llama"], dtype="int3")


def test_unknown_model_is_a_clear_error(tmp_path):
    with pytest.raises(ModelNotFound, match="not found"):
        load(tmp_path / "nope")


def test_vocabularies_must_match(tmp_path, tiny):
    from specbatch.testing.tiny import build_tiny_model
    other = load(build_tiny_model(tmp_path / "v", vocab=384))
    with pytest.raises(ValueError, match="vocabulary"):
        check_pair(tiny, other)
