"""Loading model folders, dtype, vocabulary checks, the BLAS preload."""

from __future__ import annotations

import subprocess
import sys

import mlx.core as mx
import pytest

from specbatch import blas
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


def test_openblas_preload_env():
    env = blas.preload_env({})
    if blas.wanted() and blas.openblas_path():
        assert "libopenblas" in env["LD_PRELOAD"]
        out = subprocess.run([sys.executable, "-c", "import mlx.core as mx; print(mx.ones(3).sum().item())"],
                             env=env, capture_output=True, text=True)
        assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr
    assert blas.preload_env({"SPECBATCH_NO_OPENBLAS": "1"}).get("LD_PRELOAD") is None or not blas.wanted()


def _load_in_plain_python(folder, env_extra):
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "SPECBATCH_BLAS_REEXEC")}
    code = (f"import specbatch; from specbatch.kernels.models import load; load({str(folder)!r}); load({str(folder)!r}); "
            "from specbatch.openblas import active_blas; import sys; print('blas:', active_blas(), file=sys.stderr)")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, **env_extra}).stderr


def test_plain_python_on_the_reference_blas_is_warned_once(model_dir):
    if not (blas.wanted() and blas.openblas_path()):
        pytest.skip("OpenBLAS preloading does not apply on this platform")
    err = _load_in_plain_python(model_dir["llama"], {})
    if "blas: openblas (loaded in-process)" in err:  # the system has libgfortran: nothing to warn
        assert "slow_blas" not in err
    else:
        assert err.count("slow_blas") == 1 and "python -m specbatch.blas" in err
    env = blas.preload_env({})
    preloaded = _load_in_plain_python(model_dir["llama"], env)
    assert "slow_blas" not in preloaded and "blas: openblas" in preloaded
    # found through the library path (as where the system has libgfortran): loaded in-process
    if "LD_LIBRARY_PATH" in env:
        found = _load_in_plain_python(model_dir["llama"], {"LD_LIBRARY_PATH": env["LD_LIBRARY_PATH"]})
        assert "blas: openblas (loaded in-process)" in found and "slow_blas" not in found
