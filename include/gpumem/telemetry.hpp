// Umbrella header of the telemetry layer: stats under PyTorch's names, the event recorder,
// snapshot export in PyTorch's memory snapshot format, and where reserved bytes went
// (explain_overhead).
#pragma once
#include "gpumem/telemetry/event_recorder.hpp"
#include "gpumem/telemetry/memory_stats.hpp"
#include "gpumem/telemetry/overhead.hpp"
#include "gpumem/telemetry/snapshot.hpp"
