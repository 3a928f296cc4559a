"""gpumem's paged KV cache from Python (the C API of include/gpumem/interop/gpumem_kv.h).

    import gpumem.kv
    cache = gpumem.kv.KVCache(layers=32, kv_heads=8, head_dim=128, dtype="bf16")
    seq, cached = cache.add_sequence(prompt_token_ids)   # shares cached prompt blocks
    cache.append(seq, [next_token])                       # grows by blocks
    child = cache.fork(seq)                               # copy on write
    k, v = cache.layer_views(layer)                       # torch tensors, no copy
    tables = cache.block_tables([seq, child])             # what a paged kernel indexes
    cache.free(seq)

The storage is one virtual range of `max_blocks` blocks, fixed for the cache's life:

    storage[block][layer][kv][token][head][dim]    kv 0 = keys, 1 = values

`storage_view()` describes it through `__cuda_array_interface__` (torch.as_tensor, CuPy,
Numba); `tensor()` is that range as a torch tensor of the cache's dtype (made through
DLPack, else that interface) and
`layer_views(l)` the per-layer key and value tensors of shape
[max_blocks, block_tokens, kv_heads, head_dim] (strided views of the same memory). Token t
of a sequence is at `k[table[t // block_tokens], t % block_tokens]`. The cache manages
blocks only: the caller writes keys and values into the slots its sequences own, on the
cache's stream (or one ordered after it); the cache's own copies (copy on write, swap)
run on that stream.

Lifetime of views, and stale block tables:
 - a view (the storage_view() object, and every torch tensor made from it) keeps the
   cache's storage alive: close() only stops the cache being used; its memory goes back
   to the pool when the last view is gone. A view never points at memory another
   allocation of the pool can get while it lives.
 - a block id names a block, not a sequence. After free(seq) (or swap_out, or an append
   that copies a shared block), the ids in a table read earlier may belong to another
   sequence (its keys, or zeros with scrub=True), or, after shrink(), to unmapped pages,
   where a kernel faults with an illegal address (a sticky CUDA error). The cache cannot
   see a kernel's reads, so it detects the stale table instead: block_tables() returns a
   BlockTables that records each sequence's generation (bumped by append, free, swap), and
   check_tables() / the attention functions in gpumem.kv_attention refuse a table whose
   sequences changed since, with StaleBlockTableError. Operations on a freed sequence id
   are refused ("... was freed"): ids are never reused.
"""

import array
import ctypes
import threading
import weakref

import gpumem
from gpumem import InvalidArgumentError, _check, _size

__all__ = ["KVCache", "Layout", "BlockTables", "StaleBlockTableError", "DTYPES",
           "VirtualSequences"]

DTYPES = {"fp8": 0, "f16": 1, "fp16": 1, "float16": 1, "bf16": 2, "bfloat16": 2,
          "f32": 3, "fp32": 3, "float32": 3}
_DTYPE_NAMES = {0: "fp8", 1: "f16", 2: "bf16", 3: "f32"}
_DTYPE_BYTES = {0: 1, 1: 2, 2: 2, 3: 4}
# What __cuda_array_interface__ can state of each dtype: bf16 and fp8 have no typestr, so
# they are described as same-size integers and reinterpreted by tensor() (view(dtype)).
_TYPESTR = {0: "|u1", 1: "<f2", 2: "<i2", 3: "<f4"}
NOT_RESIDENT = 0xFFFFFFFF


class StaleBlockTableError(InvalidArgumentError):
    """A block table read before its sequences changed (append, free, swap)."""


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
        self.layers = _size(layers, "layers")
        self.kv_heads = _size(kv_heads, "kv_heads")
        self.head_dim = _size(head_dim, "head_dim")
        self.dtype = _DTYPE_NAMES[dtype_code(dtype)]
        self.block_tokens = _size(block_tokens, "block_tokens")

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


class _Owner:
    """Owns the C cache handle and what it stands on (the pool). Views hold it, so the
    storage outlives close() until the last view is gone."""

    def __init__(self, lib, handle, pool):
        self.lib = lib
        self.handle = handle
        self.pool = pool  # kept alive: the cache's pages are the pool's

    def __del__(self):
        if self.handle is not None:
            try:
                self.lib.gpumem_kv_destroy(self.handle)
            except Exception:
                pass
            self.handle = None


# --- DLPack export (torch.from_dlpack): the tensor's device is stated, so torch neither
# asks the driver where the address lives nor needs numpy (the __cuda_array_interface__
# path does both). Layouts of dlpack.h (DLPack 0.x, the "dltensor" capsule).

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DLDeleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                             ("deleter", _DLDeleter)]
_DL_CUDA = 2
_DL_CODES = {"<f2": (2, 16), "<f4": (2, 32), "<i2": (0, 16), "|u1": (1, 8)}  # (code, bits)
_dlpack_live = {}  # address of a DLManagedTensor -> what it needs alive (until the deleter)
_dlpack_lock = threading.Lock()


def _dlpack_release(managed):
    with _dlpack_lock:
        _dlpack_live.pop(ctypes.addressof(managed.contents), None)


_dlpack_deleter = _DLDeleter(_dlpack_release)
_DLTENSOR_NAME = ctypes.create_string_buffer(b"dltensor")


def _dlpack_capsule(view, device):
    """A "dltensor" capsule over a StorageView / SequenceView (keeps the view alive until
    the consumer's deleter runs)."""
    itemsize = int(view.typestr[-1])
    code, bits = _DL_CODES[view.typestr]
    ndim = len(view.shape)
    shape = (ctypes.c_int64 * ndim)(*view.shape)
    strides = (ctypes.c_int64 * ndim)(*[st // itemsize for st in view.strides])
    m = _DLManagedTensor()
    m.dl_tensor.data = view.ptr
    m.dl_tensor.device = _DLDevice(_DL_CUDA, device)
    m.dl_tensor.ndim = ndim
    m.dl_tensor.dtype = _DLDataType(code, bits, 1)
    m.dl_tensor.shape = shape
    m.dl_tensor.strides = strides
    m.dl_tensor.byte_offset = 0
    m.manager_ctx = None
    m.deleter = _dlpack_deleter
    with _dlpack_lock:
        _dlpack_live[ctypes.addressof(m)] = (m, shape, strides, view)
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(m), ctypes.cast(_DLTENSOR_NAME, ctypes.c_char_p), None)


def _dlpack_forget_unconsumed(capsule):
    """Drops what a capsule nobody consumed keeps alive (a consumer renames it)."""
    valid = ctypes.pythonapi.PyCapsule_IsValid
    valid.restype = ctypes.c_int
    valid.argtypes = [ctypes.py_object, ctypes.c_char_p]
    if not valid(capsule, b"dltensor"):
        return
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype = ctypes.c_void_p
    get.argtypes = [ctypes.py_object, ctypes.c_char_p]
    with _dlpack_lock:
        _dlpack_live.pop(get(capsule, b"dltensor"), None)


def _to_torch(view, device):
    """A torch tensor over a view's memory (no copy): DLPack first, then
    __cuda_array_interface__; checked to address exactly the view's memory."""
    import torch
    errors = []
    for how in ("dlpack", "cuda_array_interface"):
        capsule = None
        try:
            if how == "dlpack":
                capsule = _dlpack_capsule(view, device)
                t = torch.utils.dlpack.from_dlpack(capsule)
            else:
                t = torch.as_tensor(view, device="cuda:%d" % device)
            itemsize = t.element_size()
            if (t.data_ptr() != view.ptr or tuple(t.shape) != tuple(view.shape) or
                    tuple(st * itemsize for st in t.stride()) != tuple(view.strides) or
                    t.device != torch.device("cuda", device)):
                raise RuntimeError("the tensor does not address the view's memory")
            return t
        except Exception as e:  # the next way, or the error below
            errors.append("%s: %s: %s" % (how, type(e).__name__, e))
            if capsule is not None:
                _dlpack_forget_unconsumed(capsule)
    raise gpumem.GpumemError(gpumem.ERROR_INTERNAL,
                             "gpumem.kv: cannot make a torch tensor over the cache: " +
                             "; ".join(errors))


class StorageView:
    """The whole block range through `__cuda_array_interface__` (version 3): shape
    [max_blocks, layers, 2, block_tokens, kv_heads, head_dim], byte strides, the cache's
    stream. bf16 is described as int16 and fp8 as uint8 (the protocol has no such
    typestr): tensor() reinterprets them. Holding it keeps the storage mapped."""

    def __init__(self, owner, storage, stream):
        self._owner = owner
        s = storage
        lay = s.layout
        self.shape = (s.max_blocks, lay.layers, 2, lay.block_tokens, lay.kv_heads,
                      lay.head_dim)
        self.strides = (s.block_stride, s.layer_stride, s.kv_stride, s.token_stride,
                        s.head_stride, s.dtype_bytes)
        self.typestr = _TYPESTR[lay.dtype]
        self.dtype = _DTYPE_NAMES[lay.dtype]
        self.ptr = s.base
        self._stream = stream

    @property
    def __cuda_array_interface__(self):
        d = {"shape": self.shape, "strides": self.strides, "typestr": self.typestr,
             "data": (self.ptr, False), "version": 3}
        # 1 means the legacy default stream in the protocol; None: no synchronization.
        d["stream"] = self._stream if self._stream else None
        return d


class BlockTables:
    """Block tables of several sequences for one kernel launch: `table` is a list of rows
    (padded with `pad`), `lengths` the token counts, `generations` what each sequence's
    generation was when read (check_tables() compares)."""

    __slots__ = ("seqs", "rows", "row_blocks", "lengths", "generations", "pad", "_cache")

    def __init__(self, cache, seqs, rows, row_blocks, lengths, generations, pad):
        self._cache = weakref.ref(cache)
        self.seqs = seqs
        self.rows = rows  # ctypes uint32 array of len(seqs) * row_blocks
        self.row_blocks = row_blocks
        self.lengths = lengths  # ctypes uint64 array
        self.generations = generations
        self.pad = pad

    def table(self):
        """The rows as a list of lists."""
        rb = self.row_blocks
        return [list(self.rows[i * rb:(i + 1) * rb]) for i in range(len(self.seqs))]

    def tensors(self, device="cuda"):
        """(block_table int32 [n, row_blocks], lengths int32 [n]) on `device`."""
        import torch
        n = len(self.seqs)
        table = torch.frombuffer(bytearray(self.rows), dtype=torch.int32).view(n, self.row_blocks)
        lengths = torch.tensor(list(self.lengths), dtype=torch.int32)
        return table.to(device, non_blocking=False), lengths.to(device, non_blocking=False)


class KVCache:
    """A paged KV cache whose pages come from a gpumem pool (see the module text).

    layout or (layers, kv_heads, head_dim, dtype, block_tokens): the shape.
    pool: a gpumem.Pool with allocator vmm_page_pool; by default the PyTorch plug-in's
        pool of `device` when gpumem.torch is enabled (one budget with PyTorch's tensors),
        else a new Pool of `device` (GPUMEM_DEVICE=sim selects the sim device).
    max_blocks: cap on blocks (0: as many as the device holds); initial_blocks: mapped now
        (at least 1, so that views can be made at once); max_sequence_tokens: cap per
        sequence (0: none); prefix_caching; scrub (zero blocks on release); swap (a pinned
        host pool for swap_out/swap_in); stream: the stream of the cache's copies
        (a torch.cuda.Stream, an int, None for the default stream)."""

    def __init__(self, layout=None, *, layers=None, kv_heads=None, head_dim=None, dtype="bf16",
                 block_tokens=16, pool=None, device=0, max_blocks=0, initial_blocks=1,
                 max_sequence_tokens=0, grow_pages=0, prefix_caching=True, scrub=False,
                 swap=True, stream=None, lib=None):
        if layout is None:
            if layers is None or kv_heads is None or head_dim is None:
                raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                           "gpumem.kv: give a Layout or layers, kv_heads "
                                           "and head_dim")
            layout = Layout(layers, kv_heads, head_dim, dtype, block_tokens)
        elif not isinstance(layout, Layout):
            raise TypeError("gpumem.kv: layout must be a gpumem.kv.Layout")
        self.layout = layout
        self._lib = _lib(lib)
        if pool is None:
            pool = _default_pool(device)
        self.device = pool.device
        self._stream = gpumem._stream_value(stream)
        cfg = _Config()
        self._lib.gpumem_kv_config_init(ctypes.byref(cfg))
        cfg.layout = layout._c()
        cfg.max_blocks = _size(max_blocks, "max_blocks")
        cfg.initial_blocks = _size(initial_blocks, "initial_blocks")
        cfg.max_sequence_tokens = _size(max_sequence_tokens, "max_sequence_tokens")
        cfg.grow_pages = _size(grow_pages, "grow_pages")
        cfg.prefix_caching = 1 if prefix_caching else 0
        cfg.scrub = 1 if scrub else 0
        cfg.swap = 1 if swap else 0
        cfg.stream = self._stream
        handle = ctypes.c_void_p()
        _check(self._lib, self._lib.gpumem_kv_create(pool.handle, ctypes.byref(cfg),
                                                     ctypes.byref(handle)))
        self._owner = _Owner(self._lib, handle, pool)
        self._generations = {}  # live sequence -> generation
        self._next_generation = 1
        self._storage = self._storage_struct()
        self._view = None
        self._torch_views = None

    # --- handle ------------------------------------------------------------------------

    @property
    def handle(self):
        if self._owner is None:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: the cache is closed")
        return self._owner.handle

    def close(self):
        """No call works on the cache after this; its storage goes back to the pool once no
        view of it is left (at once when none was made)."""
        self._owner = None
        self._view = None
        self._torch_views = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _bump(self, seq):
        self._generations[seq] = self._next_generation
        self._next_generation += 1

    # --- sequences ---------------------------------------------------------------------

    @staticmethod
    def _tokens(tokens):
        """Token ids as a C int32 array (and their count); OverflowError past 32 bits."""
        try:
            ints = array.array("i", tokens)  # checks the range in C
        except TypeError:
            ints = array.array("i", [int(t) for t in tokens])
        except OverflowError:
            raise OverflowError("gpumem.kv: a token id does not fit in 32 bits") from None
        if ints.itemsize != 4:  # no 32-bit C int on this platform: convert one by one
            out = (ctypes.c_int32 * max(1, len(ints)))(*ints)
            return out, len(ints)
        if not ints:
            return (ctypes.c_int32 * 1)(), 0
        return (ctypes.c_int32 * len(ints)).from_buffer(ints), len(ints)

    def add_sequence(self, tokens=(), salt=0):
        """A new sequence holding the prompt `tokens` (token ids). Returns (seq, cached):
        the first `cached` tokens' keys and values are already in shared blocks (prefix
        caching) and need no computing."""
        arr, n = self._tokens(tokens)
        seq, cached = ctypes.c_uint64(), ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_add_sequence(
            self.handle, arr, n, gpumem._unsigned(salt, "salt", 64), ctypes.byref(seq),
            ctypes.byref(cached)))
        self._bump(seq.value)
        return seq.value, cached.value

    def append(self, seq, tokens):
        """Appends token ids to `seq` (blocks as they fill; all or nothing)."""
        arr, n = self._tokens(tokens)
        _check(self._lib, self._lib.gpumem_kv_append(self.handle, seq, arr, n))
        self._bump(seq)

    def append_each(self, seqs, tokens):
        """One token to each sequence (a decode step); stops at the first failure, raising
        it after the sequences before it got theirs."""
        seqs = list(seqs)
        arr, n = self._tokens(tokens)
        if n != len(seqs):
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: %d sequences, %d tokens" % (len(seqs), n))
        ids = (ctypes.c_uint64 * max(1, n))(*seqs)
        done = ctypes.c_size_t()
        status = self._lib.gpumem_kv_append_each(self.handle, ids, arr, n, ctypes.byref(done))
        for s in seqs[:done.value]:
            self._bump(s)
        _check(self._lib, status)

    def fork(self, seq):
        """A new sequence sharing every block of `seq`; the first append to either copies
        a shared, partly filled last block (copy on write)."""
        child = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_fork(self.handle, seq, ctypes.byref(child)))
        self._bump(child.value)
        return child.value

    def free(self, seq):
        _check(self._lib, self._lib.gpumem_kv_free(self.handle, seq))
        self._generations.pop(seq, None)

    def swap_out(self, seq):
        """Copies the blocks only `seq` holds to pinned host memory and releases them."""
        _check(self._lib, self._lib.gpumem_kv_swap_out(self.handle, seq))
        self._bump(seq)

    def swap_in(self, seq):
        _check(self._lib, self._lib.gpumem_kv_swap_in(self.handle, seq))
        self._bump(seq)

    def is_swapped(self, seq):
        out = ctypes.c_int32()
        _check(self._lib, self._lib.gpumem_kv_is_swapped(self.handle, seq, ctypes.byref(out)))
        return bool(out.value)

    def sequence_tokens(self, seq):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_sequence_tokens(self.handle, seq,
                                                              ctypes.byref(out)))
        return out.value

    def generation(self, seq):
        """Changes whenever seq's block table may have changed (append, swap)."""
        if seq not in self._generations:
            self.sequence_tokens(seq)  # raises "was freed" / "does not exist"
        return self._generations.get(seq)

    def block_table(self, seq):
        """The block ids of `seq` in token order (NOT_RESIDENT where swapped out)."""
        count = ctypes.c_size_t()
        _check(self._lib, self._lib.gpumem_kv_block_table(self.handle, seq, None, 0,
                                                          ctypes.byref(count)))
        out = (ctypes.c_uint32 * max(1, count.value))()
        _check(self._lib, self._lib.gpumem_kv_block_table(self.handle, seq, out, count.value,
                                                          ctypes.byref(count)))
        return list(out[:count.value])

    def block_tables(self, seqs, row_blocks=None, pad=0):
        """A BlockTables of `seqs` (rows padded with `pad` to row_blocks, by default the
        longest). Refused for a freed, unknown or swapped-out sequence."""
        seqs = list(seqs)
        n = len(seqs)
        ids = (ctypes.c_uint64 * max(1, n))(*seqs)
        if row_blocks is None:
            bt = self.layout.block_tokens
            row_blocks = max([(self.sequence_tokens(s) + bt - 1) // bt for s in seqs] or [0])
            row_blocks = max(1, row_blocks)
        row_blocks = _size(row_blocks, "row_blocks")
        rows = (ctypes.c_uint32 * max(1, n * row_blocks))()
        lengths = (ctypes.c_uint64 * max(1, n))()
        _check(self._lib, self._lib.gpumem_kv_block_tables(
            self.handle, ids, n, rows, row_blocks, gpumem._unsigned(pad, "pad", 32), lengths))
        gens = [self._generations.get(s) for s in seqs]
        return BlockTables(self, seqs, rows, row_blocks, lengths[:n], gens, pad)

    def check_tables(self, tables):
        """Raises StaleBlockTableError when a sequence of `tables` was appended to, swapped
        or freed after the tables were read."""
        for s, g in zip(tables.seqs, tables.generations):
            now = self._generations.get(s)
            if now != g:
                what = "was freed" if now is None else "changed (append or swap)"
                raise StaleBlockTableError(
                    gpumem.ERROR_INVALID_ARGUMENT,
                    "gpumem.kv: stale block table: sequence %d %s after the table was read; "
                    "read it again with block_tables()" % (s, what))

    def blocks_needed(self, seq, tokens):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_blocks_needed(self.handle, seq, _size(tokens),
                                                            ctypes.byref(out)))
        return out.value

    def available_blocks(self):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_available_blocks(self.handle, ctypes.byref(out)))
        return out.value

    def evict(self, blocks):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_evict(self.handle, _size(blocks),
                                                    ctypes.byref(out)))
        return out.value

    def shrink(self, keep_free=0, drop_cached=False):
        """Gives pages above the highest used block back to the pool; returns pages."""
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_shrink(self.handle, _size(keep_free),
                                                     1 if drop_cached else 0, ctypes.byref(out)))
        return out.value

    def stats(self):
        s = _Stats()
        _check(self._lib, self._lib.gpumem_kv_stats_get(self.handle, ctypes.byref(s)))
        return s.as_dict()

    def synchronize(self):
        """Waits for the cache's stream (copies on write, swaps)."""
        _check(self._lib, self._lib.gpumem_kv_synchronize(self.handle))

    def validate(self):
        """"" when the cache's invariants hold, else what is wrong."""
        n = self._lib.gpumem_kv_validate(self.handle, None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.gpumem_kv_validate(self.handle, buf, n + 1)
        return buf.value.decode(errors="replace")

    def check_layout(self, layers, kv_heads, head_dim, dtype):
        """InvalidArgumentError naming each field where the model differs from the cache."""
        model = Layout(layers, kv_heads, head_dim, dtype, self.layout.block_tokens)
        c = model._c()
        _check(self._lib, self._lib.gpumem_kv_check_layout(self.handle, ctypes.byref(c)))

    # --- storage -----------------------------------------------------------------------

    def _storage_struct(self):
        s = _Storage()
        _check(self._lib, self._lib.gpumem_kv_storage_get(self.handle, ctypes.byref(s)))
        return s

    def storage(self):
        """Base address, max_blocks, capacity_blocks and the byte strides, as a dict."""
        s = self._storage_struct()
        d = {name: getattr(s, name) for name, _ in _Storage._fields_ if name != "layout"}
        d["layout"] = self.layout
        return d

    @property
    def max_blocks(self):
        return self._storage.max_blocks

    def storage_view(self):
        """The whole block range as a StorageView (__cuda_array_interface__)."""
        handle = self.handle  # refuses a closed cache
        del handle
        if self._view is None:
            self._view = StorageView(self._owner, self._storage, self._stream)
        return self._view

    def tensor(self):
        """The whole block range as one torch tensor of the cache's dtype, shape
        [max_blocks, layers, 2, block_tokens, kv_heads, head_dim], no copy. Only blocks
        named by a live block table are mapped: index it through block tables."""
        if self._torch_views is None:
            import torch
            view = self.storage_view()
            if self._storage_struct().capacity_blocks == 0:
                # The __cuda_array_interface__ path asks the driver which device the base
                # address is on: map block 0 while the tensor is made.
                seq, _ = self.add_sequence([0], salt=(1 << 64) - 1)
                try:
                    raw = _to_torch(view, self.device)
                finally:
                    self.free(seq)
            else:
                raw = _to_torch(view, self.device)
            want = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
                    "fp8": getattr(torch, "float8_e4m3fn", torch.uint8)}[self.layout.dtype]
            full = raw.view(want) if raw.dtype != want else raw
            self._torch_views = full
        return self._torch_views

    def layer_views(self, layer):
        """(keys, values) of one layer: tensors [max_blocks, block_tokens, kv_heads,
        head_dim] over the cache's memory (no copy); token t of a sequence with block table
        `table` is keys[table[t // block_tokens], t % block_tokens]."""
        if not 0 <= layer < self.layout.layers:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: layer %d of a %d-layer cache"
                                       % (layer, self.layout.layers))
        full = self.tensor()
        return full[:, layer, 0], full[:, layer, 1]


class _VseqsInfo(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "sequences", "mapped_bytes", "live_bytes", "max_sequence_tokens", "page_size",
        "token_stride", "layer_stride", "kv_stride", "head_stride", "dtype_bytes")]

    def as_dict(self):
        return {name: getattr(self, name) for name, _ in self._fields_}


def _vseqs_lib(lib):
    lib = _lib(lib)
    with _declare_lock:
        if ("vseqs", id(lib)) in _declared:
            return lib
        c = ctypes
        h = c.c_void_p
        u64p = c.POINTER(c.c_uint64)
        sigs = {
            "gpumem_kv_vseqs_create": (c.c_int, [h, c.POINTER(_Layout), c.c_uint64, c.c_void_p,
                                                 c.POINTER(h)]),
            "gpumem_kv_vseqs_destroy": (None, [h]),
            "gpumem_kv_vseqs_add": (c.c_int, [h, c.c_uint64, u64p]),
            "gpumem_kv_vseqs_append": (c.c_int, [h, c.c_uint64, c.c_uint64]),
            "gpumem_kv_vseqs_free": (c.c_int, [h, c.c_uint64]),
            "gpumem_kv_vseqs_sequence": (c.c_int, [h, c.c_uint64, u64p, u64p]),
            "gpumem_kv_vseqs_info_get": (c.c_int, [h, c.POINTER(_VseqsInfo)]),
            "gpumem_kv_vseqs_validate": (c.c_size_t, [h, c.c_char_p, c.c_size_t]),
        }
        for name, (restype, argtypes) in sigs.items():
            fn = getattr(lib, name)
            fn.restype = restype
            fn.argtypes = argtypes
        _declared.add(("vseqs", id(lib)))
        return lib


class _VseqsOwner:
    def __init__(self, lib, handle, pool):
        self.lib = lib
        self.handle = handle
        self.pool = pool

    def __del__(self):
        if self.handle is not None:
            try:
                self.lib.gpumem_kv_vseqs_destroy(self.handle)
            except Exception:
                pass
            self.handle = None


class SequenceView:
    """One layer's keys or values of one sequence through __cuda_array_interface__: shape
    [tokens, kv_heads, head_dim], byte strides (token_stride, head_stride, dtype bytes)."""

    def __init__(self, owner, ptr, shape, strides, typestr, stream):
        self._owner = owner
        self.ptr = ptr
        self.shape = shape
        self.strides = strides
        self.typestr = typestr
        self._stream = stream

    @property
    def __cuda_array_interface__(self):
        return {"shape": self.shape, "strides": self.strides, "typestr": self.typestr,
                "data": (self.ptr, False), "version": 3,
                "stream": self._stream if self._stream else None}


class VirtualSequences:
    """Each sequence's keys and values in one virtual range of its own, growing by pages,
    token-major (include/gpumem/kv/kv_virtual_sequences.hpp): one layer's keys of a
    sequence are an ordinary strided tensor [tokens, kv_heads, head_dim] that SDPA reads
    as it is, no block table. At most one partly used page per sequence.

    views(seq, layer) -> (keys, values) torch tensors of the sequence's current tokens;
    sdpa_views(seq, layer) -> the same as [1, kv_heads, tokens, head_dim].
    A view keeps nothing mapped by itself: free(seq) refuses (InvalidArgumentError) while a
    view of seq made here is alive, so no view ever points at an unmapped or reused range;
    free(seq, force=True) frees anyway (a kernel reading a view afterwards faults)."""

    def __init__(self, layout=None, *, layers=None, kv_heads=None, head_dim=None, dtype="bf16",
                 max_sequence_tokens=4096, pool=None, device=0, stream=None, lib=None):
        if layout is None:
            layout = Layout(layers, kv_heads, head_dim, dtype)
        self.layout = layout
        self._lib = _vseqs_lib(lib)
        if pool is None:
            pool = _default_pool(device)
        self.device = pool.device
        self._stream = gpumem._stream_value(stream)
        handle = ctypes.c_void_p()
        c = layout._c()
        _check(self._lib, self._lib.gpumem_kv_vseqs_create(
            pool.handle, ctypes.byref(c), _size(max_sequence_tokens, "max_sequence_tokens"),
            self._stream, ctypes.byref(handle)))
        self._owner = _VseqsOwner(self._lib, handle, pool)
        self._views = {}  # seq -> weakref.WeakSet of SequenceView

    @property
    def handle(self):
        if self._owner is None:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: the sequences are closed")
        return self._owner.handle

    def close(self):
        self._owner = None

    def add(self, tokens=0):
        out = ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_vseqs_add(self.handle, _size(tokens),
                                                        ctypes.byref(out)))
        return out.value

    def append(self, seq, tokens):
        _check(self._lib, self._lib.gpumem_kv_vseqs_append(self.handle, seq, _size(tokens)))

    def free(self, seq, force=False):
        live = [v for v in self._views.get(seq, ())]
        if live and not force:
            raise InvalidArgumentError(
                gpumem.ERROR_INVALID_ARGUMENT,
                "gpumem.kv: sequence %d still has %d live view(s); delete them (or "
                "free(force=True): a kernel reading them afterwards faults)" % (seq, len(live)))
        _check(self._lib, self._lib.gpumem_kv_vseqs_free(self.handle, seq))
        self._views.pop(seq, None)

    def sequence(self, seq):
        """(base address, tokens)."""
        base, tokens = ctypes.c_uint64(), ctypes.c_uint64()
        _check(self._lib, self._lib.gpumem_kv_vseqs_sequence(self.handle, seq,
                                                             ctypes.byref(base),
                                                             ctypes.byref(tokens)))
        return base.value, tokens.value

    def info(self):
        i = _VseqsInfo()
        _check(self._lib, self._lib.gpumem_kv_vseqs_info_get(self.handle, ctypes.byref(i)))
        return i.as_dict()

    def validate(self):
        n = self._lib.gpumem_kv_vseqs_validate(self.handle, None, 0)
        buf = ctypes.create_string_buffer(n + 1)
        self._lib.gpumem_kv_vseqs_validate(self.handle, buf, n + 1)
        return buf.value.decode(errors="replace")

    def array_views(self, seq, layer, tokens=None):
        """(keys, values) SequenceViews of `tokens` (default: all) tokens of one layer."""
        if not 0 <= layer < self.layout.layers:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: layer %d of a %d-layer layout"
                                       % (layer, self.layout.layers))
        base, have = self.sequence(seq)
        tokens = have if tokens is None else tokens
        if tokens > have:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: sequence %d holds %d tokens, not %d"
                                       % (seq, have, tokens))
        i = self.info()
        lay = self.layout
        shape = (tokens, lay.kv_heads, lay.head_dim)
        strides = (i["token_stride"], i["head_stride"], i["dtype_bytes"])
        typestr = _TYPESTR[DTYPES[lay.dtype]]
        views = []
        for which in (0, 1):
            ptr = base + layer * i["layer_stride"] + which * i["kv_stride"]
            views.append(SequenceView(self._owner, ptr, shape, strides, typestr, self._stream))
        seen = self._views.setdefault(seq, weakref.WeakSet())
        for v in views:
            seen.add(v)
        return tuple(views)

    def views(self, seq, layer, tokens=None):
        """(keys, values) torch tensors [tokens, kv_heads, head_dim] (no copy)."""
        import torch
        want = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
                "fp8": getattr(torch, "float8_e4m3fn", torch.uint8)}[self.layout.dtype]
        out = []
        for v in self.array_views(seq, layer, tokens):
            t = _to_torch(v, self.device)
            out.append(t.view(want) if t.dtype != want else t)
        return tuple(out)

    def sdpa_views(self, seq, layer, tokens=None):
        """(keys, values) as [1, kv_heads, tokens, head_dim] strided tensors for SDPA."""
        k, v = self.views(seq, layer, tokens)
        return k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)


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
