"""Start Python with OpenBLAS preloaded on Linux CPU builds of MLX.

LD_PRELOAD only works at process start, so entry points call :func:`ensure_openblas`,
which re-executes the interpreter once; ``python -m specbatch.blas -m pytest ...`` runs
any command that way. Where to find OpenBLAS and why: :mod:`specbatch.openblas`.
"""

from __future__ import annotations

import os
import sys

from .openblas import _MARK, active_blas, openblas_path, preload_env, wanted

__all__ = ["active_blas", "ensure_openblas", "main", "preload_env"]


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
