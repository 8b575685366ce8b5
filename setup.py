"""Builds specbatch's CPU kernels (an MLX C++ extension) with the CMake config that the
MLX wheel ships. The build is optional: without a compiler, CMake or a Linux x86-64 CPU
build of MLX, specbatch installs without it and runs its pure-MLX fallback (one log line
at start-up names why)."""

import os
import platform
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

SOURCE = Path(__file__).parent / "src" / "specbatch" / "kernels" / "cpu" / "csrc"


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        target = Path(self.get_ext_fullpath(ext.name)).resolve()
        build = Path(self.build_temp).resolve() / "cpu_kernels"
        build.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(["cmake", "-S", str(SOURCE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                            f"-DPython_EXECUTABLE={sys.executable}",
                            f"-DCMAKE_LIBRARY_OUTPUT_DIRECTORY={target.parent}"], check=True)
            subprocess.run(["cmake", "--build", str(build), "-j", str(os.cpu_count() or 1)], check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            # the fallback runs instead; specbatch.kernels.cpu logs why at start-up
            print(f"specbatch: CPU kernels not built ({exc}); the pure-MLX fallback will run", file=sys.stderr)


def _extensions():
    if not (sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64")):
        return []
    if os.environ.get("SPECBATCH_BUILD_CPU_KERNELS") == "0":
        return []
    return [Extension("specbatch.kernels.cpu._ext", sources=[])]


setup(ext_modules=_extensions(), cmdclass={"build_ext": CMakeBuild})
