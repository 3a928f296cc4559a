// Umbrella header of the telemetry layer: stats under PyTorch's names, the event recorder,
// snapshot export in PyTorch's memory snapshot format. (Where reserved bytes went,
// explain_overhead, is the pool layer's: gpumem/pool/core/overhead.hpp.)
#pragma once
#include "gpumem/telemetry/event_recorder.hpp"
#include "gpumem/telemetry/memory_stats.hpp"
#include "gpumem/telemetry/snapshot.hpp"
