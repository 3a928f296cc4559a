#!/usr/bin/env bash
# `pip install .` and `pip wheel .` from the source tree, offline (--no-index) and with pip's
# build isolation (pyproject.toml's backend in python_build/ needs nothing installed), into a
# fresh virtual environment: `import gpumem` works from any folder and loads the libraries
# bundled in the package; `python -m gpumem` runs; the installed gpumem-enable.pth turns
# gpumem on when a (stand-in) torch is imported under GPUMEM_ENABLE=1; the wheel holds the
# libraries and the .pth, and its RECORD's hashes and sizes match its files; the sdist holds
# what a build needs (CMake configures its unpacked tree).
# BUILD_DIR is an existing CMake build tree (the test suite's): the backend reuses it and
# builds only the libraries there, nothing from scratch.
# Exit 77 (skipped) when no Python here has pip and venv.
#   pip_install_test.sh SOURCE_DIR WORK_DIR BUILD_DIR
set -euo pipefail
src=$1
work=$2
build=$3

python=""
for candidate in ${PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$candidate" >/dev/null &&
     "$candidate" -c "import venv, pip" 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "SKIP: no Python with pip and venv"
  exit 77
fi

rm -rf "$work"
mkdir -p "$work"
"$python" -m venv --system-site-packages "$work/venv"
py=$work/venv/bin/python
export GPUMEM_BUILD_DIR=$build
export PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
unset GPUMEM_CMAKE_ARGS GPUMEM_LIB GPUMEM_ENABLE PYTHONPATH PIP_NO_BUILD_ISOLATION
"$py" -m pip install --no-index --no-deps "$src" >"$work/install.log" 2>&1 ||
  { tail -30 "$work/install.log"; exit 1; }

site=$("$py" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
test -f "$site/gpumem-enable.pth" || { echo "FAIL: no gpumem-enable.pth in $site"; exit 1; }
cd /
GPUMEM_DEVICE=sim "$py" - "$site" <<'PY'
import os, sys
import gpumem, gpumem.torch
site = os.path.realpath(sys.argv[1])
here = os.path.realpath(os.path.dirname(gpumem.__file__))
assert here == os.path.join(site, "gpumem"), (here, site)
assert os.path.realpath(gpumem.library_path()) == os.path.join(here, "libgpumem_torch.so"), gpumem.library_path()
assert gpumem.c_library_path() == os.path.join(gpumem.__path__[0], "libgpumem.so")
import ctypes
c_lib = ctypes.CDLL(gpumem.c_library_path())
c_lib.gpumem_version.restype = ctypes.c_char_p
assert c_lib.gpumem_version() == gpumem.version().encode(), c_lib.gpumem_version()
with gpumem.Pool("limit:64M", platform="sim") as pool:
    p = pool.malloc(1 << 20)
    pool.free(p, 1 << 20)
print("installed package ok:", here)
PY
out=$("$py" -m gpumem check-conf "limit:1G,allocator:caching_pool")
[ "$out" = ok ] || { echo "FAIL: check-conf said '$out'"; exit 1; }
if "$py" -m gpumem check-conf "limt:1G" 2>"$work/conf.err"; then
  echo "FAIL: an unknown key was accepted"; exit 1
fi
grep -q "unknown key 'limt'" "$work/conf.err" || { cat "$work/conf.err"; exit 1; }

# The installed .pth: GPUMEM_ENABLE=1 python train.py, train.py unmodified.
fake=$src/tests/interop/fake_torch
seen=$(GPUMEM_ENABLE=1 GPUMEM_DEVICE=sim PYTHONPATH=$fake "$py" "$fake/train.py" --steps 3)
echo "$seen" | "$py" -c "
import json, sys
out = json.loads(sys.stdin.read())
assert out['argv'][1:] == ['--steps', '3'], out
assert len(out['changes']) == 1 and out['changes'][0][1:] == ['gpumem_torch_malloc', 'gpumem_torch_free', True], out
assert out['changes'][0][0].endswith('/gpumem/libgpumem_torch.so'), out
print('GPUMEM_ENABLE hook ok')"
seen=$(PYTHONPATH=$fake "$py" "$fake/train.py")
echo "$seen" | grep -q '"changes": \[\]' || { echo "FAIL: enabled without GPUMEM_ENABLE: $seen"; exit 1; }

# The wheel: its files, its tag, its RECORD.
"$py" -m pip wheel --no-index --no-deps -w "$work/wheels" "$src" >"$work/wheel.log" 2>&1 ||
  { tail -30 "$work/wheel.log"; exit 1; }
"$py" - "$work/wheels" "$build" <<'PY'
import base64, csv, glob, hashlib, io, os, sys, sysconfig, zipfile
wheels = glob.glob(sys.argv[1] + "/gpumem-*.whl")
assert len(wheels) == 1, wheels
wheel = zipfile.ZipFile(wheels[0])
names = set(wheel.namelist())
for need in ("gpumem/__init__.py", "gpumem/torch.py", "gpumem/__main__.py",
             "gpumem/libgpumem.so", "gpumem/libgpumem_torch.so", "gpumem-enable.pth",
             "gpumem-0.1.0.dist-info/METADATA", "gpumem-0.1.0.dist-info/WHEEL"):
    assert need in names, (need, sorted(names))
# The native PyTorch allocator comes with its torch tag where the build tree defines it.
native = os.path.exists(os.path.join(sys.argv[2], "src", "interop", "libgpumem_torch_native.so"))
for name in ("gpumem/libgpumem_torch_native.so", "gpumem/libgpumem_torch_native.torch"):
    assert (name in names) == native, (name, native, sorted(names))
platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
assert wheels[0].endswith("-%s.whl" % platform), wheels[0]  # native libraries: a platform wheel
assert "Root-Is-Purelib: false" in wheel.read("gpumem-0.1.0.dist-info/WHEEL").decode()
record = list(csv.reader(io.StringIO(wheel.read("gpumem-0.1.0.dist-info/RECORD").decode())))
assert {row[0] for row in record} == names, (sorted(names), record)
for path, digest, size in record:
    if path.endswith("/RECORD"):
        assert digest == size == "", (path, digest, size)
        continue
    data = wheel.read(path)
    want = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    assert (digest, size) == (want, str(len(data))), (path, digest, size)
print("wheel ok:", os.path.basename(wheels[0]), len(record), "files")
PY

# The sdist: what a build needs, with PKG-INFO; CMake configures the unpacked tree.
sdist=$(cd "$src" && "$py" -c "
import sys; sys.path.insert(0, 'python_build'); import gpumem_build
print(gpumem_build.build_sdist(sys.argv[1]))" "$work/sdist")
mkdir -p "$work/sdist/tree"
tar xzf "$work/sdist/$sdist" -C "$work/sdist/tree"
unpacked=$work/sdist/tree/${sdist%.tar.gz}
for need in PKG-INFO pyproject.toml python/gpumem/__init__.py python/gpumem-enable.pth \
            python_build/gpumem_build.py src/interop/CMakeLists.txt; do
  [ -f "$unpacked/$need" ] || { echo "FAIL: the sdist has no $need"; exit 1; }
done
if find "$unpacked" -name '*.so' -o -name __pycache__ | grep -q .; then
  echo "FAIL: build output in the sdist"; exit 1
fi
cmake -S "$unpacked" -B "$work/sdist/configured" -DGPUMEM_BUILD_TESTS=OFF \
      -DGPUMEM_BUILD_BENCH=OFF >"$work/sdist/configure.log" 2>&1 ||
  { tail -30 "$work/sdist/configure.log"; exit 1; }
echo "sdist ok: $sdist"
echo "pip install, wheel and sdist: ok"
