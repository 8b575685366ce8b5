"""Start Python with OpenBLAS preloaded on Linux CPU builds of MLX.

LD_PRELOAD only works at process start, so entry points call :func:`ensure_openblas`,
which re-executes the interpreter once; ``python -m specbatch.blas -m pytest ...`` runs
any command that way; :func:`blas_core` names the kernels the loaded library runs. Where to
find OpenBLAS and why: :mod:`specbatch.openblas`.
"""

from __future__ import annotations

import ctypes
import os
import sys

from .openblas import _MARK, active_blas, loaded_libraries, openblas_path, preload_env, wanted

__all__ = ["active_blas", "blas_core", "ensure_openblas", "main", "preload_env"]


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


def blas_core() -> str:
    """The kernels the loaded OpenBLAS runs (its core name; "forced" where the environment's
    ``OPENBLAS_CORETYPE`` chose them: a platform may pin AVX2 kernels on an AVX-512 CPU,
    which halves prefill's sgemm), or "" where none is loaded (numpy's own renamed copy,
    ``libscipy_openblas``, is not the one MLX calls)."""
    for path in loaded_libraries("libopenblas"):
        try:
            lib = ctypes.CDLL(path)
            lib.openblas_get_corename.restype = ctypes.c_char_p
            name = lib.openblas_get_corename().decode()
        except (OSError, AttributeError):
            continue
        forced = os.environ.get("OPENBLAS_CORETYPE", "")
        return f"{name} (forced by OPENBLAS_CORETYPE={forced})" if forced else name
    return ""


def main() -> None:
    """``python -m specbatch.blas -m pytest ...``: run python with OpenBLAS preloaded."""
    args = sys.argv[1:]
    env = preload_env()
    os.execve(sys.executable, [sys.executable, *args], env)


if __name__ == "__main__":
    main()
