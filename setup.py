"""Builds the gpumem Python package with the system's CMake (pyproject.toml holds the
metadata): `pip install . --no-build-isolation`, `pip wheel . --no-build-isolation`.

build_py configures and builds the CMake targets gpumem (libgpumem.so) and gpumem_torch
(libgpumem_torch.so, the PyTorch plug-in with the C API) in GPUMEM_BUILD_DIR (default
build-pip/ in the source tree, kept between builds so a rebuild is incremental), copies both
libraries into the package, where gpumem.load() looks first, and puts gpumem-enable.pth
beside the package (GPUMEM_ENABLE=1 then turns gpumem on when torch is imported).

Environment: GPUMEM_BUILD_DIR, GPUMEM_CMAKE_ARGS (extra -D options, space-separated, e.g.
"-DGPUMEM_TORCH_DIR=/path/to/torch"), CMAKE_BUILD_PARALLEL_LEVEL (jobs, default all cores).
The wheel is tagged for this platform and Python (it holds native libraries).
"""

import os
import shlex
import shutil
import subprocess

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = os.path.dirname(os.path.abspath(__file__))
LIBRARIES = {"gpumem": "libgpumem.so", "gpumem_torch": "libgpumem_torch.so"}
PTH = "gpumem-enable.pth"


def _run(cmd):
    print("gpumem setup:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.check_call(cmd, cwd=ROOT)


def build_libraries():
    """Configures and builds the libraries; returns {file name: path}."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("gpumem: building the Python package needs CMake (>= 3.20) and a "
                           "C++20 compiler on PATH; the CUDA toolkit is optional")
    build = os.environ.get("GPUMEM_BUILD_DIR") or os.path.join(ROOT, "build-pip")
    configure = [cmake, "-S", ROOT, "-B", build, "-DCMAKE_BUILD_TYPE=Release",
                 "-DGPUMEM_BUILD_TESTS=OFF", "-DGPUMEM_BUILD_BENCH=OFF"]
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")) and shutil.which("ninja"):
        configure += ["-G", "Ninja"]
    configure += shlex.split(os.environ.get("GPUMEM_CMAKE_ARGS", ""))
    _run(configure)
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
    _run([cmake, "--build", build, "-j", jobs, "--target"] + list(LIBRARIES))
    found = {}
    for name in LIBRARIES.values():
        for folder, _, files in os.walk(build):
            if name in files and "CMakeFiles" not in folder:
                found[name] = os.path.join(folder, name)
                break
        else:
            raise RuntimeError("gpumem: %s was not built in %s" % (name, build))
    return found


class BuildWithLibraries(build_py):
    """build_py, plus the native libraries in the package and the .pth file beside it."""

    def run(self):
        super().run()
        package = os.path.join(self.build_lib, "gpumem")
        os.makedirs(package, exist_ok=True)
        for name, path in build_libraries().items():
            self.copy_file(path, os.path.join(package, name))
        self.copy_file(os.path.join(ROOT, "python", PTH), os.path.join(self.build_lib, PTH))


class NativeDistribution(Distribution):
    """Holds native libraries: the wheel is platform-specific and goes to platlib."""

    def has_ext_modules(self):
        return True


# setuptools' own build folder goes inside the CMake one: build/ may be a CMake build tree.
_BUILD_BASE = os.path.join(os.environ.get("GPUMEM_BUILD_DIR") or os.path.join(ROOT, "build-pip"),
                           "setuptools")

setup(cmdclass={"build_py": BuildWithLibraries}, distclass=NativeDistribution,
      options={"build": {"build_base": _BUILD_BASE}})
