// Umbrella header of the telemetry layer: stats under PyTorch's names, the event recorder,
// and snapshot export in PyTorch's memory snapshot format.
#pragma once
#include "gpumem/telemetry/event_recorder.hpp"
#include "gpumem/telemetry/memory_stats.hpp"
#include "gpumem/telemetry/snapshot.hpp"
