#!/usr/bin/env bash
# On a GPU machine with torch and transformers: time the workloads of record_workloads.py
# under PyTorch's allocator and under gpumem's plug-in (one process per workload and mode),
# and print one table: seconds of the timed run, peak reserved over peak requested, and
# (gpumem) the milliseconds its pool spent in driver calls over all runs and in the timed run,
# and the growth slack in force at the end (raised by a remap budget).
#
#   WORKLOADS  which (default: all nineteen of record_workloads.py)
#   MODES      native, gpumem, or gpumem:CONF with a GPUMEM_CONF string
#              (default: "native gpumem gpumem:remap_budget:0.05")
#   WARM       runs before the timed one in each process (default 1)
#   REPEATS    runs of each (default 1); OUT: where the JSON and logs go (default
#              ./gpu-workloads-out)
#
# Example, an A/B of a pool setting on the shape-varying encoder:
#   WORKLOADS=encode_varlen MODES="gpumem gpumem:growth_slack:0.02" REPEATS=3 scripts/gpu-workloads.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-workloads-out}
WORKLOADS=${WORKLOADS:-ckpt_train conv_multiscale encode_varlen generate_sampled side_stream moe_train unet_sample gnn_varlen lstm_varlen vit_accum recsys_sparse fsdp_layers beam_search multi_model_serve clip_contrastive speculative_decode lora_finetune vae_decode offload_train}
MODES=${MODES:-native gpumem gpumem:remap_budget:0.05}
REPEATS=${REPEATS:-1}
WARM=${WARM:-1}
BUILD=build-gpu
mkdir -p "$OUT"
if [ ! -f $BUILD/src/interop/libgpumem_torch.so ]; then
  cmake -S . -B $BUILD -G Ninja -DCMAKE_BUILD_TYPE=Release -DGPUMEM_BUILD_TESTS=OFF \
    -DGPUMEM_BUILD_BENCH=ON >"$OUT/build.log" 2>&1 &&
    cmake --build $BUILD -j "$(nproc)" >>"$OUT/build.log" 2>&1 ||
    { tail -30 "$OUT/build.log"; exit 1; }
fi
export PYTHONPATH=python GPUMEM_LIB=$BUILD/src/interop/libgpumem_torch.so
printf "%-17s %-32s %3s %10s %10s %10s %12s %6s\n" workload mode run seconds reserved/req driver_ms timed_drv_ms slack
status=0
for w in $WORKLOADS; do
  for m in $MODES; do
    for r in $(seq "$REPEATS"); do
      log="$OUT/${w}_${m//[:,]/_}_$r.log"
      if python3 scripts/record_workloads.py "$OUT" --only "$w" --time "$m" --warm "$WARM" >"$log" 2>&1; then
        python3 - "$log" "$r" <<'PY'
import json, sys
line = [l for l in open(sys.argv[1]) if l.startswith("{")][-1]
x = json.loads(line)
print("%-17s %-32s %3s %10.3f %10.4f %10s %12s %6s" % (x["workload"], x["mode"], sys.argv[2], x["seconds"],
                                                       x["reserved_over_requested"], x.get("driver_ms", "-"),
                                                       x.get("timed_driver_ms", "-"), x.get("growth_slack", "-")))
PY
      else
        status=1
        printf "%-17s %-32s %3s FAILED (%s)\n" "$w" "$m" "$r" "$log"
      fi
    done
  done
done
exit $status
