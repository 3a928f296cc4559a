// cuda platform: streams, events and copies, with the stream's device current and the capture mode relaxed for gpumem's own calls.
#include "platform/cuda_internal.hpp"

namespace gpumem::cuda_detail {

result<stream_handle> cuda_platform::stream_create(int device) {
  constexpr platform_op op = platform_op::stream_create;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter(device);
  if (e != cudaSuccess) return runtime_failure(op, e);
  cudaStream_t stream = nullptr;
  // Non-blocking: gpumem's streams must not serialise against the legacy default stream.
  e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return stream_handle{reinterpret_cast<std::uintptr_t>(stream)};
}

status cuda_platform::stream_destroy(stream_handle stream) {
  constexpr platform_op op = platform_op::stream_destroy;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter_stream_device(stream);
  if (e != cudaSuccess) return runtime_failure(op, e);
  e = cudaStreamDestroy(to_cuda(stream));
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

status cuda_platform::stream_synchronize(stream_handle stream) {
  constexpr platform_op op = platform_op::stream_synchronize;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter_stream_device(stream);
  if (e != cudaSuccess) return runtime_failure(op, e);
  e = cudaStreamSynchronize(to_cuda(stream));
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

result<int> cuda_platform::stream_device(stream_handle stream) {
  constexpr platform_op op = platform_op::stream_device;
  calls_.add(op);
  relaxed_capture relaxed;
  int device = 0;
  const cudaError_t e = is_default_stream(stream) ? cudaGetDevice(&device)
                                                  : stream_device_of(stream, &device);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return device;
}

result<event_handle> cuda_platform::event_create(int device) {
  constexpr platform_op op = platform_op::event_create;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter(device);
  if (e != cudaSuccess) return runtime_failure(op, e);
  cudaEvent_t event = nullptr;
  // Timing off: gpumem only orders work, and timing events cost more to record.
  e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return event_handle{reinterpret_cast<std::uintptr_t>(event)};
}

status cuda_platform::event_destroy(event_handle event) {
  constexpr platform_op op = platform_op::event_destroy;
  calls_.add(op);
  relaxed_capture relaxed;
  note_captured(event, false);
  const cudaError_t e = cudaEventDestroy(to_cuda(event));
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

status cuda_platform::event_record(event_handle event, stream_handle stream) {
  constexpr platform_op op = platform_op::event_record;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter_stream_device(stream);
  if (e != cudaSuccess) return runtime_failure(op, e);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  e = cudaStreamIsCapturing(to_cuda(stream), &capturing);
  if (e != cudaSuccess) return runtime_failure(op, e);
  e = cudaEventRecord(to_cuda(event), to_cuda(stream));
  if (e != cudaSuccess) return runtime_failure(op, e);
  note_captured(event, capturing != cudaStreamCaptureStatusNone);
  return status::success();
}

result<bool> cuda_platform::event_query(event_handle event) {
  constexpr platform_op op = platform_op::event_query;
  calls_.add(op);
  relaxed_capture relaxed;
  if (was_captured(event)) return false;  // a graph node: never complete outside the graph
  const cudaError_t e = cudaEventQuery(to_cuda(event));
  if (e == cudaSuccess) return true;
  if (e == cudaErrorNotReady) return false;  // pending work is an answer, not a failure
  return runtime_failure(op, e);
}

status cuda_platform::event_synchronize(event_handle event) {
  constexpr platform_op op = platform_op::event_synchronize;
  calls_.add(op);
  relaxed_capture relaxed;
  if (was_captured(event))
    return runtime_failure(op, cudaErrorCapturedEvent);  // asked of the driver, it would end the capture
  const cudaError_t e = cudaEventSynchronize(to_cuda(event));
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

status cuda_platform::stream_wait_event(stream_handle stream, event_handle event) {
  constexpr platform_op op = platform_op::stream_wait_event;
  calls_.add(op);
  relaxed_capture relaxed;
  device_guard guard(api_);
  cudaError_t e = guard.enter_stream_device(stream);
  if (e != cudaSuccess) return runtime_failure(op, e);
  e = cudaStreamWaitEvent(to_cuda(stream), to_cuda(event), 0);
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

status cuda_platform::memcpy_async(void* dst, const void* src, std::size_t bytes,
                    stream_handle stream) {
  constexpr platform_op op = platform_op::memcpy_async;
  calls_.add(op);
  device_guard guard(api_);
  cudaError_t e = guard.enter_stream_device(stream);
  if (e != cudaSuccess) return runtime_failure(op, e);
  // Default direction: with unified addressing the pointers say where they live.
  e = cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, to_cuda(stream));
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

status cuda_platform::memset_async(void* dst, int value, std::size_t bytes, stream_handle stream) {
  constexpr platform_op op = platform_op::memset_async;
  calls_.add(op);
  device_guard guard(api_);
  cudaError_t e = guard.enter_stream_device(stream);
  if (e != cudaSuccess) return runtime_failure(op, e);
  e = cudaMemsetAsync(dst, value, bytes, to_cuda(stream));
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

result<void*> cuda_platform::async_malloc(int device, std::size_t size, stream_handle stream) {
  constexpr platform_op op = platform_op::async_malloc;
  calls_.add(op);
  device_guard guard(api_);
  cudaError_t e = guard.enter(device);
  if (e != cudaSuccess) return runtime_failure(op, e);
  void* ptr = nullptr;
  e = cudaMallocAsync(&ptr, size, to_cuda(stream));
  if (e != cudaSuccess) return runtime_failure(op, e);
  return ptr;
}

status cuda_platform::async_free(void* ptr, stream_handle stream) {
  constexpr platform_op op = platform_op::async_free;
  calls_.add(op);
  device_guard guard(api_);
  cudaError_t e = guard.enter_stream_device(stream);
  if (e != cudaSuccess) return runtime_failure(op, e);
  e = cudaFreeAsync(ptr, to_cuda(stream));
  if (e != cudaSuccess) return runtime_failure(op, e);
  return status::success();
}

}  // namespace gpumem::cuda_detail
