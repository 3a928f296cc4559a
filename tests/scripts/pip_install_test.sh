#!/usr/bin/env bash
# `pip install . --no-build-isolation` and `pip wheel . --no-build-isolation` from the source
# tree, offline, into a fresh virtual environment: `import gpumem` works from any folder and
# loads the libraries bundled in the package; `python -m gpumem` runs; the installed
# gpumem-enable.pth turns gpumem on when a (stand-in) torch is imported under
# GPUMEM_ENABLE=1; the wheel holds both libraries and the .pth.
# Exit 77 (skipped) when no Python here has pip, setuptools, wheel and venv.
#   pip_install_test.sh SOURCE_DIR WORK_DIR [CMAKE_ARGS...]
set -euo pipefail
src=$1
work=$2
shift 2
cmake_args="$*"

python=""
for candidate in ${PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$candidate" >/dev/null &&
     "$candidate" -c "import setuptools, wheel, venv, pip" 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "SKIP: no Python with pip, setuptools, wheel and venv (pip builds offline need them)"
  exit 77
fi

rm -rf "$work"
mkdir -p "$work"
"$python" -m venv --system-site-packages "$work/venv"
py=$work/venv/bin/python
export GPUMEM_BUILD_DIR=$work/cmake-build
export GPUMEM_CMAKE_ARGS=$cmake_args
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
unset GPUMEM_LIB GPUMEM_ENABLE PYTHONPATH
"$py" -m pip install --no-build-isolation --no-deps "$src" >"$work/install.log" 2>&1 ||
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

# The wheel.
"$py" -m pip wheel --no-build-isolation --no-deps -w "$work/wheels" "$src" >"$work/wheel.log" 2>&1 ||
  { tail -30 "$work/wheel.log"; exit 1; }
"$py" - "$work/wheels" <<'PY'
import glob, sys, zipfile
wheels = glob.glob(sys.argv[1] + "/gpumem-*.whl")
assert len(wheels) == 1, wheels
names = set(zipfile.ZipFile(wheels[0]).namelist())
for need in ("gpumem/__init__.py", "gpumem/torch.py", "gpumem/__main__.py",
             "gpumem/libgpumem.so", "gpumem/libgpumem_torch.so", "gpumem-enable.pth"):
    assert need in names, (need, sorted(names))
assert "-none-any" not in wheels[0], wheels[0]  # native libraries: a platform wheel
print("wheel ok:", wheels[0].rsplit("/", 1)[1])
PY
echo "pip install and wheel: ok"
