"""The native libraries of the Python package, built with the system's CMake: libgpumem.so
(the C API for C and C++ programs), libgpumem_torch.so (the PyTorch plug-in with the C API)
and, where CMake defines its target (a torch was found at configure time),
libgpumem_torch_native.so with libgpumem_torch_native.torch, the torch version it was built
for, written beside it by the build."""

import json
import os
import shlex
import shutil
import subprocess
import sys

# CMake target: the files it puts in the package.
LIBRARIES = {"gpumem": ("libgpumem.so",), "gpumem_torch": ("libgpumem_torch.so",)}
NATIVE = {"gpumem_torch_native": ("libgpumem_torch_native.so", "libgpumem_torch_native.torch")}


def _run(cmd, cwd, env=None):
    print("gpumem build:", " ".join(shlex.quote(c) for c in cmd), flush=True)
    subprocess.check_call(cmd, cwd=cwd, env=env)


def build_folder(root):
    return os.path.abspath(os.environ.get("GPUMEM_BUILD_DIR") or os.path.join(root, "build-pip"))


def configure_environment(environ):
    """The environment CMake runs in. cmake/gpumem_torch.cmake asks Python for the installed
    torch, which the libraries are built against; under pip's build isolation PYTHONPATH
    names pip's build-env site folder (its sitecustomize.py hides site-packages) and
    PYTHONNOUSERSITE is set, which would hide that torch: for CMake, both are dropped."""
    env = dict(environ)
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    isolated = [p for p in entries
                if os.path.basename(os.path.dirname(os.path.abspath(p))).startswith("pip-build-env-")]
    if isolated:
        kept = [p for p in entries if p not in isolated]
        if kept:
            env["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            env.pop("PYTHONPATH")
        env.pop("PYTHONNOUSERSITE", None)
    return env


def configure(cmake, root, build):
    """A new build tree gets the package's settings (Release, no tests, no benchmarks, the
    Python that runs this build as the one asked about torch); an existing one keeps its own,
    so pointing GPUMEM_BUILD_DIR at a developer's or the test suite's tree builds nothing
    twice. GPUMEM_CMAKE_ARGS applies to both, after these."""
    extra = shlex.split(os.environ.get("GPUMEM_CMAKE_ARGS", ""))
    cmd = [cmake, "-S", root, "-B", build]
    if not os.path.exists(os.path.join(build, "CMakeCache.txt")):
        cmd += ["-DCMAKE_BUILD_TYPE=Release", "-DGPUMEM_BUILD_TESTS=OFF",
                "-DGPUMEM_BUILD_BENCH=OFF", "-DPython3_EXECUTABLE=" + sys.executable]
        if shutil.which("ninja"):
            cmd += ["-G", "Ninja"]
    _run(cmd + extra, root, configure_environment(os.environ))


def query_targets(build):
    """Asks CMake's file API for the code model at the next configure."""
    query = os.path.join(build, ".cmake", "api", "v1", "query", "client-gpumem")
    os.makedirs(query, exist_ok=True)
    open(os.path.join(query, "codemodel-v2"), "w").close()


def built_files(build):
    """{target name: path of its artifact} from the file API's reply to query_targets():
    the targets this configured tree defines, and where each one's file is (never a copy
    of it elsewhere in the tree)."""
    reply = os.path.join(build, ".cmake", "api", "v1", "reply")
    indexes = sorted(n for n in os.listdir(reply) if n.startswith("index-"))
    if not indexes:
        raise RuntimeError("gpumem build: CMake wrote no code model in %s" % reply)

    def load(name):
        with open(os.path.join(reply, name), encoding="utf-8") as f:
            return json.load(f)

    model = load(load(indexes[-1])["reply"]["client-gpumem"]["codemodel-v2"]["jsonFile"])
    files = {}
    for target in model["configurations"][0]["targets"]:
        artifacts = load(target["jsonFile"]).get("artifacts", [])
        if artifacts:
            files[target["name"]] = os.path.join(build, artifacts[0]["path"])
    return files


def build(root):
    """Configures and builds the libraries; returns {file name: path}."""
    cmake = shutil.which("cmake")
    if cmake is None:
        raise RuntimeError("gpumem: building the Python package needs CMake (>= 3.20) and a "
                           "C++20 compiler on PATH; the CUDA toolkit is optional")
    tree = build_folder(root)
    query_targets(tree)
    configure(cmake, root, tree)
    artifacts = built_files(tree)
    targets = dict(LIBRARIES)
    targets.update({t: names for t, names in NATIVE.items() if t in artifacts})
    missing = sorted(set(LIBRARIES) - set(artifacts))
    if missing:
        raise RuntimeError("gpumem build: %s defines no target %s" % (tree, ", ".join(missing)))
    jobs = os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or str(os.cpu_count() or 2)
    # A build may configure again (a CMakeLists.txt changed): the same environment.
    _run([cmake, "--build", tree, "-j", jobs, "--target"] + sorted(targets), root,
         configure_environment(os.environ))
    found = {}
    for target, names in targets.items():
        # The first name is the target's file; the others lie beside it.
        folder = os.path.dirname(artifacts[target])
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise RuntimeError("gpumem build: %s was not built (%s)" % (name, path))
            found[name] = path
    return found
