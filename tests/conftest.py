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
