"""The BLAS choice: only a library the running CPU can execute is ever loaded."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from specbatch import blas, openblas

pytestmark = pytest.mark.skipif(not openblas.wanted(), reason="OpenBLAS applies to Linux CPU builds of MLX")

# What each x86-64 OpenBLAS core's kernels execute (DYNAMIC_ARCH names, lower case).
_NEEDS = {
    "sapphirerapids": {"avx512f", "avx512bw", "avx512_bf16"}, "cooperlake": {"avx512f", "avx512_bf16"},
    "skylakex": {"avx512f", "avx512bw"}, "zen": {"avx2", "fma"}, "haswell": {"avx2", "fma"},
    "sandybridge": {"avx"}, "nehalem": {"sse4_2"}, "core2": {"ssse3"}, "prescott": {"sse3"},
    "excavator": {"avx2"}, "steamroller": {"avx"}, "piledriver": {"avx"}, "bulldozer": {"avx"},
    "barcelona": set(), "katmai": set(), "atom": set(), "penryn": set(), "dunnington": set(),
}
_FLAG_ALIASES = {"sse3": "pni"}  # /proc/cpuinfo calls SSE3 "pni"


def test_the_chosen_library_runs_kernels_this_cpu_has():
    verdict = openblas.probe()
    assert verdict["ok"], verdict["why"]
    assert "DYNAMIC_ARCH" in verdict["config"], verdict["config"]  # picks its kernels per CPU
    core = verdict["core"].lower()
    assert core in _NEEDS, f"unknown OpenBLAS core {core!r}"
    needs = {_FLAG_ALIASES.get(f, f) for f in _NEEDS[core]}
    assert needs <= openblas.cpu_flags(), f"{core} needs {needs - openblas.cpu_flags()}"


def test_a_library_that_does_not_load_fails_the_probe(tmp_path):
    fake = tmp_path / "libopenblas.so.0"
    fake.write_bytes(b"not an ELF file")
    (tmp_path / "libgfortran.so.5").write_bytes(b"")  # so the probe gets as far as loading
    verdict = openblas.probe(fake)
    assert not verdict["ok"] and "probe exited" in verdict["why"]


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_library_with_illegal_instructions_is_caught_in_the_child(tmp_path):
    # stands for a single-target build on a CPU without its ISA: its sgemm dies with SIGILL
    src = tmp_path / "bad.c"
    src.write_text("void cblas_sgemm(void) { __builtin_trap(); }\n"
                   "const char *openblas_get_corename(void) { return \"SkylakeX\"; }\n"
                   "const char *openblas_get_config(void) { return \"fake\"; }\n")
    lib = tmp_path / "libopenblas.so.0"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    (tmp_path / "libgfortran.so.5").write_bytes(b"")
    verdict = openblas.probe(lib)
    assert not verdict["ok"] and "SIGILL" in verdict["why"], verdict
    assert openblas.probe(lib) == verdict  # cached per library and CPU


def test_preload_env_names_the_library_and_the_opt_out_clears_it():
    env = blas.preload_env({})
    assert str(openblas.library_path()) in env["LD_PRELOAD"]
    out = subprocess.run([sys.executable, "-c", "import mlx.core as mx; print(mx.ones(3).sum().item())"],
                         env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "3.0", out.stderr
    assert "LD_PRELOAD" not in blas.preload_env({"SPECBATCH_NO_OPENBLAS": "1"})


def _plain_python(code, env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "SPECBATCH_BLAS_REEXEC")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**env, **env_extra})


def test_plain_python_importing_specbatch_gets_openblas_in_process(model_dir):
    code = (f"import specbatch; from specbatch.kernels.models import load; load({str(model_dir['llama'])!r}); "
            "from specbatch.openblas import active_blas; import sys; print('blas:', active_blas(), file=sys.stderr)")
    out = _plain_python(code, {})
    assert out.returncode == 0, out.stderr
    assert "blas: openblas (loaded in-process)" in out.stderr and "slow_blas" not in out.stderr
    preloaded = _plain_python(code, blas.preload_env({}))
    assert "blas: openblas (preloaded)" in preloaded.stderr and "slow_blas" not in preloaded.stderr


def test_mlx_imported_first_is_warned_once(model_dir):
    code = (f"import mlx.core; import specbatch; from specbatch.kernels.models import load; "
            f"load({str(model_dir['llama'])!r}); load({str(model_dir['llama'])!r})")
    err = _plain_python(code, {}).stderr
    assert err.count("slow_blas") == 1 and "import specbatch before mlx" in err


def test_limit_threads_caps_the_loaded_openblas_at_the_cores():
    import mlx.core as mx

    from specbatch.openblas import cores, limit_threads
    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))  # the BLAS is loaded by now
    got = limit_threads(10_000)
    if got is None:
        pytest.skip("no OpenBLAS in this process")
    assert got == cores()
    assert limit_threads(1) == 1
    limit_threads()


def test_blas_core_names_the_loaded_kernels_and_says_when_the_environment_forced_them(monkeypatch):
    import mlx.core as mx
    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))
    if not openblas.loaded_libraries("libopenblas"):
        pytest.skip("no OpenBLAS for MLX in this process (imported after mlx: numpy's copy only)")
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    core = blas.blas_core()
    assert core.split()[0].lower() in _NEEDS and core.endswith("(forced by OPENBLAS_CORETYPE=Haswell)")
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    assert blas.blas_core() == core.split()[0]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16, 64])
def test_share_cores_gives_each_pool_the_cores_and_never_more(monkeypatch, n):
    from specbatch import openblas
    capped = []
    monkeypatch.setattr(openblas, "cores", lambda: n)
    monkeypatch.setattr(openblas, "limit_threads", capped.append)
    env = {}
    blas, kernels = openblas.share_cores(env)
    assert blas == kernels == n  # one call at a time from MLX's stream thread; idle BLAS workers sleep
    assert capped == [blas] and env["SPECBATCH_CPU_THREADS"] == str(kernels)


@pytest.mark.parametrize("env, want", [
    ({"SPECBATCH_CPU_THREADS": "1"}, (2, 1)), ({"OPENBLAS_NUM_THREADS": "1"}, (1, 2)),
    ({"SPECBATCH_CPU_THREADS": "99"}, (2, 2)), ({"OPENBLAS_NUM_THREADS": "x"}, (2, 2)),
    ({"OPENBLAS_NUM_THREADS": "1", "SPECBATCH_CPU_THREADS": "1"}, (1, 1)),  # both given: the user's
])
def test_share_cores_keeps_what_the_user_set(monkeypatch, env, want):
    from specbatch import openblas
    monkeypatch.setattr(openblas, "cores", lambda: 2)
    monkeypatch.setattr(openblas, "limit_threads", lambda n: n)
    assert openblas.share_cores(dict(env)) == want


def test_share_cores_sets_the_running_pools():
    code = ("import os; os.environ.pop('SPECBATCH_CPU_THREADS', None); os.environ.pop('OPENBLAS_NUM_THREADS', None)\n"
            "import mlx.core as mx; from specbatch.openblas import share_cores, limit_threads\n"
            "mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))\n"
            "blas, kernels = share_cores()\n"
            "from specbatch.kernels import cpu\n"
            "ext = cpu.extension()\n"
            "print(blas, kernels, ext.threads() if ext else kernels, limit_threads(blas))")
    out = subprocess.run([sys.executable, "-m", "specbatch.blas", "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    blas, kernels, pool, loaded = out.stdout.split()
    assert pool == kernels and loaded in (blas, "None")


def test_openblas_workers_sleep_between_calls_unless_the_user_says_otherwise():
    # spinning idle workers took a core from the CPU kernels after every prefill
    import subprocess
    import sys

    from specbatch import openblas
    if openblas.openblas_path() is None:
        pytest.skip("no usable OpenBLAS here")
    code = "import os, specbatch; print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'))"
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_THREAD_TIMEOUT", "LD_PRELOAD", openblas._MARK)}
    ours = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    theirs = subprocess.run([sys.executable, "-c", code], env={**env, "OPENBLAS_THREAD_TIMEOUT": "20"},
                            capture_output=True, text=True, timeout=120)
    assert ours.stdout.strip() == "4" and theirs.stdout.strip() == "20"
