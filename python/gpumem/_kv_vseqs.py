"""VirtualSequences: each sequence's keys and values in one virtual range of its own
(include/gpumem/kv/kv_virtual_sequences.hpp through the C API).

Package-private: gpumem.kv re-exports VirtualSequences."""

import ctypes
import weakref

import gpumem
from gpumem import InvalidArgumentError, _check
from gpumem._kv_c_api import (DTYPES, _TYPESTR, Layout, _Layout, _c_int, _c_size,
                              _declare_lock, _declared, _default_pool, _in_tag, _lib)
from gpumem._kv_views import SequenceView, _to_torch, _torch_dtype


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


class VirtualSequences:
    """Each sequence's keys and values in one virtual range of its own, growing by pages,
    token-major (include/gpumem/kv/kv_virtual_sequences.hpp): one layer's keys of a
    sequence are an ordinary strided tensor [tokens, kv_heads, head_dim] that SDPA reads
    as it is, no block table. At most one partly used page per sequence.

    views(seq, layer) -> (keys, values) torch tensors of the sequence's current tokens;
    sdpa_views(seq, layer) -> the same as [1, kv_heads, tokens, head_dim].
    A view keeps nothing mapped by itself: free(seq) refuses (InvalidArgumentError) while a
    view of seq made here is alive, so no view ever points at an unmapped or reused range;
    free(seq, force=True) frees anyway (a kernel reading a view afterwards faults).
    tag: the tag whose pages the sequences take (a name or an int; None: the thread's
    current tag now), as gpumem.kv.KVCache's."""

    def __init__(self, layout=None, *, layers=None, kv_heads=None, head_dim=None, dtype="bf16",
                 max_sequence_tokens=4096, pool=None, device=0, stream=None, lib=None,
                 tag=None):
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
        tokens = _c_size(max_sequence_tokens, "max_sequence_tokens")
        _check(self._lib, _in_tag(self._lib, tag, lambda: self._lib.gpumem_kv_vseqs_create(
            pool.handle, ctypes.byref(c), tokens, self._stream, ctypes.byref(handle))))
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
        _check(self._lib, self._lib.gpumem_kv_vseqs_add(self.handle, _c_size(tokens, "tokens"),
                                                        ctypes.byref(out)))
        return out.value

    def append(self, seq, tokens):
        _check(self._lib, self._lib.gpumem_kv_vseqs_append(
            self.handle, _c_int(seq, "sequence id"), _c_size(tokens, "tokens")))

    def free(self, seq, force=False):
        seq = _c_int(seq, "sequence id")
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
        _check(self._lib, self._lib.gpumem_kv_vseqs_sequence(self.handle, _c_int(seq, "sequence id"),
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
        seq, layer = _c_int(seq, "sequence id"), _c_int(layer, "layer")
        if not layer < self.layout.layers:
            raise InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT,
                                       "gpumem.kv: layer %d of a %d-layer layout"
                                       % (layer, self.layout.layers))
        base, have = self.sequence(seq)
        tokens = have if tokens is None else _c_size(tokens, "tokens")
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
        want = _torch_dtype(self.layout.dtype)
        out = []
        for v in self.array_views(seq, layer, tokens):
            t = _to_torch(v, self.device)
            out.append(t.view(want) if t.dtype != want else t)
        return tuple(out)

    def sdpa_views(self, seq, layer, tokens=None):
        """(keys, values) as [1, kv_heads, tokens, head_dim] strided tensors for SDPA."""
        k, v = self.views(seq, layer, tokens)
        return k.permute(1, 0, 2).unsqueeze(0), v.permute(1, 0, 2).unsqueeze(0)
