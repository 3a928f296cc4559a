"""gpumem as PyTorch's CUDA allocator (torch.cuda.memory.CUDAPluggableAllocator).

    import gpumem.torch
    gpumem.torch.enable("release_threshold:8G")   # before the first CUDA allocation
    ...
    for batch in loader:
        gpumem.torch.mark_step()                   # optional: steps alike get a fixed layout
        ...
    print(gpumem.torch.stats())                    # peak_reserved_bytes, peak_live_bytes, ...

One step, no change to the script: `python -m gpumem run train.py ARGS` or, with the
package installed by pip, `GPUMEM_ENABLE=1 python train.py` (gpumem/_autoenable.py).

What changes under a pluggable allocator, and what enable() does about it:
  - torch.cuda.memory_stats() / memory_reserved() / max_memory_allocated() raise or read
    zero (PyTorch's pluggable allocator implements none of them): this module has them
    under the same names and keys (memory_stats(), memory_summary(), memory_allocated(),
    max_memory_allocated(), memory_reserved(), max_memory_reserved(),
    reset_peak_memory_stats()), and stats() has gpumem's own.
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
import sys

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
    _refuse_if_cuda_started(torch)
    mark_steps = mark_steps if mark_steps is not None else os.environ.get("GPUMEM_MARK_STEPS")
    if mark_steps not in (None, "", "optimizer"):
        raise ValueError("gpumem.torch.enable: mark_steps must be 'optimizer' or None, not %r"
                         % (mark_steps,))
    if conf is not None:
        os.environ["GPUMEM_CONF"] = gpumem._text(conf, "conf")
    if allocator is not None:
        os.environ["GPUMEM_ALLOCATOR"] = gpumem._text(allocator, "allocator")
    lib = gpumem.load(path)
    route = _install_native(torch, lib)
    if route is not None:
        _state.update(enabled=True, allocator=route, record_stream="native",
                      empty_cache="native", graph_pools="private", route="native")
        _register_mark_steps(mark_steps)
        return route
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
    _state.update(enabled=True, allocator=alloc, route="pluggable")
    _register_mark_steps(mark_steps)
    return alloc


def _register_mark_steps(mark_steps):
    if mark_steps:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: mark_step())
        _state["mark_steps"] = "optimizer"


NATIVE_LIBRARY_NAME = "libgpumem_torch_native.so"


def _torch_build_tag(torch):
    """The running torch as the native allocator records the one it was built for."""
    return "%s abi%d" % (torch.__version__, int(bool(torch._C._GLIBCXX_USE_CXX11_ABI)))


def _install_native(torch, lib):
    """Makes gpumem PyTorch's own CUDA allocator (libgpumem_torch_native.so, a subclass of
    c10's CUDAAllocator) when that library was built for the running torch; returns a
    description of the route, or None after one line on stderr saying why the pluggable
    route serves instead. GPUMEM_TORCH_ROUTE chooses: "native" (the default: the native
    allocator where it was built, which a build against an installed torch does, and matches
    this torch; else the pluggable route) or "pluggable"."""
    wanted = os.environ.get("GPUMEM_TORCH_ROUTE", "native")
    if wanted not in ("native", "pluggable"):
        raise ValueError("gpumem.torch.enable: GPUMEM_TORCH_ROUTE must be 'native' or "
                         "'pluggable', not %r" % (wanted,))
    if wanted == "pluggable":
        return None
    folder = os.path.dirname(gpumem.library_path())
    native_path = os.path.join(folder, NATIVE_LIBRARY_NAME)
    tag_path = native_path[:-len(".so")] + ".torch"
    if not os.path.exists(native_path) or not os.path.exists(tag_path):
        _say("the native PyTorch allocator was not built (no torch at build time); "
             "using CUDAPluggableAllocator")
        return None
    with open(tag_path, encoding="utf-8") as f:
        built_for = f.read().strip()
    running = _torch_build_tag(torch)
    if built_for != running:
        _say("the native PyTorch allocator was built for torch %s, this is torch %s; using "
             "CUDAPluggableAllocator (rebuild gpumem to get the native one)" % (built_for, running))
        return None
    try:
        native = ctypes.CDLL(native_path, mode=ctypes.RTLD_LOCAL)
    except OSError as e:
        _say("the native PyTorch allocator could not be loaded (%s); using "
             "CUDAPluggableAllocator" % e)
        return None
    native.gpumem_torch_native_built_for.restype = ctypes.c_char_p
    native.gpumem_torch_native_error.restype = ctypes.c_char_p
    if native.gpumem_torch_native_built_for().decode() != running:
        _say("the native PyTorch allocator's build does not match this torch; using "
             "CUDAPluggableAllocator")
        return None
    if native.gpumem_torch_native_install() != 0:
        raise RuntimeError("gpumem.torch.enable: " +
                           native.gpumem_torch_native_error().decode(errors="replace"))
    _state["native"] = native
    return "native"


def _say(line):
    sys.stderr.write("gpumem: %s\n" % line)


def route():
    """"native" when gpumem is PyTorch's own CUDA allocator (a CUDAAllocator subclass),
    "pluggable" when it serves through CUDAPluggableAllocator, None before enable()."""
    return _state.get("route")


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
    # Without trees, PyTorch checks a compiled function's input mutations only at compile
    # time, and only when cudagraph_support_input_mutation is off: with it on, a function that
    # mutates an input (an in-place counter, a cache's position buffer) is captured anyway,
    # the capture's warm-up applies the mutation twice and replays mutate a copy, so results
    # go wrong. Off, such a function runs without CUDA graphs, as trees decide for it too.
    if hasattr(triton, "cudagraph_support_input_mutation"):
        triton.cudagraph_support_input_mutation = False


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


def _refuse_if_cuda_started(torch):
    """PyTorch's allocator cannot be swapped once CUDA has started in this process: say
    so, with what PyTorch already holds, before PyTorch's own terse refusal."""
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return
    held = []
    try:
        for d in range(cuda.device_count()):
            n = cuda.memory_allocated(d)
            if n:
                held.append("%d bytes on cuda:%d" % (n, d))
    except Exception:  # pylint: disable=broad-except
        pass  # the refusal below stands without the figures
    what = ("PyTorch already allocated CUDA memory with its own allocator (%s)"
            % ", ".join(held)) if held else "CUDA is already initialised in this process"
    raise RuntimeError(
        "gpumem.torch.enable: %s; the allocator must be chosen before the first CUDA "
        "allocation. Call enable() before any tensor is put on the GPU, or run the script "
        "with `python -m gpumem run script.py` (or GPUMEM_ENABLE=1 with the package "
        "installed)." % what)


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


def stats(device=None):
    """gpumem's statistics of the device's pool (None: the current device, as torch.cuda's
    functions), as a dict (gpumem_stats fields)."""
    lib = gpumem.load()
    s = gpumem.Stats()
    gpumem._check(lib, lib.gpumem_torch_stats(gpumem._device(_device_index(device)),
                                              ctypes.byref(s)))
    return s.as_dict()


class _BorrowedPool(gpumem.Pool):
    """The plug-in's pool of one device: the Pool interface, never destroyed from Python."""

    def __init__(self, lib, handle):  # pylint: disable=super-init-not-called
        self._lib = lib
        self._handle = ctypes.c_void_p(handle)

    def close(self):
        self._handle = None  # the plug-in owns the pool


def pool(device=None):
    """The plug-in's pool of `device` (None: the current device; created now if PyTorch has
    not allocated there yet), as a gpumem.Pool: counters(), report(), trim(), snapshot(),
    ..."""
    lib = gpumem.load()
    device = _device_index(device)
    handle = lib.gpumem_torch_pool(gpumem._device(device))
    if not handle:
        raise gpumem.GpumemError(gpumem.ERROR_INVALID_ARGUMENT,
                                 "gpumem.torch: no pool for device %d (see stderr)" % device)
    return _BorrowedPool(lib, handle)


def counters(device=None, names=None):
    """Driver calls and page counts of the device's pool (gpumem.Pool.counters)."""
    return pool(device).counters(names)


def explain(device=None):
    """Where the device's pool's reserved bytes go now (gpumem.Pool.explain): call it at
    the peak of a step, or after an out-of-memory, to see what the overhead is made of."""
    return pool(device).explain()


def record_memory_history(enabled="all", context=None, stacks=None, max_entries=100000):
    """Starts (enabled="all" or True) or stops (None or False) recording every allocation,
    free and out-of-memory of the plug-in, as torch.cuda.memory._record_memory_history():
    snapshot() then carries them as the device trace that pytorch.org/memory_viz and
    torch.cuda._memory_viz show. Starting again empties the history. `context` and `stacks`
    are accepted for PyTorch's signature; no call stacks are recorded (frames are empty)."""
    del context, stacks
    lib = gpumem.load()
    on = enabled not in (None, False, "none", "None")
    if on and enabled not in (True, "all", "state"):
        raise ValueError("gpumem.torch.record_memory_history: enabled must be 'all', True, "
                         "None or False, not %r" % (enabled,))
    status = lib.gpumem_torch_record_history(1 if on else 0, int(max_entries) if on else 0)
    if status != gpumem.SUCCESS:
        raise gpumem.InvalidArgumentError(
            status, "gpumem.torch.record_memory_history: max_entries must be 1 .. 2**26, not %r"
            % (max_entries,))


_ACTIONS = {0: ("alloc",), 1: ("free_requested", "free_completed"), 2: ("oom",)}


def _history():
    lib = gpumem.load()
    n = lib.gpumem_torch_history(None, 0)
    events = (gpumem.TorchEvent * max(n, 1))()
    n = min(n, lib.gpumem_torch_history(events, n))
    return events[:n]


def snapshot(path=None, device=None):
    """The device's pool as a PyTorch memory snapshot (the dict torch.cuda.memory._snapshot()
    returns: segments with their blocks, and, after record_memory_history(), the device
    trace of the allocations and frees since); written to `path` as the pickle
    torch.cuda.memory._dump_snapshot() writes, when given. Raises gpumem.NotSupportedError
    where the library has no snapshot exporter."""
    import pickle
    import tempfile

    index = _device_index(device)
    lib = gpumem.load()
    with tempfile.TemporaryDirectory(prefix="gpumem-snapshot-") as folder:
        raw = os.path.join(folder, "pool.pickle")
        gpumem._check(lib, lib.gpumem_torch_snapshot(index, os.fsencode(raw)))
        with open(raw, "rb") as f:
            snap = pickle.load(f)
    traces = snap.setdefault("device_traces", [])
    events = [e for e in _history() if e.device == index]
    if events:
        while len(traces) <= index:
            traces.append([])
        trace = traces[index] = []
        for e in events:
            for action in _ACTIONS.get(e.action, ()):
                entry = {"action": action, "size": int(e.size), "stream": int(e.stream),
                         "time_us": int(e.time_us), "frames": []}
                entry["device_free" if action == "oom" else "addr"] = int(e.addr)
                trace.append(entry)
    if path is not None:
        with open(path, "wb") as f:
            pickle.dump(snap, f, protocol=2)
    return snap


def mark_step():
    """Marks a step boundary of the training or serving loop, on every device's pool: call
    it once per step, at the same point (the top of the loop). Once two steps in a row made
    the same requests, later steps are served from a precomputed layout in one region: no
    search, no driver call, memory at the plan's peak; a step that differs goes to the pool
    from its first difference (see include/gpumem/pool/plan/step_planner.hpp). With
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


# PyTorch's statistics (torch.cuda.memory_stats() and friends) under a gpumem allocator.


def _device_index(device):
    """None (the current device, 0 before torch is imported), an int, "cuda:N", or a
    torch.device."""
    if device is None:
        import sys

        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            return torch.cuda.current_device()
        return 0
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        if device == "cuda":
            return _device_index(None)
        if device.startswith("cuda:") and device[5:].isdigit():
            return int(device[5:])
        raise ValueError("gpumem.torch: %r is not a CUDA device (an int, 'cuda:N' or a "
                         "torch.device)" % (device,))
    index = getattr(device, "index", None)
    if index is not None or getattr(device, "type", None) == "cuda":
        return index if index is not None else _device_index(None)
    raise ValueError("gpumem.torch: %r is not a CUDA device (an int, 'cuda:N' or a "
                     "torch.device)" % (device,))


def _counts(device):
    lib = gpumem.load()
    c = gpumem.TorchCounts()
    status = lib.gpumem_torch_memory_counts(_device_index(device), ctypes.byref(c))
    if status != gpumem.SUCCESS:
        raise gpumem.GpumemError(status, "gpumem.torch: no pool for device %r (see stderr: %s)"
                                 % (device, lib.gpumem_last_error().decode(errors="replace")))
    return c


def memory_stats(device=None):
    """torch.cuda.memory_stats()'s dictionary (sorted keys, PyTorch's names), for the
    device's gpumem pool. Differences from PyTorch's allocator (docs/PYTORCH.md):
      - allocated_bytes / active_bytes count the bytes PyTorch asked for (gpumem's
        rounding shows in reserved_bytes); active == allocated: a freed block is reusable
        in its stream's order at once;
      - inactive_split_bytes.all.current is gpumem's cached bytes (reserved, not handed out);
      - reserved_bytes.all.allocated/freed are the bytes of physical pages created and
        released (vmm_page_pool) and are absent for caching_pool;
      - only the "all" pool: gpumem's arenas are not PyTorch's large/small pools.
    gpumem's own figures come under "gpumem.*"."""
    index = _device_index(device)
    c = _counts(index)
    s = stats(index)
    out = {}

    def put(key, current, peak, allocated, freed):
        out[key + ".all.current"] = int(current)
        out[key + ".all.peak"] = int(peak)
        out[key + ".all.allocated"] = int(allocated)
        out[key + ".all.freed"] = int(freed)

    for key in ("allocated_bytes", "active_bytes", "requested_bytes"):
        put(key, c.requested_bytes, c.requested_bytes_peak, c.requested_bytes_allocated,
            c.requested_bytes_freed)
    for key in ("allocation", "active"):
        put(key, c.allocations, c.allocations_peak, c.allocations_made, c.allocations_freed)
    out["reserved_bytes.all.current"] = int(c.reserved_bytes)
    out["reserved_bytes.all.peak"] = int(c.reserved_bytes_peak)
    out["inactive_split_bytes.all.current"] = int(s["cached_bytes"])
    p = pool(index)
    counters = p.counters(["page_size", "pages_created", "pages_released", "cuMemCreate",
                           "cuMemRelease", "cudaMalloc", "cudaFree"])
    if "page_size" in counters:
        out["reserved_bytes.all.allocated"] = counters["page_size"] * counters["pages_created"]
        out["reserved_bytes.all.freed"] = counters["page_size"] * counters["pages_released"]
    out["num_device_alloc"] = counters.get("cuMemCreate", 0) + counters.get("cudaMalloc", 0)
    out["num_device_free"] = counters.get("cuMemRelease", 0) + counters.get("cudaFree", 0)
    out["num_alloc_retries"] = int(c.alloc_retries)
    out["num_ooms"] = int(c.oom_count)
    out["gpumem.allocator"] = p.allocator
    out["gpumem.platform"] = p.platform
    out["gpumem.fragmentation"] = s["fragmentation"]
    out["gpumem.peak_reserved_bytes_all_time"] = s["peak_reserved_bytes"]
    out["gpumem.reserved_peak_exact"] = bool(c.reserved_peak_exact)
    out["gpumem.peak_resets"] = int(c.resets)
    return dict(sorted(out.items()))


def memory_allocated(device=None):
    """Bytes of the device's live tensors (torch.cuda.memory_allocated())."""
    return _counts(device).requested_bytes


def max_memory_allocated(device=None):
    """Peak of memory_allocated() since the pool's start or the last
    reset_peak_memory_stats() (torch.cuda.max_memory_allocated())."""
    return _counts(device).requested_bytes_peak


def memory_reserved(device=None):
    """Device memory the pool holds from the driver (torch.cuda.memory_reserved())."""
    return _counts(device).reserved_bytes


def max_memory_reserved(device=None):
    """Peak of memory_reserved() (torch.cuda.max_memory_reserved()). After a reset it is
    exact when the pool reached a new all-time peak since; else a lower bound
    (memory_stats()["gpumem.reserved_peak_exact"] says which)."""
    return _counts(device).reserved_bytes_peak


def set_per_process_memory_fraction(fraction, device=None):
    """The device pool's budget becomes `fraction` of the device's memory (1: none): short
    of it, the pool gathers its free pages rather than growing. torch.cuda's own function
    does this under the native route; under the pluggable one, call this."""
    fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:
        raise gpumem.InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                          "the fraction %r is not in [0, 1]" % fraction)
    lib = gpumem.load()
    gpumem._check(lib, lib.gpumem_torch_set_memory_fraction(_device_index(device), fraction))


def reset_peak_memory_stats(device=None):
    """Peaks restart from the current values (torch.cuda.reset_peak_memory_stats())."""
    lib = gpumem.load()
    status = lib.gpumem_torch_reset_peak(_device_index(device))
    if status != gpumem.SUCCESS:
        raise gpumem.GpumemError(status, "gpumem.torch: no pool for device %r" % (device,))


def _scaled(n, scale, units, step, limit, width):
    """n in the unit that keeps `scale` (the row's largest value) under limit, as PyTorch's
    memory_summary formats its columns."""
    unit = 0
    while unit + 1 < len(units) and scale >= limit:
        n //= step
        scale /= step
        unit += 1
    return "%*d %s" % (width, n, units[unit])


def _format_bytes(n, scale):
    return _scaled(n, scale, ("B  ", "KiB", "MiB", "GiB", "TiB", "PiB"), 1024, 768 * 1024, 6)


def _format_count(n, scale):
    return _scaled(n, scale, (" ", "K", "M"), 1000, 750 * 1000, 7) + " "


def memory_summary(device=None, abbreviated=False):  # pylint: disable=unused-argument
    """A text table of memory_stats(), laid out as torch.cuda.memory_summary()'s (figures
    gpumem does not keep show as "-"), then gpumem's own lines."""
    index = _device_index(device)
    st = memory_stats(index)
    rows = (("allocated_bytes", "Allocated memory", _format_bytes),
            ("active_bytes", "Active memory", _format_bytes),
            ("requested_bytes", "Requested memory", _format_bytes),
            ("reserved_bytes", "GPU reserved memory", _format_bytes),
            ("inactive_split_bytes", "Non-releasable memory", _format_bytes),
            ("allocation", "Allocations", _format_count),
            ("active", "Active allocs", _format_count))
    rule, heavy = "-" * 75, "=" * 75
    lines = [heavy,
             "%s gpumem CUDA memory summary, device ID %-17d" % (" " * 17, index),
             rule,
             "  %s CUDA OOMs: %-12d | %s cudaMalloc retries: %-8d  "
             % (" " * 9, st["num_ooms"], " " * 6, st["num_alloc_retries"]),
             heavy,
             "        Metric         | Cur Usage  | Peak Usage | Tot Alloc  | Tot Freed  "]
    for key, name, fmt in rows:
        lines.append(rule)
        values = [st.get("%s.all.%s" % (key, part)) for part in
                  ("current", "peak", "allocated", "freed")]
        scale = max([v for v in values if v is not None] or [0])
        cells = [fmt(v, scale) if v is not None else "%10s " % "-" for v in values]
        lines.append(" %-21s | %s| %s| %s| %s" % (name, cells[0], cells[1], cells[2], cells[3]))
    lines.append(rule)
    lines.append(" Allocator: %s on %s; peak reserved / peak requested: %.4f"
                 % (st["gpumem.allocator"], st["gpumem.platform"],
                    st["gpumem.fragmentation"]))
    lines.append(" Device allocations / frees (driver): %d / %d"
                 % (st["num_device_alloc"], st["num_device_free"]))
    lines.append(heavy)
    return "\n".join(lines) + "\n"


# --- tags, sleep and wake (gpumem.h) --------------------------------------------------------

class tag:  # pylint: disable=invalid-name
    """`with gpumem.torch.tag("weights"): model = build()` places the tensors allocated
    inside (by this thread, through the plug-in) in the tag's own pages, so they can sleep
    and wake together (sleep, wake) or, for the tag "shared", be shared with other
    processes (gpumem.ipc). Untagged allocations keep tag 0. Nests.

    `all_threads=True` also makes it the process tag for the block: threads that never
    chose a tag, autograd's backward thread among them, allocate in it too, so
    `with tag("train", all_threads=True): loss.backward()` keeps the backward's memory in
    "train". Blocks with all_threads must not overlap across threads."""

    def __init__(self, name, all_threads=False):
        self.id = gpumem.tag_id(name)
        self.all_threads = bool(all_threads)
        self._previous = None
        self._previous_process = None

    def __enter__(self):
        lib = gpumem.load()
        if self.all_threads:
            self._previous_process = lib.gpumem_set_process_tag(self.id)
        self._previous = lib.gpumem_set_current_tag(self.id)
        return self

    def __exit__(self, *exc):
        lib = gpumem.load()
        lib.gpumem_set_current_tag(self._previous)
        if self.all_threads:
            lib.gpumem_set_process_tag(self._previous_process)
        return False


def _current_stream(device):
    import torch  # pylint: disable=import-outside-toplevel
    return torch.cuda.current_stream(device).cuda_stream


def sleep(tag_name, mode="offload", device=None):
    """Gives the tag's device memory back to the driver, keeping every address: 'offload'
    copies the bytes to pinned host memory first, 'discard' drops them (the KV cache).
    Waits for the device's work first. Tensors, pointers and CUDA graphs made before stay
    valid after wake(); allocating in the tag meanwhile raises gpumem.InvalidArgumentError.
    The private memory of CUDA graphs (and MemPools) made inside `with tag(tag_name)`
    sleeps and wakes with the tag: a graph captured there replays after wake()."""
    import torch  # pylint: disable=import-outside-toplevel
    index = _device_index(device)
    torch.cuda.synchronize(index)
    # PyTorch keeps a cuBLAS workspace per (handle, stream), made from the allocator at
    # the first matrix product on that stream: under whatever tag was current then. Such
    # a workspace outlives the scope, and every later product on the stream writes it, so
    # it must never sleep. Released here, it is made again at the next product, under the
    # tag current then. (PyTorch's CUDA graph trees release them the same way; a captured
    # graph keeps its own workspace in its private pool.)
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)  # pylint: disable=protected-access
    if clear is not None:
        clear()
        torch.cuda.synchronize(index)
    lib = gpumem.load()
    gpumem._check(lib, lib.gpumem_torch_sleep(  # pylint: disable=protected-access
        gpumem._device(index), gpumem.tag_id(tag_name),  # pylint: disable=protected-access
        gpumem._sleep_mode(mode), _current_stream(index)))  # pylint: disable=protected-access


def wake(tag_name, device=None):
    """Maps new pages at the tag's addresses and restores its offloaded bytes, ordered on
    the current stream before any work queued after it; the tag's CUDA graph pools too."""
    index = _device_index(device)
    lib = gpumem.load()
    gpumem._check(lib, lib.gpumem_torch_wake(  # pylint: disable=protected-access
        gpumem._device(index), gpumem.tag_id(tag_name),  # pylint: disable=protected-access
        _current_stream(index)))


def _tag_query(entry, tag_name, device):
    lib = gpumem.load()
    r = getattr(lib, entry)(gpumem._device(_device_index(device)),  # pylint: disable=protected-access
                            gpumem.tag_id(tag_name))
    if r < 0:
        gpumem._raise(lib, lib.gpumem_last_status())  # pylint: disable=protected-access
    return bool(r)


def asleep(tag_name, device=None):
    """Whether the tag sleeps on the device (sleep() done, wake() not yet): its pages or the
    private pools of the CUDA graphs made under it."""
    return _tag_query("gpumem_torch_tag_asleep", tag_name, device)


def tag_used(tag_name, device=None):
    """Whether sleep() finds anything of the tag: it was allocated in, or CUDA graphs (or
    MemPools) were made under it."""
    return _tag_query("gpumem_torch_tag_used", tag_name, device)


def awake(tag_name, then="offload", device=None):
    """`with gpumem.torch.awake("optim"): opt.step()` wakes the tag if it sleeps, makes it
    the current tag for the block (as tag(): what the block allocates lands in it, so the
    optimizer's first step makes its states there), and puts it to sleep again in mode
    `then` when the block ends or raises ("offload", "discard", or None to leave it awake).
    A wake with no room raises OutOfMemoryError from the `with` line, the tag still asleep
    with its bytes on the host. The context's `woke` says whether the tag slept."""
    index = _device_index(device)
    scope = tag(tag_name)
    return gpumem._AwakeFor(  # pylint: disable=protected-access
        lambda: asleep(tag_name, index), lambda: wake(tag_name, index),
        lambda mode: sleep(tag_name, mode, index), then,
        enter=scope.__enter__, leave=lambda: scope.__exit__(None, None, None))


def set_keep_free(nbytes, device=None):
    """Device memory every new physical handle leaves free (the driver's free bytes), in
    every tag and in the private pools of CUDA graphs, as GPUMEM_CONF's keep_free (0:
    none): memory kept for other processes and libraries. A growth past it gathers free
    pages or raises torch's out-of-memory error; a wake past it raises OutOfMemoryError
    and leaves the tag asleep."""
    lib = gpumem.load()
    gpumem._check(lib, lib.gpumem_torch_set_keep_free(  # pylint: disable=protected-access
        gpumem._device(_device_index(device)),  # pylint: disable=protected-access
        gpumem._unsigned(nbytes, "bytes", 64)))  # pylint: disable=protected-access


def tag_stats(tag_name, device=None):
    """Live and reserved bytes of one tag."""
    return pool(_device_index(device)).tag_stats(tag_name)


def _host_call(entry, tag_name, device):
    lib = gpumem.load()
    out = ctypes.c_uint64()
    gpumem._check(lib, getattr(lib, entry)(  # pylint: disable=protected-access
        gpumem._device(_device_index(device)),  # pylint: disable=protected-access
        gpumem.tag_id(tag_name), ctypes.byref(out)))
    return out.value


def host_bytes(tag_name, device=None):
    """Pinned host bytes the tag holds for its offload sleeps, the private pools of its CUDA
    graphs included: the same blocks across sleep / wake cycles, until release_host()."""
    return _host_call("gpumem_torch_host_bytes", tag_name, device)


def release_host(tag_name, device=None):
    """Gives the tag's pinned host memory (that of its offload sleeps, the private pools of
    its CUDA graphs included) back now; returns the bytes released. Raises
    gpumem.InvalidArgumentError while the tag sleeps with offload (wake it first)."""
    return _host_call("gpumem_torch_release_host", tag_name, device)
