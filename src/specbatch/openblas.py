"""Finding OpenBLAS for Linux CPU builds of MLX, and loading it in-process where that works.

The ``mlx-cpu`` wheel bundles a reference BLAS: every matmul is ~10x slower and its
cost grows linearly with batch rows, which kills the memory-bound regime that makes
speculative decoding pay. ``cmeel-openblas`` ships a fast OpenBLAS. Preloading it
(``LD_PRELOAD``, see :mod:`specbatch.blas`) makes MLX's BLAS calls resolve there; a plain
``python`` that imports specbatch gets :func:`preload_in_process` instead, which works
where the system has ``libgfortran.so.5``; where it cannot, :func:`warn_if_slow` logs
one warning naming the fix when the first model loads.

Opt out with ``SPECBATCH_NO_OPENBLAS=1``. No effect on macOS (Metal) or CUDA builds.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import importlib.metadata
import os
import sys
import sysconfig
from pathlib import Path

_MARK = "SPECBATCH_BLAS_REEXEC"
_OPT_OUT = "SPECBATCH_NO_OPENBLAS"


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


def openblas_path() -> Path | None:
    hits = sorted(glob.glob(str(_site() / "cmeel.prefix" / "lib" / "libopenblas.so.0")))
    return Path(hits[0]) if hits else None


def _gfortran_shim() -> Path | None:
    """cmeel's OpenBLAS needs libgfortran.so.5; without the system one, link numpy's copy."""
    if ctypes.util.find_library("gfortran"):
        return None
    libs = _site() / "numpy.libs"
    found = {
        "libgfortran.so.5": sorted(libs.glob("libgfortran-*.so.5*")),
        "libquadmath": sorted(libs.glob("libquadmath-*.so*")),
    }
    if not all(found.values()):
        return None
    shim = Path(sys.prefix) / "lib" / "specbatch-blas"
    shim.mkdir(parents=True, exist_ok=True)
    for link, target in [("libgfortran.so.5", found["libgfortran.so.5"][0]),
                         (found["libquadmath"][0].name, found["libquadmath"][0])]:
        path = shim / link
        if not path.exists():
            path.symlink_to(target)
    return shim


def preload_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment a child process needs for OpenBLAS (unchanged where not wanted)."""
    env = dict(os.environ if env is None else env)
    lib = openblas_path() if wanted(env) else None
    if lib is None:
        return env
    shim = _gfortran_shim()
    if shim is not None:
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in [str(shim), env.get("LD_LIBRARY_PATH", "")] if p)
    preload = env.get("LD_PRELOAD", "")
    if str(lib) not in preload.split():
        env["LD_PRELOAD"] = " ".join(p for p in [str(lib), preload] if p)
    env[_MARK] = "1"
    return env


_state = {"in_process": False, "warned": False}


def preload_in_process() -> bool:
    """Load OpenBLAS into this process before MLX, so MLX's BLAS calls bind to it.

    Only works before ``mlx`` is imported, and only where the dynamic linker finds
    OpenBLAS's ``libgfortran.so.5`` on its own (LD_LIBRARY_PATH cannot change in-process)."""
    if os.environ.get(_MARK) == "1" or "mlx.core" in sys.modules or not wanted():
        return False
    lib = openblas_path()
    if lib is None:
        return False
    try:
        ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return False
    _state["in_process"] = True
    return True


def fix_hint() -> str:
    env = preload_env()
    line = " ".join(f"{k}={env[k]}" for k in ("LD_LIBRARY_PATH", "LD_PRELOAD") if k in env)
    return f"start Python as `python -m specbatch.blas your_script.py` (or `{line} python ...`)"


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
    if "libopenblas" in os.environ.get("LD_PRELOAD", ""):
        return "openblas (preloaded)"
    if _state["in_process"]:
        return "openblas (loaded in-process)"
    if sys.platform == "darwin":
        return "accelerate (Metal build)"
    return "bundled (reference BLAS; slow)" if wanted() or _has_dist("mlx-cpu") else "native"
