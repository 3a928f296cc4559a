#!/usr/bin/env bash
# On a GPU machine: the KV tier path of a 1 GiB sequence (device -> pinned host -> store and
# back) against a plain device-to-host copy and against redis-benchmark, in one run.
#   1. host tier alone (needs nothing but the GPU);
#   2. Redis on loopback: a redis-server of its own on a free port (4 GiB, allkeys-lru),
#      device mode and store mode (2 MiB values, next to redis-benchmark), then stopped.
# Without redis-server, or with a build that has no Redis tier (no libhiredis-dev at build
# time), part 2 is skipped with the reason and the script still exits 0 after part 1.
# Logs: $OUT (default ./kv-tier-gpu-out). Build dir: $BUILD (default build-gpu; built here
# when it has no gpumem tool). DEVICE=sim SEQ=64M: a dry run without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/kv-tier-gpu-out}
BUILD=${BUILD:-build-gpu}
DEVICE=${DEVICE:-cuda}  # sim: a dry run of the path without a GPU
SEQ=${SEQ:-1G}
mkdir -p "$OUT"
if [ ! -x "$BUILD/tools/gpumem" ]; then
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_BENCH=OFF \
    -DGPUMEM_BUILD_TESTS=OFF >"$OUT/build.log" 2>&1 &&
    cmake --build "$BUILD" -j 16 --target gpumem_cli >>"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; exit 1; }
fi
G=$BUILD/tools/gpumem
{ date -u; nvidia-smi -L 2>/dev/null; } | tee "$OUT/info.txt"

echo "== 1. host tier: device -> pinned host tier -> device, 1 GiB"
$G kv-tier-bench --device "$DEVICE" --sequence "$SEQ" --host-tier 2G --no-redis-benchmark | tee "$OUT/host_tier.txt"

echo "== 2. Redis on loopback"
if ! command -v redis-server >/dev/null; then
  echo "skipped: redis-server is not installed here (apt-get install redis-server)" | tee "$OUT/redis.txt"
  exit 0
fi
tmp=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save "" --appendonly no --dir "$tmp" \
  --daemonize yes --pidfile "$tmp/redis.pid" --logfile "$tmp/redis.log" \
  --maxmemory 4gb --maxmemory-policy allkeys-lru
for _ in $(seq 50); do redis-cli -p "$port" ping 2>/dev/null | grep -q PONG && break; sleep 0.1; done
stop() { [ -f "$tmp/redis.pid" ] && kill "$(cat "$tmp/redis.pid")"; sleep 0.5; rm -rf "$tmp"; }
trap stop EXIT
url=redis://127.0.0.1:$port
if ! $G kv-tier-bench --kv-store "$url" --blocks 1 --no-redis-benchmark >"$OUT/probe.txt" 2>&1; then
  echo "skipped: $(tail -1 "$OUT/probe.txt")" | tee "$OUT/redis.txt"
  exit 0
fi
$G kv-tier-bench --device "$DEVICE" --sequence "$SEQ" --kv-store "$url" | tee "$OUT/redis_device.txt"
redis-cli -p "$port" flushall >/dev/null
$G kv-tier-bench --device "$DEVICE" --kv-store "$url" --blocks 256 --batch 16 | tee "$OUT/redis_store.txt"
