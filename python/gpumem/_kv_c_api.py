"""The C API of include/gpumem/interop/gpumem_kv.h through ctypes, and what gpumem.kv's two
caches share: dtype codes, Layout (the shape of a cache), the pool a cache takes by default.

Package-private: gpumem.kv re-exports the public names (Layout, DTYPES, dtype_code,
NOT_RESIDENT)."""

import array
import ctypes
import operator
import threading

import gpumem
from gpumem import InvalidArgumentError

DTYPES = {"fp8": 0, "f16": 1, "fp16": 1, "float16": 1, "bf16": 2, "bfloat16": 2,
          "f32": 3, "fp32": 3, "float32": 3}
_DTYPE_NAMES = {0: "fp8", 1: "f16", 2: "bf16", 3: "f32"}
_DTYPE_BYTES = {0: 1, 1: 2, 2: 2, 3: 4}
# What __cuda_array_interface__ can state of each dtype: bf16 and fp8 have no typestr, so
# they are described as same-size integers and reinterpreted by tensor() (view(dtype)).
_TYPESTR = {0: "|u1", 1: "<f2", 2: "<i2", 3: "<f4"}
NOT_RESIDENT = 0xFFFFFFFF


# --- integers into ctypes: every one the kv modules pass is checked here, once ----------
#
# ctypes converts silently: a c_uint64 takes 2**64 + s as s and -1 as 2**64 - 1, so an id
# out of range would name another sequence. So, before any C call:
#  - a non-integer (float, str, None) is a TypeError, and so is a bool: True as a sequence
#    id or a count is always a slip (an is_swapped() result passed on);
#  - an integer outside the C type is InvalidArgumentError (a ValueError) naming the range;
#  - any other integer (int, numpy and torch integer scalars: __index__) is used as is.

def _c_int(value, what, bits=64, signed=False):
    """`value` as a Python int in the range of a C integer of `bits` bits."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError("gpumem.kv: %s must be an integer, not %s" % (what, type(value).__name__))
    value = operator.index(value)
    low, high = (-(1 << (bits - 1)), (1 << (bits - 1)) - 1) if signed else (0, (1 << bits) - 1)
    if not low <= value <= high:
        raise InvalidArgumentError(
            gpumem.ERROR_INVALID_ARGUMENT,
            "gpumem.kv: %s %d is outside %d..%d (a %d-bit %s C integer)"
            % (what, value, low, high, bits, "signed" if signed else "unsigned"))
    return value


def _c_size(value, what):
    """A count or size for a size_t or uint64_t parameter."""
    return _c_int(value, what, 8 * ctypes.sizeof(ctypes.c_size_t))


_ARRAYS = {(32, True): ("i", ctypes.c_int32), (64, False): ("Q", ctypes.c_uint64)}


def _c_ints(values, what, bits, signed):
    """`values` (an iterable of integers) as a ctypes array (at least one element long, so
    it is never NULL) and their count, each checked as _c_int does."""
    values = values if isinstance(values, (list, tuple)) else list(values)
    code, ctype = _ARRAYS[(bits, signed)]
    try:
        ints = array.array(code, values)  # the common case, checked in C
        ok = ints.itemsize == ctypes.sizeof(ctype) and bool not in set(map(type, values))
    except (TypeError, OverflowError, ValueError):
        ok = False
    if not ok:  # the first bad element raises; else one by one (e.g. torch scalars)
        ints = [_c_int(v, "%s[%d]" % (what, i), bits, signed) for i, v in enumerate(values)]
    n = len(ints)
    if isinstance(ints, array.array) and n:
        return (ctype * n).from_buffer(ints), n
    return (ctype * max(1, n))(*ints), n


class _Layout(ctypes.Structure):
    _fields_ = [("layers", ctypes.c_uint64), ("kv_heads", ctypes.c_uint64),
                ("head_dim", ctypes.c_uint64), ("block_tokens", ctypes.c_uint64),
                ("dtype", ctypes.c_int32), ("reserved", ctypes.c_int32)]


class _Config(ctypes.Structure):
    _fields_ = [("layout", _Layout), ("max_blocks", ctypes.c_uint64),
                ("initial_blocks", ctypes.c_uint64), ("max_sequence_tokens", ctypes.c_uint64),
                ("grow_pages", ctypes.c_uint64), ("prefix_caching", ctypes.c_int32),
                ("scrub", ctypes.c_int32), ("swap", ctypes.c_int32),
                ("reserved", ctypes.c_int32), ("stream", ctypes.c_void_p)]


class _Storage(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "base", "max_blocks", "capacity_blocks", "block_stride", "layer_stride", "kv_stride",
        "token_stride", "head_stride", "dtype_bytes")] + [("layout", _Layout)]


class _Stats(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "capacity_blocks", "used_blocks", "cached_blocks", "free_blocks", "filled_slots",
        "sequences", "swapped_sequences", "mapped_bytes", "block_bytes", "block_allocations",
        "block_releases", "prefix_queries", "prefix_hits", "evictions", "cow_copies",
        "blocks_scrubbed", "swaps_out", "swaps_in", "bytes_swapped_out",
        "bytes_swapped_in")] + [("waste_fraction", ctypes.c_double)]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


_declared = set()  # id() of the libraries whose KV functions are declared
_declare_lock = threading.Lock()


def _lib(lib=None):
    """The C library with the KV functions declared (once per library)."""
    lib = lib if lib is not None else gpumem.load()
    with _declare_lock:
        if id(lib) in _declared:
            return lib
        c = ctypes
        h, p = c.c_void_p, c.c_void_p
        u64p = c.POINTER(c.c_uint64)
        i32p = c.POINTER(c.c_int32)
        sigs = {
            "gpumem_set_current_tag": (c.c_uint32, [c.c_uint32]),
            "gpumem_current_tag": (c.c_uint32, []),
            "gpumem_kv_config_init": (None, [c.POINTER(_Config)]),
            "gpumem_kv_create": (c.c_int, [p, c.POINTER(_Config), c.POINTER(h)]),
            "gpumem_kv_destroy": (None, [h]),
            "gpumem_kv_check_layout": (c.c_int, [h, c.POINTER(_Layout)]),
            "gpumem_kv_add_sequence": (c.c_int, [h, i32p, c.c_size_t, c.c_uint64, u64p, u64p]),
            "gpumem_kv_append": (c.c_int, [h, c.c_uint64, i32p, c.c_size_t]),
            "gpumem_kv_append_each": (c.c_int, [h, u64p, i32p, c.c_size_t,
                                                c.POINTER(c.c_size_t)]),
            "gpumem_kv_fork": (c.c_int, [h, c.c_uint64, u64p]),
            "gpumem_kv_free": (c.c_int, [h, c.c_uint64]),
            "gpumem_kv_swap_out": (c.c_int, [h, c.c_uint64]),
            "gpumem_kv_swap_in": (c.c_int, [h, c.c_uint64]),
            "gpumem_kv_block_table": (c.c_int, [h, c.c_uint64, c.POINTER(c.c_uint32),
                                                c.c_size_t, c.POINTER(c.c_size_t)]),
            "gpumem_kv_block_tables": (c.c_int, [h, u64p, c.c_size_t, c.POINTER(c.c_uint32),
                                                 c.c_size_t, c.c_uint32, u64p]),
            "gpumem_kv_sequence_tokens": (c.c_int, [h, c.c_uint64, u64p]),
            "gpumem_kv_is_swapped": (c.c_int, [h, c.c_uint64, i32p]),
            "gpumem_kv_blocks_needed": (c.c_int, [h, c.c_uint64, c.c_uint64, u64p]),
            "gpumem_kv_available_blocks": (c.c_int, [h, u64p]),
            "gpumem_kv_evict": (c.c_int, [h, c.c_uint64, u64p]),
            "gpumem_kv_shrink": (c.c_int, [h, c.c_uint64, c.c_int32, u64p]),
            "gpumem_kv_stats_get": (c.c_int, [h, c.POINTER(_Stats)]),
            "gpumem_kv_storage_get": (c.c_int, [h, c.POINTER(_Storage)]),
            "gpumem_kv_synchronize": (c.c_int, [h]),
            "gpumem_kv_validate": (c.c_size_t, [h, c.c_char_p, c.c_size_t]),
        }
        for name, (restype, argtypes) in sigs.items():
            try:
                fn = getattr(lib, name)
            except AttributeError:
                raise gpumem.NotSupportedError(
                    gpumem.ERROR_NOT_SUPPORTED,
                    "gpumem.kv: %s has no %s: rebuild it from a tree with "
                    "src/interop/c_api_kv.cpp" % (gpumem.library_path(), name)) from None
            fn.restype = restype
            fn.argtypes = argtypes
        _declared.add(id(lib))
        return lib


def dtype_code(dtype):
    """The C API's dtype code of "bf16", "f16", "f32", "fp8" or a torch dtype."""
    if isinstance(dtype, int) and not isinstance(dtype, bool) and dtype in _DTYPE_NAMES:
        return dtype
    name = str(dtype).replace("torch.", "")
    if name.startswith("float8"):
        return 0
    if name not in DTYPES:
        raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                   "gpumem.kv: unknown KV dtype %r (expected bf16, f16, f32, "
                                   "fp8 or a torch dtype of those)" % (dtype,))
    return DTYPES[name]


class Layout:
    """The shape of a cache: layers, kv_heads, head_dim, dtype, block_tokens."""

    __slots__ = ("layers", "kv_heads", "head_dim", "dtype", "block_tokens")

    def __init__(self, layers, kv_heads, head_dim, dtype="bf16", block_tokens=16):
        self.layers = _c_int(layers, "layers")
        self.kv_heads = _c_int(kv_heads, "kv_heads")
        self.head_dim = _c_int(head_dim, "head_dim")
        self.dtype = _DTYPE_NAMES[dtype_code(dtype)]
        self.block_tokens = _c_int(block_tokens, "block_tokens")

    @classmethod
    def from_hf_config(cls, config, dtype="bf16", block_tokens=16):
        """The layout of a transformers model config (LlamaConfig and alike)."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        return cls(text.num_hidden_layers, kv_heads, head_dim, dtype, block_tokens)

    def _c(self):
        return _Layout(self.layers, self.kv_heads, self.head_dim, self.block_tokens,
                       DTYPES[self.dtype], 0)

    @property
    def dtype_bytes(self):
        return _DTYPE_BYTES[DTYPES[self.dtype]]

    @property
    def block_bytes(self):
        return self.layers * 2 * self.block_tokens * self.kv_heads * self.head_dim * \
            self.dtype_bytes

    def __repr__(self):
        return ("Layout(layers=%d, kv_heads=%d, head_dim=%d, dtype=%r, block_tokens=%d)"
                % (self.layers, self.kv_heads, self.head_dim, self.dtype, self.block_tokens))


def _in_tag(lib, tag, create):
    """create() with `tag` (a name or an int, see gpumem.tag_id) as this thread's current
    tag in `lib`, restored after; None: the current tag as it is. A KV cache or sequence
    set takes its pages from the tag current at its creation (gpumem_kv.h)."""
    if tag is None:
        return create()
    previous = lib.gpumem_set_current_tag(gpumem.tag_id(tag))
    try:
        return create()
    finally:
        lib.gpumem_set_current_tag(previous)


def _default_pool(device):
    """The plug-in's pool when gpumem.torch is enabled (one budget with PyTorch), else a
    new vmm_page_pool of the device (the platform the environment selects)."""
    try:
        import gpumem.torch as gt
        if gt.enabled():
            p = gt.pool(device)
            if p.allocator == "vmm_page_pool":
                return p
    except Exception:  # no torch, or the plug-in not in use
        pass
    return gpumem.Pool(allocator="vmm_page_pool", device=device)
