#!/usr/bin/env bash
# The CMake package end to end: `cmake --install` of a built tree into a fresh prefix, the
# expected files there, a consumer project (tests/interop/consumer) configured with
# find_package(gpumem), built and run, and gpumem.pc checked and used to build and run a
# C program. The pkg-config part is skipped, saying so, where pkg-config is absent.
#   install_test.sh SOURCE_DIR BUILD_DIR GENERATOR VERSION
set -euo pipefail
src=$1 build=$2 generator=$3 version=$4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix

cmake --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; exit 1; }
pc=$(find "$prefix" -name gpumem.pc -path '*/pkgconfig/*' | head -1)
[ -n "$pc" ] || { echo "FAIL: no gpumem.pc installed"; exit 1; }
libdir=$(dirname "$(dirname "$pc")")
for f in include/gpumem/interop/gpumem.h include/gpumem/pool.hpp include/gpumem/platform.hpp \
         bin/gpumem; do
  [ -e "$prefix/$f" ] || { echo "FAIL: $prefix/$f not installed"; exit 1; }
done
for f in libgpumem.so libgpumem.a libgpumem_torch.so cmake/gpumem/gpumemConfig.cmake \
         cmake/gpumem/gpumemConfigVersion.cmake cmake/gpumem/gpumemTargets.cmake; do
  [ -e "$libdir/$f" ] || { echo "FAIL: $libdir/$f not installed"; exit 1; }
done
"$prefix/bin/gpumem" --help >/dev/null || { echo "FAIL: the installed tool does not run"; exit 1; }
# The plug-in exports the C API and its entry points only.
if command -v nm >/dev/null; then
  # The symbol list read whole first: `grep -q` reading nm's pipe would stop nm early
  # (SIGPIPE, a failure under pipefail).
  syms=$(nm -D --defined-only "$libdir/libgpumem_torch.so" | awk '{print $3}')
  stray=$(grep -v '^gpumem_' <<<"$syms" || true)
  [ -z "$stray" ] || { echo "FAIL: libgpumem_torch.so exports more than gpumem_*: $stray"; exit 1; }
  grep -qx 'gpumem_torch_malloc' <<<"$syms" \
    || { echo "FAIL: gpumem_torch_malloc not exported"; exit 1; }
fi

# A consumer project against the package.
cmake -S "$src/tests/interop/consumer" -B "$tmp/consumer" -G "$generator" \
      -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" >"$tmp/configure.log" 2>&1 \
  || { cat "$tmp/configure.log"; exit 1; }
grep "gpumem" "$tmp/configure.log" || true   # says why gpumem::gpumem_static is absent, if it is
cmake --build "$tmp/consumer" >"$tmp/build.log" 2>&1 || { cat "$tmp/build.log"; exit 1; }
"$tmp/consumer/consumer_cpp"
"$tmp/consumer/consumer_c"
if [ -x "$tmp/consumer/consumer_static" ]; then
  "$tmp/consumer/consumer_static"
  # Linked statically: no libgpumem.so needed at run time.
  if ldd "$tmp/consumer/consumer_static" | grep -q 'libgpumem\.so'; then
    echo "FAIL: consumer_static depends on libgpumem.so"; exit 1
  fi
else
  echo "note: gpumem::gpumem_static not defined by the package here (see above); static consumer skipped"
fi

# pkg-config.
if ! command -v pkg-config >/dev/null; then
  echo "SKIP pkg-config checks: pkg-config is not installed (scripts/install-deps.sh installs it)"
  echo "install_test: ok"
  exit 0
fi
export PKG_CONFIG_PATH="$(dirname "$pc")"
got=$(pkg-config --modversion gpumem)
[ "$got" = "$version" ] || { echo "FAIL: pkg-config version '$got', expected '$version'"; exit 1; }
cflags=$(pkg-config --cflags gpumem)
libs=$(pkg-config --libs gpumem)
# The .pc is relocatable: its paths must resolve inside this prefix.
inc=$(echo "$cflags" | sed -n 's/.*-I\([^ ]*\).*/\1/p')
[ -f "$inc/gpumem/interop/gpumem.h" ] || { echo "FAIL: --cflags '$cflags' does not reach the headers"; exit 1; }
echo "$libs" | grep -q -- '-lgpumem' || { echo "FAIL: --libs '$libs' lacks -lgpumem"; exit 1; }
pkg-config --static --libs gpumem | grep -q -- '-lpthread' \
  || { echo "FAIL: --static --libs lacks the private dependencies"; exit 1; }
cc=${CC:-cc}
# shellcheck disable=SC2086
"$cc" -std=c99 -Wall -Wextra -Wpedantic -Werror "$src/tests/interop/consumer/consumer.c" \
      $cflags $libs -o "$tmp/pc_consumer"
LD_LIBRARY_PATH="$libdir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$tmp/pc_consumer"
echo "install_test: ok"
