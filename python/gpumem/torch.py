"""gpumem as PyTorch's CUDA allocator (torch.cuda.memory.CUDAPluggableAllocator).

    import gpumem.torch
    gpumem.torch.enable("release_threshold:8G")   # before the first CUDA allocation
    ...
    for batch in loader:
        gpumem.torch.mark_step()                   # optional: steps alike get a fixed layout
        ...
    print(gpumem.torch.stats())                    # peak_reserved_bytes, peak_live_bytes, ...

What changes under a pluggable allocator, and what enable() does about it:
  - torch.cuda.memory_stats() / memory_reserved() / max_memory_allocated() raise or read
    zero (PyTorch's pluggable allocator implements none of them): use stats().
  - torch.cuda.empty_cache() reaches a pluggable allocator only through set_reset_fn;
    enable() sets it to gpumem_torch_reset where the allocator object offers the setter
    (empty_cache_mode() says so); empty_cache() here always works.
  - Tensor.record_stream(s) reaches a pluggable allocator only through the function set with
    CUDAPluggableAllocator::set_record_stream_fn; CUDAPluggableAllocator's Python constructor
    sets none, so by default record_stream is a silent no-op. PyTorch 2.11's allocator object
    (CUDAPluggableAllocator(...).allocator()) exposes set_record_stream_fn, and enable() sets
    it to gpumem_torch_record_stream. Where a PyTorch lacks it, enable() wraps
    torch.Tensor.record_stream instead, which sees calls made from Python (FSDP, user code)
    but not those made from C++ inside PyTorch. record_stream_mode() says which is active.
    A recorded tensor's free makes its allocation stream wait for the recorded streams'
    work, so the block is never reused under a kernel still reading it.
  - An allocation that fails raises (a pluggable allocator's NULL would become a tensor at
    address 0): an out-of-memory as torch.OutOfMemoryError when the plug-in was built where
    PyTorch is installed, else as RuntimeError (out_of_memory_error() says which), its text
    starting "CUDA out of memory." with gpumem's report and where the reserved bytes go.
"""

import ctypes
import os

import gpumem

_state = {"enabled": False, "record_stream": "none", "allocator": None, "empty_cache": "none",
          "mark_steps": "none", "graph_pools": "none"}


def enable(conf=None, allocator=None, path=None, patch_record_stream=True, mark_steps=None):
    """Makes gpumem PyTorch's CUDA allocator. `conf` (GPUMEM_CONF syntax) and `allocator`
    (vmm_page_pool or caching_pool) are put in the environment the plug-in reads when it
    creates each device's pool. Must run before PyTorch allocates CUDA memory.

    mark_steps="optimizer" (or GPUMEM_MARK_STEPS=optimizer) calls mark_step() after every
    optimizer step (torch.optim's global step hook), so a training loop gets step plans with
    no change to the loop itself."""
    import torch

    if _state["enabled"]:
        return _state["allocator"]
    mark_steps = mark_steps if mark_steps is not None else os.environ.get("GPUMEM_MARK_STEPS")
    if mark_steps not in (None, "", "optimizer"):
        raise ValueError("gpumem.torch.enable: mark_steps must be 'optimizer' or None, not %r"
                         % (mark_steps,))
    if conf is not None:
        os.environ["GPUMEM_CONF"] = gpumem._text(conf, "conf")
    if allocator is not None:
        os.environ["GPUMEM_ALLOCATOR"] = gpumem._text(allocator, "allocator")
    lib = gpumem.load(path)
    so_path = gpumem.library_path()
    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        so_path, "gpumem_torch_malloc", "gpumem_torch_free")
    native = alloc.allocator()
    hook = getattr(native, "set_record_stream_fn", None)
    if callable(hook):
        hook(ctypes.cast(lib.gpumem_torch_record_stream, ctypes.c_void_p).value)
        _state["record_stream"] = "set_record_stream_fn"
    elif patch_record_stream:
        _patch_record_stream(torch, lib)
        _state["record_stream"] = "python"
    # torch.cuda.empty_cache() calls the allocator's reset function, when one is set.
    reset = getattr(native, "set_reset_fn", None)
    if callable(reset):
        try:
            reset(ctypes.cast(lib.gpumem_torch_reset, ctypes.c_void_p).value)
            _state["empty_cache"] = "set_reset_fn"
        except (TypeError, RuntimeError):
            pass  # empty_cache() below still works
    _state["graph_pools"] = _set_graph_pool_hooks(native, lib)
    _relax_inductor_pool_asserts()
    torch.cuda.memory.change_current_allocator(alloc)
    _state.update(enabled=True, allocator=alloc)
    if mark_steps:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: mark_step())
        _state["mark_steps"] = "optimizer"
    return alloc


def _set_graph_pool_hooks(native, lib):
    """CUDA graph capture and torch.cuda.use_mem_pool reach a pluggable allocator only
    through these three hooks: with them, what a graph allocates is served by a private pool
    of the graph's pool id (src/interop/torch_graph_pools.hpp). Without them (a PyTorch that
    lacks the setters) capture still works but graph memory comes from the shared pool."""
    hooks = (("set_begin_allocate_to_pool", "gpumem_torch_begin_allocate_to_pool"),
             ("set_end_allocate_to_pool_fn", "gpumem_torch_end_allocate_to_pool"),
             ("set_release_pool", "gpumem_torch_release_pool"))
    if not all(callable(getattr(native, setter, None)) for setter, _ in hooks):
        return "none"
    for setter, entry in hooks:
        getattr(native, setter)(ctypes.cast(getattr(lib, entry), ctypes.c_void_p).value)
    return "private"


def _relax_inductor_pool_asserts():
    """torch.compile(mode="reduce-overhead") asks the allocator what its graph pools hold
    (torch._C._cuda_checkPoolLiveAllocations, a debugging assert) and checkpoints their
    state; PyTorch's pluggable allocator interface can answer neither. The assert is turned
    off and CUDA graph trees with it; the pools' rules are kept by gpumem's private graph
    pools."""
    try:
        import torch._inductor.config as inductor_config
    except ImportError:
        return
    triton = getattr(inductor_config, "triton", None)
    if triton is None:
        return
    if hasattr(triton, "slow_path_cudagraph_asserts"):
        triton.slow_path_cudagraph_asserts = False
    # CUDA graph trees checkpoint the allocator's pool state after their first recording
    # (torch._C._cuda_getCheckpointState), which no pluggable allocator can give ("does not
    # yet support getCheckpointState"): reduce-overhead then captures one graph per compiled
    # function, through torch.cuda.graph, whose pools gpumem keeps private.
    if hasattr(triton, "cudagraph_trees"):
        triton.cudagraph_trees = False


def allocator(path=None):
    """A CUDAPluggableAllocator over gpumem's plug-in, without making it PyTorch's allocator:
    for torch.cuda.MemPool(gpumem.torch.allocator().allocator()) under PyTorch's own
    allocator (torch.cuda.use_mem_pool then serves that block's allocations from gpumem)."""
    import torch

    lib = gpumem.load(path)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        gpumem.library_path(), "gpumem_torch_malloc", "gpumem_torch_free")
    hook = getattr(alloc.allocator(), "set_record_stream_fn", None)
    if callable(hook):
        hook(ctypes.cast(lib.gpumem_torch_record_stream, ctypes.c_void_p).value)
    return alloc


def graph_pools_mode():
    """"private" when CUDA graphs and MemPool contexts get private pools, else "none"."""
    return _state["graph_pools"]


def graph_pools():
    """The private pools of CUDA graphs and MemPool contexts alive now: a dict with pools,
    reserved_bytes and live_allocations."""
    lib = gpumem.load()
    vals = [ctypes.c_ulonglong(0) for _ in range(3)]
    lib.gpumem_torch_graph_pools(*[ctypes.byref(v) for v in vals])
    return {"pools": vals[0].value, "reserved_bytes": vals[1].value,
            "live_allocations": vals[2].value}


def _patch_record_stream(torch, lib):
    original = torch.Tensor.record_stream

    def record_stream(self, stream):
        original(self, stream)  # PyTorch's own checks; a no-op for a pluggable allocator
        if self.is_cuda:
            base = self.untyped_storage().data_ptr()
            if base:
                status = lib.gpumem_torch_record_stream_on(self.device.index, base,
                                                           gpumem._stream_value(stream))
                if status != gpumem.SUCCESS:
                    gpumem._raise(lib, status)

    record_stream.__doc__ = original.__doc__
    torch.Tensor.record_stream = record_stream


def enabled():
    return _state["enabled"]


def mark_steps_mode():
    """"optimizer" when enable() marks a step after every optimizer step, else "none"."""
    return _state["mark_steps"]


def record_stream_mode():
    """"set_record_stream_fn", "python" (Tensor.record_stream wrapped) or "none"."""
    return _state["record_stream"]


def empty_cache_mode():
    """"set_reset_fn" when torch.cuda.empty_cache() reaches gpumem, else "none"."""
    return _state["empty_cache"]


def stats(device=0):
    """gpumem's statistics of the device's pool, as a dict (gpumem_stats fields)."""
    lib = gpumem.load()
    s = gpumem.Stats()
    gpumem._check(lib, lib.gpumem_torch_stats(gpumem._device(device), ctypes.byref(s)))
    return s.as_dict()


class _BorrowedPool(gpumem.Pool):
    """The plug-in's pool of one device: the Pool interface, never destroyed from Python."""

    def __init__(self, lib, handle):  # pylint: disable=super-init-not-called
        self._lib = lib
        self._handle = ctypes.c_void_p(handle)

    def close(self):
        self._handle = None  # the plug-in owns the pool


def pool(device=0):
    """The plug-in's pool of `device` (created now if PyTorch has not allocated there yet),
    as a gpumem.Pool: counters(), report(), trim(), snapshot(), ..."""
    lib = gpumem.load()
    handle = lib.gpumem_torch_pool(gpumem._device(device))
    if not handle:
        raise gpumem.GpumemError(gpumem.ERROR_INVALID_ARGUMENT,
                                 "gpumem.torch: no pool for device %d (see stderr)" % device)
    return _BorrowedPool(lib, handle)


def counters(device=0, names=None):
    """Driver calls and page counts of the device's pool (gpumem.Pool.counters)."""
    return pool(device).counters(names)


def explain(device=0):
    """Where the device's pool's reserved bytes go now (gpumem.Pool.explain): call it at
    the peak of a step, or after an out-of-memory, to see what the overhead is made of."""
    return pool(device).explain()


def snapshot(path, device=0):
    """Writes a PyTorch memory snapshot of the device's pool to `path` (raises
    gpumem.NotSupportedError where the library has no snapshot exporter)."""
    lib = gpumem.load()
    gpumem._check(lib, lib.gpumem_torch_snapshot(gpumem._device(device), gpumem._path(path)))


def mark_step():
    """Marks a step boundary of the training or serving loop, on every device's pool: call
    it once per step, at the same point (the top of the loop). Once two steps in a row made
    the same requests, later steps are served from a precomputed layout in one region: no
    search, no driver call, memory at the plan's peak; a step that differs goes to the pool
    from its first difference (see include/gpumem/pool/step_planner.hpp). With
    GPUMEM_CONF's step_plan:off it does nothing."""
    lib = gpumem.load()
    status = lib.gpumem_torch_mark_step()
    if status != gpumem.SUCCESS:
        gpumem._raise(lib, status)


def empty_cache():
    """Gives every pool's cached memory back to the driver; returns the bytes released."""
    return int(gpumem.load().gpumem_torch_empty_cache())


def out_of_memory_error():
    """The exception an out-of-memory under the plug-in raises: "torch.OutOfMemoryError",
    as PyTorch's own allocator (a plug-in built against libtorch), or "RuntimeError" (one
    built without it). Both start "CUDA out of memory." and carry gpumem's report;
    torch.OutOfMemoryError is a RuntimeError too."""
    typed = gpumem.load().gpumem_torch_oom_is_torch_type()
    return "torch.OutOfMemoryError" if typed else "RuntimeError"


def failures():
    """Failures of the plug-in so far: allocations that raised (RuntimeError or
    torch.OutOfMemoryError, see out_of_memory_error(), with gpumem's text) and frees or stream records that failed (printed on stderr: PyTorch frees from
    destructors, which cannot raise)."""
    return int(gpumem.load().gpumem_torch_failures())
