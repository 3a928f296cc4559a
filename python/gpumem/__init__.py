"""gpumem from Python, through ctypes: no compiled extension, no dependency.

    import gpumem
    pool = gpumem.Pool("limit:1G", allocator="vmm_page_pool", platform="sim")
    p = pool.malloc(1 << 20)
    pool.free(p, 1 << 20)
    print(pool.stats()["peak_reserved_bytes"])

`gpumem.load()` finds libgpumem_torch.so (it carries the C API of include/gpumem/interop/
gpumem.h as well as the PyTorch entry points): the `path` given, else $GPUMEM_LIB, else
the one bundled in this package (`pip install .`), else a build directory of the source
tree (build*/src/interop/), else the dynamic linker's search path. `gpumem.torch` plugs
gpumem into PyTorch; `python -m gpumem run script.py` runs a script with it.

Every failure of the C API raises a GpumemError subclass carrying the status code and
gpumem's own text (for OutOfMemoryError, the full out-of-memory report).
"""

import ctypes
import glob
import os
import threading
import warnings

__all__ = [
    "load", "library_path", "c_library_path", "version", "check_config", "Pool", "Stats",
    "GpumemError", "InvalidArgumentError", "OutOfMemoryError", "CudaError",
    "NotSupportedError", "InternalError",
]

LIBRARY_NAME = "libgpumem_torch.so"

SUCCESS = 0
ERROR_INVALID_ARGUMENT = 1
ERROR_OUT_OF_MEMORY = 2
ERROR_CUDA = 3
ERROR_NOT_SUPPORTED = 4
ERROR_INTERNAL = 5


class GpumemError(Exception):
    """A gpumem C API failure: `status` is the gpumem_status code, str() gpumem's text."""

    def __init__(self, status, message):
        super().__init__(message)
        self.status = status


class InvalidArgumentError(GpumemError, ValueError):
    pass


class OutOfMemoryError(GpumemError, MemoryError):
    pass


class CudaError(GpumemError, RuntimeError):
    pass


class NotSupportedError(GpumemError, NotImplementedError):
    pass


class InternalError(GpumemError, RuntimeError):
    pass


_ERRORS = {
    ERROR_INVALID_ARGUMENT: InvalidArgumentError,
    ERROR_OUT_OF_MEMORY: OutOfMemoryError,
    ERROR_CUDA: CudaError,
    ERROR_NOT_SUPPORTED: NotSupportedError,
    ERROR_INTERNAL: InternalError,
}


class Stats(ctypes.Structure):
    """gpumem_stats of gpumem.h, field for field."""

    _fields_ = [
        ("live_bytes", ctypes.c_uint64),
        ("peak_live_bytes", ctypes.c_uint64),
        ("live_allocations", ctypes.c_uint64),
        ("reserved_bytes", ctypes.c_uint64),
        ("peak_reserved_bytes", ctypes.c_uint64),
        ("cached_bytes", ctypes.c_uint64),
        ("allocations", ctypes.c_uint64),
        ("deallocations", ctypes.c_uint64),
        ("alloc_retries", ctypes.c_uint64),
        ("oom_count", ctypes.c_uint64),
        ("cross_stream_waits", ctypes.c_uint64),
        ("fragmentation", ctypes.c_double),
    ]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class TorchCounts(ctypes.Structure):
    """gpumem_torch_counts of gpumem_torch.h, field for field."""

    _fields_ = [(name, ctypes.c_uint64) for name in (
        "requested_bytes", "requested_bytes_peak", "requested_bytes_allocated",
        "requested_bytes_freed", "allocations", "allocations_peak", "allocations_made",
        "allocations_freed", "reserved_bytes", "reserved_bytes_peak", "reserved_peak_exact",
        "alloc_retries", "oom_count", "resets")]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


class TorchEvent(ctypes.Structure):
    """gpumem_torch_event of gpumem_torch.h."""

    _fields_ = [("action", ctypes.c_int32), ("device", ctypes.c_int32),
                ("addr", ctypes.c_uint64), ("size", ctypes.c_uint64),
                ("stream", ctypes.c_uint64), ("time_us", ctypes.c_int64)]


# What counters() reads by default: the driver calls that move physical memory, the event
# calls of stream-ordered reuse, the time in the mapping calls (ns), and vmm_page_pool's
# page counts.
COUNTERS = ("cuMemCreate", "cuMemRelease", "cuMemMap", "cuMemUnmap", "cuMemSetAccess",
            "cudaMalloc", "cudaFree", "cudaEventRecord", "cudaEventQuery",
            "cudaStreamSynchronize", "cuMemCreate.ns", "cuMemMap.ns", "cuMemUnmap.ns",
            "cuMemSetAccess.ns", "cudaMalloc.ns", "driver_ns", "pages_mapped", "pages_spare",
            "pages_created", "pages_reclaimed", "pages_released", "remap_ns",
            "growth_slack_permille", "slack_raises", "long_lived_allocations",
            "long_lived_pages_moved", "lifetime_hints_active", "long_lived_bytes_handed_over",
            "plan_marks", "plans_built", "planned_steps",
            "steps_left_plan", "steps_rejoined", "planned_allocations", "plan_region_takes",
            "plan_regions_handed_over", "plan_region_bytes", "plan_lower_bound")

_lock = threading.Lock()
_lib = None
_lib_path = None


def _candidates(path):
    if path:
        yield path
        return
    env = os.environ.get("GPUMEM_LIB")
    if env:
        yield env
        return
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.join(here, LIBRARY_NAME)
    root = os.path.dirname(os.path.dirname(here))  # python/gpumem -> the source tree
    built = glob.glob(os.path.join(root, "build*", "src", "interop", LIBRARY_NAME))
    for found in sorted(built, key=os.path.getmtime, reverse=True):
        yield found
    # Installed: PREFIX/share/gpumem/python/gpumem -> PREFIX/lib*/libgpumem_torch.so
    prefix = os.path.abspath(os.path.join(here, "..", "..", "..", ".."))
    for found in sorted(glob.glob(os.path.join(prefix, "lib*", LIBRARY_NAME)) +
                        glob.glob(os.path.join(prefix, "lib", "*", LIBRARY_NAME))):
        yield found
    yield LIBRARY_NAME  # the dynamic linker's search path


def _declare(lib):
    c = ctypes
    pool_p = c.c_void_p
    sigs = {
        "gpumem_version": (c.c_char_p, []),
        "gpumem_version_number": (c.c_int, []),
        "gpumem_last_error": (c.c_char_p, []),
        "gpumem_last_status": (c.c_int, []),
        "gpumem_status_name": (c.c_char_p, [c.c_int]),
        "gpumem_pool_create": (c.c_int, [c.c_char_p, c.POINTER(pool_p)]),
        "gpumem_pool_destroy": (c.c_int, [pool_p]),
        "gpumem_malloc": (c.c_void_p, [pool_p, c.c_size_t, c.c_void_p]),
        "gpumem_allocate": (c.c_int, [pool_p, c.c_size_t, c.c_size_t, c.c_void_p,
                                      c.POINTER(c.c_void_p)]),
        "gpumem_free": (c.c_int, [pool_p, c.c_void_p, c.c_size_t, c.c_void_p]),
        "gpumem_record_stream": (c.c_int, [pool_p, c.c_void_p, c.c_void_p]),
        "gpumem_pool_stats": (c.c_int, [pool_p, c.POINTER(Stats)]),
        "gpumem_pool_counter": (c.c_int, [pool_p, c.c_char_p, c.POINTER(c.c_uint64)]),
        "gpumem_pool_trim": (c.c_int, [pool_p, c.POINTER(c.c_uint64)]),
        "gpumem_pool_set_budget": (c.c_int, [pool_p, c.c_uint64, c.POINTER(c.c_uint64)]),
        "gpumem_pool_set_keep_free": (c.c_int, [pool_p, c.c_uint64]),
        "gpumem_pool_mark_step": (c.c_int, [pool_p]),
        "gpumem_pool_allocator": (c.c_char_p, [pool_p]),
        "gpumem_pool_platform": (c.c_char_p, [pool_p]),
        "gpumem_pool_device": (c.c_int, [pool_p]),
        "gpumem_pool_config": (c.c_char_p, [pool_p]),
        "gpumem_pool_report": (c.c_size_t, [pool_p, c.c_size_t, c.c_char_p, c.c_size_t]),
        "gpumem_pool_explain": (c.c_size_t, [pool_p, c.c_char_p, c.c_size_t]),
        "gpumem_stream_create": (c.c_int, [pool_p, c.POINTER(c.c_void_p)]),
        "gpumem_stream_destroy": (c.c_int, [pool_p, c.c_void_p]),
        "gpumem_stream_synchronize": (c.c_int, [pool_p, c.c_void_p]),
        "gpumem_stream_device": (c.c_int, [pool_p, c.c_void_p, c.POINTER(c.c_int)]),
        "gpumem_snapshot": (c.c_int, [pool_p, c.c_char_p]),
        "gpumem_set_current_tag": (c.c_uint32, [c.c_uint32]),
        "gpumem_current_tag": (c.c_uint32, []),
        "gpumem_name_tag": (c.c_int, [c.c_uint32, c.c_char_p]),
        "gpumem_set_process_tag": (c.c_uint32, [c.c_uint32]),
        "gpumem_allocate_tagged": (c.c_int, [pool_p, c.c_size_t, c.c_size_t, c.c_void_p,
                                             c.c_uint32, c.POINTER(c.c_void_p)]),
        "gpumem_sleep": (c.c_int, [pool_p, c.c_uint32, c.c_int, c.c_void_p]),
        "gpumem_wake": (c.c_int, [pool_p, c.c_uint32, c.c_void_p]),
        "gpumem_tag_asleep": (c.c_int, [pool_p, c.c_uint32]),
        "gpumem_tag_stats": (c.c_int, [pool_p, c.c_uint32, c.POINTER(Stats)]),
        "gpumem_tag_host_bytes": (c.c_int, [pool_p, c.c_uint32, c.POINTER(c.c_uint64)]),
        "gpumem_release_host": (c.c_int, [pool_p, c.c_uint32, c.POINTER(c.c_uint64)]),
        "gpumem_device_memory": (c.c_int, [pool_p, c.POINTER(c.c_size_t),
                                           c.POINTER(c.c_size_t)]),
        "gpumem_export": (c.c_int, [pool_p, c.c_void_p, c.POINTER(c.c_int)]),
        "gpumem_import": (c.c_int, [pool_p, c.c_int, c.c_size_t, c.POINTER(c.c_void_p)]),
        "gpumem_torch_pool": (pool_p, [c.c_int]),
        "gpumem_torch_pool_exists": (c.c_int, [c.c_int]),
        "gpumem_torch_stats": (c.c_int, [c.c_int, c.POINTER(Stats)]),
        "gpumem_torch_sleep": (c.c_int, [c.c_int, c.c_uint32, c.c_int, c.c_void_p]),
        "gpumem_torch_wake": (c.c_int, [c.c_int, c.c_uint32, c.c_void_p]),
        "gpumem_torch_tag_asleep": (c.c_int, [c.c_int, c.c_uint32]),
        "gpumem_torch_set_keep_free": (c.c_int, [c.c_int, c.c_uint64]),
        "gpumem_torch_tag_used": (c.c_int, [c.c_int, c.c_uint32]),
        "gpumem_torch_host_bytes": (c.c_int, [c.c_int, c.c_uint32, c.POINTER(c.c_uint64)]),
        "gpumem_torch_release_host": (c.c_int, [c.c_int, c.c_uint32, c.POINTER(c.c_uint64)]),
        "gpumem_torch_snapshot": (c.c_int, [c.c_int, c.c_char_p]),
        "gpumem_torch_empty_cache": (c.c_ulonglong, []),
        "gpumem_torch_failures": (c.c_ulonglong, []),
        "gpumem_torch_oom_is_torch_type": (c.c_int, []),
        "gpumem_torch_record_stream_on": (c.c_int, [c.c_int, c.c_void_p, c.c_void_p]),
        "gpumem_torch_mark_step": (c.c_int, []),
        "gpumem_torch_graph_pools": (None, [c.POINTER(c.c_ulonglong)] * 3),
        "gpumem_torch_memory_counts": (c.c_int, [c.c_int, c.POINTER(TorchCounts)]),
        "gpumem_torch_reset_peak": (c.c_int, [c.c_int]),
        "gpumem_torch_set_memory_fraction": (c.c_int, [c.c_int, c.c_double]),
        "gpumem_torch_record_history": (c.c_int, [c.c_int, c.c_size_t]),
        "gpumem_torch_history": (c.c_size_t, [c.POINTER(TorchEvent), c.c_size_t]),
        "gpumem_torch_recording": (c.c_int, []),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def load(path=None):
    """Loads libgpumem_torch.so once (see the module text for where it is looked for)."""
    global _lib, _lib_path
    with _lock:
        if _lib is not None and (path is None or os.path.realpath(path) == _lib_path):
            return _lib
        tried = []
        for candidate in _candidates(path):
            resolved = os.path.realpath(candidate) if os.sep in candidate else candidate
            if os.sep in candidate and not os.path.exists(resolved):
                tried.append(candidate + " (absent)")
                continue
            try:
                lib = ctypes.CDLL(resolved)
            except OSError as e:
                tried.append("%s (%s)" % (candidate, e))
                continue
            _declare(lib)
            _lib, _lib_path = lib, resolved
            _name_tags(lib)
            return lib
        raise OSError("gpumem: cannot load %s; tried: %s. Build it (target gpumem_torch) "
                      "or set GPUMEM_LIB." % (LIBRARY_NAME, "; ".join(tried)))


def library_path():
    """The path of the loaded library (loading it first)."""
    load()
    return _lib_path


def c_library_path():
    """libgpumem.so installed inside this package (pip install), else None: the shared
    library for C and C++ programs (headers and CMake files come with `cmake --install`)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "libgpumem.so")
    return path if os.path.exists(path) else None


# The C API's own configuration keys (gpumem.h, the option table's gpumem_pool_create
# rows), beside the pool options.
C_API_KEYS = ("allocator", "backend", "platform", "device", "step_plan", "sim_capacity",
              "sim_devices", "sim_granularity", "sim_no_peer")


def _names_key(config, key):
    return any(item.split(":", 1)[0].strip() == key for item in config.split(",") if item.strip())


def check_config(config):
    """Raises InvalidArgumentError naming the bad key or value (and the valid keys) when the
    GPUMEM_CONF string `config` would be refused; parses it on a small private sim device
    (with 64 GPUs unless it names sim_devices, so peer_access and a device of a multi-GPU
    machine are checked as text), so no GPU is touched. Failures that are not about the
    text (memory, a device the probe lacks) are not raised."""
    if not config:
        return
    items = [item for item in config.split(",")
             if item.strip() and item.split(":", 1)[0].strip() != "device"]
    probe = ",".join(items + ["platform:sim", "sim_capacity:64M"] +
                     ([] if _names_key(config, "sim_devices") else ["sim_devices:64"]))
    try:
        Pool(probe).close()
    except InvalidArgumentError as e:
        text = str(e)
        if "config:" not in text and "unknown" not in text:
            return
        raise InvalidArgumentError(e.status, "gpumem: bad configuration %r: %s" % (config, text))
    except GpumemError:
        pass  # e.g. reserve: larger than the probe's device: not a fault of the text


def version():
    return load().gpumem_version().decode()


def _raise(lib, status):
    text = lib.gpumem_last_error().decode(errors="replace")
    raise _ERRORS.get(status, GpumemError)(status, text)


def _check(lib, status):
    if status != SUCCESS:
        _raise(lib, status)


_POINTER_BITS = 8 * ctypes.sizeof(ctypes.c_void_p)
_SIZE_BITS = 8 * ctypes.sizeof(ctypes.c_size_t)
_INT_BITS = 8 * ctypes.sizeof(ctypes.c_int)


def _unsigned(value, what, bits):
    """`value` as a Python int in [0, 2**bits): ctypes would wrap anything else silently
    (2**64 + 100 becomes 100, -1 becomes 2**64 - 1). TypeError for a non-integer (a float,
    a str, a bool), ValueError for a negative value, OverflowError past the C type."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError("gpumem: %s must be an integer, not %s" % (what, type(value).__name__))
    value = value.__index__()
    if value < 0:
        raise ValueError("gpumem: %s must not be negative, got %d" % (what, value))
    if value >= 1 << bits:
        raise OverflowError("gpumem: %s %d does not fit in %d bits (at most %d)"
                            % (what, value, bits, (1 << bits) - 1))
    return value


def _size(value, what="size"):
    return _unsigned(value, what, _SIZE_BITS)


def _pointer(value, what="pointer"):
    """A device address as int (None: NULL)."""
    if value is None:
        return None
    return _unsigned(value, what, _POINTER_BITS) or None


def _device(value):
    return _unsigned(value, "device", _INT_BITS - 1)


def _text(value, what):
    """A str for the C API: no NUL inside (C would stop reading there)."""
    if not isinstance(value, str):
        raise TypeError("gpumem: %s must be a str, not %s" % (what, type(value).__name__))
    if "\0" in value:
        raise ValueError("gpumem: %s contains a NUL character at index %d (C would ignore "
                         "what follows it): %r" % (what, value.index("\0"), value))
    return value


def _path(path):
    """A file path as bytes for the C API, refusing a NUL inside."""
    raw = os.fsencode(path)
    if b"\0" in raw:
        raise ValueError("gpumem: path contains a NUL character: %r" % (path,))
    return raw


def _stream_value(stream):
    """A cudaStream_t as int: None/0 (default stream), an int, or anything with
    .cuda_stream (torch.cuda.Stream) or .ptr (cupy). TypeError for anything else (a
    float, a str), ValueError for a negative value, OverflowError past a pointer: ctypes
    would otherwise pass a wrapped or truncated value the pool could not use."""
    if stream is None:
        return None
    for attr in ("cuda_stream", "ptr"):
        if hasattr(stream, attr):
            return _pointer(getattr(stream, attr), "stream (.%s)" % attr)
    return _pointer(stream, "stream")


# Tags (gpumem.h): 0 is untagged; SHARED_TAG holds memory shared between processes.
SHARED_TAG = 0xFFFFFFFF
SLEEP_MODES = {"offload": 0, "discard": 1}
MAX_TAG_NAME = 64  # gpumem_name_tag's limit
_tag_ids = {"shared": SHARED_TAG}
_tag_lock = threading.Lock()


def tag_id(tag):
    """A tag as the C API's integer: an int as is (0 .. 2**32-1), a name ("weights", "kv")
    the same number every time in this process (names are numbered from 1 in the order
    first seen; "shared" is SHARED_TAG). The library knows a name from its first use, so
    reports and errors show "weights (1)". A name is 1 to 64 characters of printable
    ASCII; another raises ValueError and gets no number."""
    if isinstance(tag, str):
        _text(tag, "tag name")
        with _tag_lock:
            if tag not in _tag_ids:
                used = set(_tag_ids.values())
                n = 1
                while n in used:
                    n += 1
                if not 1 <= len(tag) <= MAX_TAG_NAME or \
                        any(not " " <= ch <= "~" for ch in tag):
                    raise ValueError("gpumem: a tag name has 1 to %d characters of printable "
                                     "ASCII, not %r" % (MAX_TAG_NAME, tag))
                if _lib is not None:
                    _check(_lib, _lib.gpumem_name_tag(n, tag.encode()))
                _tag_ids[tag] = n
            return _tag_ids[tag]
    return _unsigned(tag, "tag", 32)


def _name_tags(lib):
    """Gives a library loaded after tags were named those names."""
    with _tag_lock:
        for name, n in _tag_ids.items():
            if n != SHARED_TAG:
                lib.gpumem_name_tag(n, name.encode())


def _sleep_mode(mode):
    if isinstance(mode, str):
        if mode not in SLEEP_MODES:
            raise ValueError("gpumem: sleep mode must be 'offload' or 'discard', got %r" % mode)
        return SLEEP_MODES[mode]
    if mode not in (0, 1) or isinstance(mode, bool):
        raise ValueError("gpumem: sleep mode must be 0 (offload) or 1 (discard), got %r" % (mode,))
    return mode


class _Closing:
    """close() by `with` and at garbage collection. Nothing can be raised there: a close
    refused then (a pool a KV cache still stands on, collected in one cycle with it) is a
    ResourceWarning naming the object and the reason, and what it held stays held until the
    process ends."""

    def close(self):
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception as e:  # pylint: disable=broad-except
            try:
                warnings.warn("gpumem: %s not closed at garbage collection: %s"
                              % (type(self).__name__, e), ResourceWarning, stacklevel=2)
            except Exception:  # pylint: disable=broad-except
                pass  # interpreter shutdown: warnings may be gone


class _AwakeFor:
    """The block a tag is awake for (Pool.awake, gpumem.torch.awake): entering wakes it if
    it sleeps; leaving, by the block's end or by an exception, puts it to sleep in mode
    `then` (None: it stays awake). A wake that fails (no room: OutOfMemoryError, the
    bytes still on the host) raises from the `with` line and runs nothing of the block.
    `enter`/`leave` run inside the wake and the sleep (the torch version makes the tag
    current there)."""

    def __init__(self, asleep, wake, sleep, then, enter=None, leave=None):
        if then is not None:
            _sleep_mode(then)  # refused now, not after the block ran
        self._asleep, self._wake, self._sleep, self._then = asleep, wake, sleep, then
        self._enter, self._leave = enter, leave
        self.woke = False

    def __enter__(self):
        self.woke = bool(self._asleep())
        if self.woke:
            self._wake()
        if self._enter is not None:
            self._enter()
        return self

    def __exit__(self, *exc):
        if self._leave is not None:
            self._leave()
        if self._then is not None:
            self._sleep(self._then)
        return False


class Pool(_Closing):
    """A gpumem pool (gpumem_pool_create). `config` is a GPUMEM_CONF string; allocator,
    device and platform, when given, are added to it as the C API's keys. A pool serves one
    device: make one per GPU (device=N); its pointers and streams are that device's, and
    another device's are refused. Peers reach a vmm_page_pool's memory with the
    peer_access option ("peer_access:1" or "peer_access:all")."""

    def __init__(self, config="", allocator=None, device=None, platform=None, lib=None):
        if config is None:
            config = ""
        _text(config, "config")
        parts = [config] if config else []
        if allocator is not None:
            parts.append("allocator:%s" % _text(allocator, "allocator"))
        if platform is not None:
            parts.append("platform:%s" % _text(platform, "platform"))
        if device is not None:
            parts.append("device:%d" % _device(device))
        self._lib = lib if lib is not None else load()
        handle = ctypes.c_void_p()
        _check(self._lib, self._lib.gpumem_pool_create(",".join(parts).encode(),
                                                       ctypes.byref(handle)))
        self._handle = handle

    @property
    def handle(self):
        if self._handle is None:
            raise InvalidArgumentError(ERROR_INVALID_ARGUMENT, "gpumem: the pool is closed")
        return self._handle

    def close(self):
        """Destroys the pool: every byte goes back to the driver, live allocations too.
        InvalidArgumentError, the pool left open, while a KV cache or VirtualSequences
        (gpumem.kv) still stands on it: close those first."""
        if self._handle is not None:
            _check(self._lib, self._lib.gpumem_pool_destroy(self._handle))
            self._handle = None

    def malloc(self, size, stream=None, alignment=256):
        """Device address (int) of `size` bytes usable in order on `stream`."""
        out = ctypes.c_void_p()
        size, alignment = _size(size), _size(alignment, "alignment")
        stream = _stream_value(stream)
        _check(self._lib, self._lib.gpumem_allocate(self.handle, size, alignment, stream,
                                                    ctypes.byref(out)))
        return out.value

    def free(self, ptr, size, stream=None):
        ptr, size, stream = _pointer(ptr), _size(size), _stream_value(stream)
        _check(self._lib, self._lib.gpumem_free(self.handle, ptr, size, stream))

    def record_stream(self, ptr, stream):
        ptr, stream = _pointer(ptr), _stream_value(stream)
        _check(self._lib, self._lib.gpumem_record_stream(self.handle, ptr, stream))

    def stats(self):
        s = Stats()
        _check(self._lib, self._lib.gpumem_pool_stats(self.handle, ctypes.byref(s)))
        return s.as_dict()

    def counter(self, name):
        """A diagnostic counter: this pool's CUDA calls by name ("cuMemMap", ...), the
        nanoseconds spent in them ("cuMemMap.ns", "driver_ns" for all), or vmm_page_pool's
        page counts ("pages_created", ...); see gpumem_pool_counter in gpumem.h."""
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_pool_counter(self.handle,
                                                        _text(name, "counter name").encode(),
                                                        ctypes.byref(out)))
        return out.value

    def counters(self, names=None):
        """Several counters as a dict; by default the mapping calls and page counts."""
        names = names or COUNTERS
        result = {}
        for name in names:
            try:
                result[name] = self.counter(name)
            except InvalidArgumentError:
                pass  # a counter this allocator does not have
        return result

    def mark_step(self):
        """A step boundary of a loop that repeats its requests: after two equal steps, the
        next are served from a precomputed layout (gpumem_pool_mark_step in gpumem.h)."""
        _check(self._lib, self._lib.gpumem_pool_mark_step(self.handle))

    def trim(self):
        released = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_pool_trim(self.handle, ctypes.byref(released)))
        return released.value

    def set_keep_free(self, nbytes):
        """Device memory every new physical handle of the pool (every tag) leaves free, as
        the option keep_free (0: none): a growth past it gathers or raises OutOfMemoryError,
        a wake past it leaves the tag asleep with its bytes on the host."""
        _check(self._lib, self._lib.gpumem_pool_set_keep_free(self.handle, _unsigned(nbytes, "bytes", 64)))

    def report(self, size=0):
        """The out-of-memory report the pool would give for a request of `size` bytes."""
        size = _size(size)
        n = self._lib.gpumem_pool_report(self.handle, size, None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.gpumem_pool_report(self.handle, size, buf, n + 1)
        return buf.value.decode(errors="replace")

    def explain(self):
        """Where the pool's reserved bytes go now, one part a line: requested, rounding (and
        the request sizes whose rounding costs most), freed blocks held unmerged, free bytes
        sharing a page with live blocks, free whole pages, pages kept unmapped."""
        n = self._lib.gpumem_pool_explain(self.handle, None, 0)
        if n == 0:
            _raise(self._lib, self._lib.gpumem_last_status())
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.gpumem_pool_explain(self.handle, buf, n + 1)
        return buf.value.decode(errors="replace")

    def snapshot(self, path):
        _check(self._lib, self._lib.gpumem_snapshot(self.handle, _path(path)))

    # --- tags, sleep / wake, sharing (gpumem.h) ------------------------------------------
    def malloc_tagged(self, size, tag, stream=None, alignment=256):
        """An allocation in `tag` (an int or a name, see tag_id)."""
        out = ctypes.c_void_p()
        _check(self._lib, self._lib.gpumem_allocate_tagged(
            self.handle, _size(size), _size(alignment, "alignment"), _stream_value(stream),
            tag_id(tag), ctypes.byref(out)))
        return out.value

    def sleep(self, tag, mode="offload", stream=None):
        """Releases every page of `tag` keeping its addresses (offload: bytes to the host)."""
        _check(self._lib, self._lib.gpumem_sleep(self.handle, tag_id(tag), _sleep_mode(mode),
                                                 _stream_value(stream)))

    def wake(self, tag, stream=None):
        """Maps new pages at the same addresses and restores the offloaded bytes."""
        _check(self._lib, self._lib.gpumem_wake(self.handle, tag_id(tag), _stream_value(stream)))

    def awake(self, tag, then="offload", stream=None):
        """`with pool.awake("optim"): ...` wakes `tag` if it sleeps, runs the block, and puts
        the tag to sleep again in mode `then` ("offload", "discard", or None to leave it
        awake), also when the block raises. The context's `woke` says whether it slept."""
        return _AwakeFor(lambda: self.asleep(tag), lambda: self.wake(tag, stream),
                         lambda mode: self.sleep(tag, mode, stream), then)

    def asleep(self, tag):
        """Whether `tag` sleeps (its pages released, its addresses kept)."""
        r = self._lib.gpumem_tag_asleep(self.handle, tag_id(tag))
        if r < 0:
            _raise(self._lib, self._lib.gpumem_last_status())
        return bool(r)

    def tag_stats(self, tag):
        s = Stats()
        _check(self._lib, self._lib.gpumem_tag_stats(self.handle, tag_id(tag), ctypes.byref(s)))
        return s.as_dict()

    def host_bytes(self, tag):
        """Pinned host bytes `tag` holds for its offload sleeps: the copy of its pages in
        use while it sleeps (free pages are not copied), and after wake the same block kept
        for the next sleep (flat across sleep / wake cycles of one size). 0 for a tag never
        used."""
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_tag_host_bytes(self.handle, tag_id(tag),
                                                          ctypes.byref(out)))
        return out.value

    def release_host(self, tag):
        """Gives the pinned host memory of `tag`'s offload sleeps back to the system now;
        returns its bytes (0 when none was held). The next offload sleep gets new memory.
        InvalidArgumentError while the tag sleeps with offload (its bytes live there: wake
        it first), for the shared tag and for a tag never allocated in."""
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_release_host(self.handle, tag_id(tag),
                                                        ctypes.byref(out)))
        return out.value

    def device_memory(self):
        """(free, total) bytes of the pool's device, as the driver reports them."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        _check(self._lib, self._lib.gpumem_device_memory(self.handle, ctypes.byref(free),
                                                         ctypes.byref(total)))
        return free.value, total.value

    def export(self, ptr):
        """A new file descriptor (the caller's) for a live allocation of the shared tag."""
        fd = ctypes.c_int(-1)
        _check(self._lib, self._lib.gpumem_export(self.handle, _pointer(ptr), ctypes.byref(fd)))
        return fd.value

    def import_fd(self, fd, size):
        """Maps memory another process exported; free it with free(ptr, size)."""
        out = ctypes.c_void_p()
        _check(self._lib, self._lib.gpumem_import(self.handle, _unsigned(fd, "fd", _INT_BITS - 1),
                                                  _size(size), ctypes.byref(out)))
        return out.value

    def stream_create(self):
        out = ctypes.c_void_p()
        _check(self._lib, self._lib.gpumem_stream_create(self.handle, ctypes.byref(out)))
        return out.value

    def stream_destroy(self, stream):
        _check(self._lib, self._lib.gpumem_stream_destroy(self.handle, _stream_value(stream)))

    def stream_synchronize(self, stream=None):
        stream = _stream_value(stream)
        _check(self._lib, self._lib.gpumem_stream_synchronize(self.handle, stream))

    def stream_device(self, stream=None):
        """The device `stream` belongs to (None: the current device's default stream). A pool
        serves its own device's streams only (InvalidArgumentError for another's)."""
        out = ctypes.c_int(-1)
        _check(self._lib, self._lib.gpumem_stream_device(self.handle, _stream_value(stream),
                                                         ctypes.byref(out)))
        return out.value

    @property
    def allocator(self):
        return self._lib.gpumem_pool_allocator(self.handle).decode()

    @property
    def platform(self):
        return self._lib.gpumem_pool_platform(self.handle).decode()

    @property
    def device(self):
        return self._lib.gpumem_pool_device(self.handle)

    @property
    def config(self):
        return self._lib.gpumem_pool_config(self.handle).decode()
