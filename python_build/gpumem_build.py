"""gpumem's PEP 517 build backend: `pip install .` and `pip wheel .` with nothing but the
standard library, the system's CMake and a C++20 compiler, so a build works offline with
pip's build isolation (pyproject.toml requires nothing).

The hooks build the native libraries with CMake (gpumem_build_native.py) and write the
wheel or the sdist themselves (gpumem_build_archive.py); the metadata is pyproject.toml's
[project] table (gpumem_build_metadata.py).

Environment: GPUMEM_BUILD_DIR (the CMake build folder, default build-pip/ in the source
tree, kept between builds so a rebuild is incremental; an existing build tree, such as a
developer's build/, is reused with its own settings), GPUMEM_CMAKE_ARGS (extra -D options,
space-separated, e.g. "-DGPUMEM_TORCH_DIR=/path/to/torch"), CMAKE_BUILD_PARALLEL_LEVEL
(jobs, default all cores).
"""

import os

import gpumem_build_archive as archive
import gpumem_build_metadata as metadata
import gpumem_build_native as native

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "gpumem"
PACKAGE_DIR = os.path.join(ROOT, "python", PACKAGE)
PTH = "gpumem-enable.pth"
# What an sdist holds: everything a wheel build reads (CMake configures tools/ and
# examples/ too, tests/ and bench/ only when asked for).
SDIST_PARTS = ("CMakeLists.txt", "README.md", "pyproject.toml", "cmake", "include", "src",
               "tools", "examples", "python", "python_build")


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def get_requires_for_build_editable(config_settings=None):
    return []


def _meta():
    return metadata.read(ROOT)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    meta = _meta()
    return archive.write_dist_info(metadata_directory, meta, archive.wheel_tag())


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    return prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def _package_files():
    """{path in the wheel: path here} for the Python package's sources."""
    files = {}
    for folder, dirs, names in os.walk(PACKAGE_DIR):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(names):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                files[os.path.relpath(path, os.path.dirname(PACKAGE_DIR)).replace(os.sep, "/")] = path
    return files


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    files = _package_files()
    for name, path in native.build(ROOT).items():
        files[PACKAGE + "/" + name] = path
    files[PTH] = os.path.join(ROOT, "python", PTH)
    return archive.write_wheel(wheel_directory, _meta(), files)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    """The package stays in the source tree (python/ on sys.path through a .pth); the
    libraries are copied into python/gpumem/, where gpumem.load() looks first, so
    run this again after a rebuild of the libraries."""
    for name, path in native.build(ROOT).items():
        archive.copy_file(path, os.path.join(PACKAGE_DIR, name))
    files = {PTH: os.path.join(ROOT, "python", PTH)}
    texts = {"__editable__.gpumem.pth": os.path.join(ROOT, "python") + "\n"}
    return archive.write_wheel(wheel_directory, _meta(), files, texts)


def build_sdist(sdist_directory, config_settings=None):
    return archive.write_sdist(sdist_directory, _meta(), ROOT, SDIST_PARTS)
