"""Shared fixtures: tiny random-weight fp32 models built once per session."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow,
                          HealthCheck.function_scoped_fixture], derandomize=True)
settings.register_profile("dev", deadline=None, suppress_health_check=[HealthCheck.too_slow,
                          HealthCheck.function_scoped_fixture])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    from specbatch.testing.tiny import build_tiny_model
    root = tmp_path_factory.mktemp("models")
    return {
        "llama": build_tiny_model(root / "llama", "llama", seed=0, tie=False),
        "qwen3": build_tiny_model(root / "qwen3", "qwen3", seed=1),
        "draft": build_tiny_model(root / "draft", "qwen2", seed=2, hidden=32, layers=1, heads=2, kv_heads=1,
                                  tie=False),
    }


@pytest.fixture(scope="session")
def tiny(model_dir):
    from specbatch.kernels.models import load
    return load(model_dir["llama"])


@pytest.fixture(scope="session")
def tiny_qwen(model_dir):
    from specbatch.kernels.models import load
    return load(model_dir["qwen3"])


@pytest.fixture(scope="session")
def tiny_draft(model_dir):
    from specbatch.kernels.models import load
    return load(model_dir["draft"])


@pytest.fixture(scope="module")
def fakes(tiny):
    """The fake kernel: a target, and drafters over it (an oracle copy, a skewed copy,
    prompt lookup)."""
    from specbatch.kernels.drafters.ngram import NGramSource
    from specbatch.kernels.models import LoadedModel
    from specbatch.testing.fake import FakeModel
    target = LoadedModel(FakeModel(), tiny.tokenizer, "fake-target", 4096)
    return target, [LoadedModel(FakeModel(skew=0.0), tiny.tokenizer, "fake-oracle", 4096),
                    LoadedModel(FakeModel(skew=3.0, salt=1), tiny.tokenizer, "fake-skewed", 4096),
                    NGramSource(512)]


@pytest.fixture(scope="module")
def mtp_head(tiny):
    """A randomly initialised MTP head over the tiny llama (fp32)."""
    import mlx.core as mx

    from specbatch.kernels.drafters.mtp import MTPHead, head_config
    mx.random.seed(3)
    head = MTPHead(head_config(tiny.model.args, intermediate_size=64))
    mx.eval(head.parameters())
    return head
