"""Start Python with OpenBLAS preloaded on Linux CPU builds of MLX.

The ``mlx-cpu`` wheel bundles a reference BLAS: every matmul is ~10x slower and its
cost grows linearly with batch rows, which kills the memory-bound regime that makes
speculative decoding pay. ``cmeel-openblas`` ships a fast OpenBLAS; preloading it makes
MLX's BLAS calls resolve there. LD_PRELOAD only works at process start, so entry
points call :func:`ensure_openblas`, which re-executes the interpreter once.

Opt out with ``SPECBATCH_NO_OPENBLAS=1``. No effect on macOS (Metal) or CUDA builds.
"""

from __future__ import annotations

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


def active_blas() -> str:
    """Which BLAS this process uses, for start-up logs."""
    if "libopenblas" in os.environ.get("LD_PRELOAD", ""):
        return "openblas (preloaded)"
    if sys.platform == "darwin":
        return "accelerate (Metal build)"
    return "bundled (reference BLAS; slow)" if wanted() or _has_dist("mlx-cpu") else "native"


def ensure_openblas(argv: list[str] | None = None) -> None:
    """Re-exec this interpreter once with OpenBLAS preloaded, when it applies."""
    if os.environ.get(_MARK) == "1" or not wanted() or openblas_path() is None:
        return
    env = preload_env()
    # orig_argv keeps "-m specbatch.cli"; sys.argv[0] would be the module's file, run
    # as a script outside its package
    argv = list(sys.orig_argv[1:] if argv is None else argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *argv], env)


def main() -> None:
    """``python -m specbatch.blas -m pytest ...``: run python with OpenBLAS preloaded."""
    args = sys.argv[1:]
    env = preload_env()
    os.execve(sys.executable, [sys.executable, *args], env)


if __name__ == "__main__":
    main()
