"""A cache's memory seen from outside: views through __cuda_array_interface__
(StorageView: the whole block range; SequenceView: one layer of one sequence), DLPack
capsules over them, and torch tensors made from either, checked to address exactly the
view's memory.

Package-private: gpumem.kv re-exports StorageView and SequenceView."""

import ctypes
import threading

import gpumem
from gpumem._kv_c_api import _DTYPE_NAMES, _TYPESTR


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


def _torch_dtype(name):
    """The torch dtype of a cache dtype name (fp8: float8_e4m3fn where torch has it)."""
    import torch
    return {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32,
            "fp8": getattr(torch, "float8_e4m3fn", torch.uint8)}[name]


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
