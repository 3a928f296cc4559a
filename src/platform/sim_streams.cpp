// sim device: streams, events and copies.
#include "platform/sim/sim_state.hpp"

namespace gpumem {

// --- streams and events --------------------------------------------------------------------
// Sim executes work at once, in call order, so streams only need identity; events
// complete at once unless a test holds them.

result<stream_handle> sim_platform::stream_create(int device) {
  GPUMEM_SIM_ENTER(platform_op::stream_create);
  GPUMEM_SIM_CHARGE(platform_op::stream_create, 0);
  auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::stream_create, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  std::lock_guard lock(s.mutex);
  // Odd ids, so a stream handle never equals 0 (the default stream) nor an event id.
  const std::uintptr_t id = (s.next_object_id++ << 1) | 1;
  s.streams.emplace(id, device);
  return stream_handle{id};
}

status sim_platform::stream_destroy(stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::stream_destroy);
  GPUMEM_SIM_CHARGE(platform_op::stream_destroy, 0);
  std::lock_guard lock(state_->mutex);
  if (stream.value == 0 || state_->streams.erase(stream.value) == 0)
    return fail(platform_op::stream_destroy, failure_kind::invalid_value, "unknown stream");
  return status::success();
}

result<int> sim_platform::stream_device(stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::stream_device);
  GPUMEM_SIM_CHARGE(platform_op::stream_device, 0);
  std::lock_guard lock(state_->mutex);
  if (stream.value == 0) return 0;
  auto it = state_->streams.find(stream.value);
  if (it == state_->streams.end())
    return fail(platform_op::stream_device, failure_kind::invalid_value, "unknown stream");
  return it->second;
}

status sim_platform::stream_synchronize(stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::stream_synchronize);
  GPUMEM_SIM_CHARGE(platform_op::stream_synchronize, 0);
  std::lock_guard lock(state_->mutex);
  if (!known_stream(*state_, stream))
    return fail(platform_op::stream_synchronize, failure_kind::invalid_value, "unknown stream");
  return status::success();
}

result<event_handle> sim_platform::event_create(int device) {
  GPUMEM_SIM_ENTER(platform_op::event_create);
  GPUMEM_SIM_CHARGE(platform_op::event_create, 0);
  auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::event_create, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  std::lock_guard lock(s.mutex);
  const std::uintptr_t id = s.next_object_id++ << 1;
  s.events.emplace(id, event_record_state{device, true});
  return event_handle{id};
}

status sim_platform::event_destroy(event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::event_destroy);
  GPUMEM_SIM_CHARGE(platform_op::event_destroy, 0);
  std::lock_guard lock(state_->mutex);
  if (state_->events.erase(event.value) == 0)
    return fail(platform_op::event_destroy, failure_kind::invalid_value, "unknown event");
  return status::success();
}

status sim_platform::event_record(event_handle event, stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::event_record);
  GPUMEM_SIM_CHARGE(platform_op::event_record, 0);
  std::lock_guard lock(state_->mutex);
  auto it = state_->events.find(event.value);
  if (it == state_->events.end())
    return fail(platform_op::event_record, failure_kind::invalid_value, "unknown event");
  if (!known_stream(*state_, stream))
    return fail(platform_op::event_record, failure_kind::invalid_value, "unknown stream");
  // As CUDA: an event is recorded on a stream of its own device (the default stream is
  // the current device's: any).
  if (stream.value != 0 && state_->streams.at(stream.value) != it->second.device)
    return fail(platform_op::event_record, failure_kind::invalid_value,
                "event of device " + std::to_string(it->second.device) +
                    " recorded on a stream of device " +
                    std::to_string(state_->streams.at(stream.value)));
  it->second.complete = !state_->holding_events;
  return status::success();
}

result<bool> sim_platform::event_query(event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::event_query);
  GPUMEM_SIM_CHARGE(platform_op::event_query, 0);
  std::lock_guard lock(state_->mutex);
  auto it = state_->events.find(event.value);
  if (it == state_->events.end())
    return fail(platform_op::event_query, failure_kind::invalid_value, "unknown event");
  return it->second.complete;
}

status sim_platform::event_synchronize(event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::event_synchronize);
  GPUMEM_SIM_CHARGE(platform_op::event_synchronize, 0);
  std::lock_guard lock(state_->mutex);
  auto it = state_->events.find(event.value);
  if (it == state_->events.end())
    return fail(platform_op::event_synchronize, failure_kind::invalid_value, "unknown event");
  // A held event would block forever: report it rather than hang the test.
  if (!it->second.complete)
    return fail(platform_op::event_synchronize, failure_kind::not_ready,
                "event is held incomplete by the test (sim_platform::hold_events)");
  return status::success();
}

status sim_platform::stream_wait_event(stream_handle stream, event_handle event) {
  GPUMEM_SIM_ENTER(platform_op::stream_wait_event);
  GPUMEM_SIM_CHARGE(platform_op::stream_wait_event, 0);
  std::lock_guard lock(state_->mutex);
  if (!known_stream(*state_, stream))
    return fail(platform_op::stream_wait_event, failure_kind::invalid_value, "unknown stream");
  if (!state_->events.contains(event.value))
    return fail(platform_op::stream_wait_event, failure_kind::invalid_value, "unknown event");
  return status::success();
}

namespace {

// The device a copy or memset on `stream` runs on: the stream's; for the default stream,
// the current device, taken to be the one whose memory the call touches (the
// destination's, else the source's). REQUIRES: mutex held, stream known.
int copying_device(const sim_platform::state& s, stream_handle stream, const void* dst,
                   const void* src) {
  if (stream.value != 0) return s.streams.at(stream.value);
  const int to = s.owner_of(reinterpret_cast<std::uintptr_t>(dst));
  if (to >= 0) return to;
  const int from = src != nullptr ? s.owner_of(reinterpret_cast<std::uintptr_t>(src)) : -1;
  return from >= 0 ? from : 0;
}

}  // namespace

status sim_platform::check_access(int device, const void* ptr, std::size_t bytes) const {
  const auto& s = *state_;
  if (!s.valid_device(device))
    return fail(platform_op::count_, failure_kind::invalid_value,
                "no sim device " + std::to_string(device));
  std::lock_guard lock(s.mutex);
  bool host = false;
  std::string why = s.access_denied(device, reinterpret_cast<std::uintptr_t>(ptr), bytes,
                                    false, &host);
  if (host) why = "illegal address " + state::hex(reinterpret_cast<std::uintptr_t>(ptr)) +
                  ": not sim device memory";
  if (!why.empty()) return fail(platform_op::count_, failure_kind::invalid_value, why);
  return status::success();
}

status sim_platform::memcpy_async(void* dst, const void* src, std::size_t bytes,
                                  stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::memcpy_async);
  GPUMEM_SIM_CHARGE(platform_op::memcpy_async, bytes);
  if (bytes != 0 && (dst == nullptr || src == nullptr))
    return fail(platform_op::memcpy_async, failure_kind::invalid_value, "null pointer");
  {
    std::lock_guard lock(state_->mutex);
    if (!known_stream(*state_, stream))
      return fail(platform_op::memcpy_async, failure_kind::invalid_value, "unknown stream");
    const int device = copying_device(*state_, stream, dst, src);
    for (const void* p : {static_cast<const void*>(dst), src})
      if (std::string why = state_->access_denied(device, reinterpret_cast<std::uintptr_t>(p),
                                                  bytes, true);
          !why.empty())
        return fail(platform_op::memcpy_async, failure_kind::invalid_value,
                    "copy on a stream of device " + std::to_string(device) + ": " + why);
  }
  std::memmove(dst, src, bytes);  // host memory that is not mapped faults here
  return status::success();
}

status sim_platform::memset_async(void* dst, int value, std::size_t bytes, stream_handle stream) {
  GPUMEM_SIM_ENTER(platform_op::memset_async);
  GPUMEM_SIM_CHARGE(platform_op::memset_async, bytes);
  if (bytes != 0 && dst == nullptr)
    return fail(platform_op::memset_async, failure_kind::invalid_value, "null pointer");
  {
    std::lock_guard lock(state_->mutex);
    if (!known_stream(*state_, stream))
      return fail(platform_op::memset_async, failure_kind::invalid_value, "unknown stream");
    const int device = copying_device(*state_, stream, dst, nullptr);
    if (std::string why = state_->access_denied(device, reinterpret_cast<std::uintptr_t>(dst),
                                                bytes, false);
        !why.empty())
      return fail(platform_op::memset_async, failure_kind::invalid_value,
                  "memset on a stream of device " + std::to_string(device) + ": " + why);
  }
  std::memset(dst, value, bytes);
  return status::success();
}

}  // namespace gpumem
