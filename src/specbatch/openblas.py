"""Finding a fast OpenBLAS the running CPU can execute, for Linux CPU builds of MLX.

The ``mlx-cpu`` wheel bundles a reference BLAS: every matmul is ~10x slower and its
cost grows linearly with batch rows, which kills the memory-bound regime that makes
speculative decoding pay. ``ngsolve-openblas`` ships a ``DYNAMIC_ARCH`` OpenBLAS (it picks
its kernels for the CPU at load time) that exports the standard cblas names, so MLX's BLAS
calls bind to it when it is loaded first.

Two safeguards keep a library off a CPU it cannot run on (a single-target build executes
AVX-512 on a CPU without it and dies with SIGILL): before any process preloads it,
:func:`probe` loads it and runs an ``sgemm`` in a child process and reads back the core it
chose; the verdict is cached per library and CPU. A library that fails the probe is never
loaded, and :func:`warn_if_slow` logs one line naming why.

Preloading (``LD_PRELOAD``, see :mod:`specbatch.blas`) works from process start; a plain
``python`` that imports specbatch gets :func:`preload_in_process`, which makes the library
find its ``libgfortran.so.5`` beside itself (numpy's copy, linked) where the system has none.

Opt out with ``SPECBATCH_NO_OPENBLAS=1``. No effect on macOS (Metal) or CUDA builds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

_MARK = "SPECBATCH_BLAS_REEXEC"
_OPT_OUT = "SPECBATCH_NO_OPENBLAS"
_CACHE_ENTRIES = 8

# The child loads the library alone (no numpy, no MLX) and multiplies through cblas: a
# kernel the CPU cannot execute kills it with SIGILL here, never in the caller.
_PROBE = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
lib.openblas_get_corename.restype = ctypes.c_char_p
lib.openblas_get_config.restype = ctypes.c_char_p
for m, n, k in ((1, 64, 64), (8, 256, 256), (33, 67, 129)):
    a = (ctypes.c_float * (m * k))(*([1.0] * (m * k)))
    b = (ctypes.c_float * (k * n))(*([0.5] * (k * n)))
    c = (ctypes.c_float * (m * n))()
    lib.cblas_sgemm(101, 111, 111, m, n, k, ctypes.c_float(1.0), a, k, b, n,
                    ctypes.c_float(0.0), c, n)
    assert abs(c[m * n - 1] - 0.5 * k) < 1e-3, (m, n, k, c[m * n - 1])
print(lib.openblas_get_corename().decode(), "|", lib.openblas_get_config().decode())
"""


def _site() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def _has_dist(name: str) -> bool:
    try:
        importlib.metadata.distribution(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def wanted(env: dict[str, str] | None = None) -> bool:
    """True where preloading applies: Linux, the CPU build of MLX, not opted out."""
    env = os.environ if env is None else env
    if not sys.platform.startswith("linux") or env.get(_OPT_OUT) == "1":
        return False
    return _has_dist("mlx-cpu") and not _has_dist("mlx-cuda")


def library_path() -> Path | None:
    """The DYNAMIC_ARCH OpenBLAS shipped by ``ngsolve-openblas``, if installed."""
    hits = sorted(glob.glob(str(_site() / "ngsolve_openblas" / "libopenblas*.so*")))
    return Path(hits[0]) if hits else None


def cpu_flags() -> set[str]:
    """The running CPU's feature flags (Linux ``/proc/cpuinfo``), empty where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _gfortran_beside(lib: Path) -> bool:
    """Make ``libgfortran.so.5`` loadable for ``lib``: the system's, or numpy's copy linked
    beside the library (its RPATH is ``$ORIGIN``). False where neither can be had."""
    if ctypes.util.find_library("gfortran") or (lib.parent / "libgfortran.so.5").exists():
        return True
    libs = _site() / "numpy.libs"
    fortran = sorted(libs.glob("libgfortran-*.so.5*"))
    quad = sorted(libs.glob("libquadmath-*.so*"))
    if not (fortran and quad):
        return False
    try:
        for link, target in [("libgfortran.so.5", fortran[0]), (quad[0].name, quad[0])]:
            if not (lib.parent / link).exists():
                (lib.parent / link).symlink_to(target)
    except OSError:  # a read-only site-packages: the library cannot be loaded
        return False
    return True


def _cache_file() -> Path:
    return Path(sys.prefix) / "lib" / "specbatch-blas" / "probe.json"


def _key(lib: Path) -> str:
    stat = lib.stat()
    text = f"{lib}|{stat.st_size}|{stat.st_mtime_ns}|{' '.join(sorted(cpu_flags()))}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def probe(lib: Path | None = None) -> dict:
    """Whether ``lib`` runs on this CPU: ``{"ok", "core", "config", "why"}``, cached per
    library and CPU. The test happens in a child process, so a crash stays there."""
    lib = library_path() if lib is None else lib
    if lib is None:
        return {"ok": False, "core": "", "config": "", "why": "ngsolve-openblas is not installed"}
    if not _gfortran_beside(lib):
        return {"ok": False, "core": "", "config": "", "why": "no libgfortran.so.5 for OpenBLAS"}
    cache, key = _cache_file(), _key(lib)
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", _MARK)}
    try:
        out = subprocess.run([sys.executable, "-S", "-c", _PROBE, str(lib)], env=env,
                             capture_output=True, text=True, timeout=60)
        code, text = out.returncode, out.stdout.strip()
        err = out.stderr.strip().splitlines()[-1:] or [""]
    except (OSError, subprocess.TimeoutExpired) as exc:
        code, text, err = -1, "", [str(exc)]
    core, _, config = text.partition(" | ")
    why = "" if code == 0 else f"probe exited {code} ({'SIGILL: ' if code == -4 else ''}{err[0]})"
    verdict = {"ok": code == 0, "core": core.strip(), "config": config.strip(), "why": why}
    # the newest few verdicts only: probes of other libraries (tests, upgrades) do not pile up
    kept = dict(list({**known, key: verdict}.items())[-_CACHE_ENTRIES:])
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(kept))
    except OSError:
        pass
    return verdict


def openblas_path() -> Path | None:
    """The library to load, only once it has passed :func:`probe` on this CPU."""
    lib = library_path()
    return lib if lib is not None and probe(lib)["ok"] else None


# OpenBLAS's idle workers spin ~2^28 cycles after each call, taking a core from the CPU
# kernels' pool for the first decode steps after every prefill (a step 65 -> 43 ms right
# after one; prefill unchanged, 4.8 s for 1,440 tokens either way). 4: they sleep at once.
THREAD_TIMEOUT = ("OPENBLAS_THREAD_TIMEOUT", "4")


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a child process needs for OpenBLAS (unchanged where not wanted)."""
    env = dict(os.environ if env is None else env)
    lib = openblas_path() if wanted(env) else None
    if lib is None:
        return env
    env.setdefault(*THREAD_TIMEOUT)
    preload = env.get("LD_PRELOAD", "")
    if str(lib) not in preload.split():
        env["LD_PRELOAD"] = " ".join(p for p in [str(lib), preload] if p)
    env[_MARK] = "1"
    return env


_state = {"in_process": False, "warned": False}


def preload_in_process() -> bool:
    """Load OpenBLAS into this process before MLX, so MLX's BLAS calls bind to it
    (only before ``mlx`` is imported)."""
    if os.environ.get(_MARK) == "1" or "mlx.core" in sys.modules or not wanted():
        return False
    lib = openblas_path()
    if lib is None:
        return False
    os.environ.setdefault(*THREAD_TIMEOUT)  # read once, when the library starts its threads
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    _state["in_process"] = True
    return True


def fix_hint() -> str:
    verdict = probe() if wanted() else {"ok": False, "why": "not a Linux CPU build of MLX"}
    if not verdict["ok"]:
        return f"no usable OpenBLAS: {verdict['why']}"
    return "start Python as `python -m specbatch.blas your_script.py` or import specbatch before mlx"


def warn_if_slow() -> None:
    """Once per process: say so when MLX runs on the bundled reference BLAS (~10x slower)."""
    if _state["warned"] or not wanted() or not active_blas().startswith("bundled"):
        return
    _state["warned"] = True
    import structlog
    structlog.get_logger(__name__).warning(
        "slow_blas", blas="bundled reference BLAS (about 10x slower on this CPU)", fix=fix_hint())


def active_blas() -> str:
    """Which BLAS this process uses, for start-up logs."""
    lib = library_path()
    if lib is not None and str(lib) in os.environ.get("LD_PRELOAD", ""):
        return "openblas (preloaded)"
    if _state["in_process"]:
        return "openblas (loaded in-process)"
    if sys.platform == "darwin":
        return "accelerate (Metal build)"
    return "bundled (reference BLAS; slow)" if wanted() or _has_dist("mlx-cpu") else "native"


def cores() -> int:
    """The CPUs this process may run on (its affinity, not the machine's count)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def limit_threads(n: int | None = None) -> int | None:
    """Cap the loaded OpenBLAS at ``n`` threads (default: ``OPENBLAS_NUM_THREADS`` if set,
    else the cores this process may use), so it never oversubscribes them; returns the
    count now in force, None where no OpenBLAS is loaded."""
    if n is None:
        env = os.environ.get("OPENBLAS_NUM_THREADS", "")
        n = int(env) if env.isdigit() and int(env) > 0 else cores()
    n = max(1, min(n, cores()))
    for path in loaded_libraries("openblas"):
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_set_num_threads(ctypes.c_int(n))
            return int(lib.openblas_get_num_threads())
        except (OSError, AttributeError):
            continue
    return None


def loaded_libraries(word: str) -> list[str]:
    """Paths of the loaded shared libraries whose name holds ``word``."""
    try:
        with open("/proc/self/maps") as maps:
            return sorted({line.split()[-1] for line in maps if word in line.lower() and "/" in line})
    except OSError:
        return []


def share_cores(env: dict[str, str] | None = None) -> tuple[int, int]:
    """Thread counts for a server's OpenBLAS and CPU kernels' pool. Both run from MLX's one
    CPU stream thread, one call at a time, and OpenBLAS's workers sleep between calls
    (``THREAD_TIMEOUT``), so each may use every core this process has: a decode step took
    43 ms with the kernels on 2 threads against 63 ms on 1 (quiet 2-core machine). A count
    the user set (``OPENBLAS_NUM_THREADS``, ``SPECBATCH_CPU_THREADS``) is kept, capped at the
    cores; numpy's own OpenBLAS (the serving path does no numpy matmuls) is held to one.
    Call before the kernels' pool starts (it reads ``SPECBATCH_CPU_THREADS`` once); returns
    ``(blas, kernels)``."""
    env = os.environ if env is None else env

    def given(name: str) -> int | None:
        value = env.get(name, "")
        return min(int(value), n) if value.isdigit() and int(value) > 0 else None

    n = cores()
    blas, kernels = given("OPENBLAS_NUM_THREADS") or n, given("SPECBATCH_CPU_THREADS") or n
    env["SPECBATCH_CPU_THREADS"] = str(kernels)
    limit_threads(blas)
    for path in loaded_libraries("scipy_openblas"):
        try:
            ctypes.CDLL(path).scipy_openblas_set_num_threads64_(ctypes.c_int(1))
        except (OSError, AttributeError):
            pass
    return blas, kernels
