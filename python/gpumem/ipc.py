"""Device memory shared between processes without copies (gpumem.h: gpumem_export /
gpumem_import), for PyTorch tensors allocated by the gpumem plug-in.

    handle = gpumem.ipc.share(tensor)          # producer
    handle.send(sock)                           # a connected AF_UNIX socket (SCM_RIGHTS)
    handle = gpumem.ipc.Handle.receive(sock)    # consumer
    view = gpumem.ipc.open(handle)              # a tensor over the same memory

share() exports the tensor's memory when it was allocated in the shared tag
(`with gpumem.torch.tag("shared"): t = torch.empty(...)`); otherwise it first copies the
tensor into a new shared allocation (one device copy) and exports that. The memory lives
while any process maps it: the producer may drop its tensor while a consumer still reads,
and a consumer that dies leaks nothing of the producer's. A Handle also pickles through
multiprocessing (its descriptor travels as multiprocessing passes descriptors).
"""
import ctypes
import os
import socket

import gpumem

__all__ = ["Handle", "share", "open"]


class Handle:
    """What a consumer needs: the exported descriptor, the byte size, the tensor's dtype,
    shape and device index. `fd` is owned by the handle (closed by close())."""

    def __init__(self, fd, size, dtype, shape, device, keep=None):
        self.fd = fd
        self.size = size
        self.dtype = dtype
        self.shape = tuple(shape)
        self.device = device
        self._keep = keep  # the producer's shared tensor, alive while the handle is

    def close(self):
        if self.fd is not None and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:  # pylint: disable=broad-except
            pass

    def _meta(self):
        return repr((self.size, str(self.dtype).replace("torch.", ""), self.shape,
                     self.device)).encode()

    def send(self, sock):
        """Sends the descriptor and the metadata over a connected AF_UNIX socket."""
        meta = self._meta()
        socket.send_fds(sock, [len(meta).to_bytes(4, "little") + meta], [self.fd])

    @classmethod
    def receive(cls, sock):
        import ast
        msg, fds, _, _ = socket.recv_fds(sock, 65536, 1)
        if not fds:
            raise gpumem.InvalidArgumentError(1, "gpumem.ipc: no file descriptor received")
        n = int.from_bytes(msg[:4], "little")
        size, dtype, shape, device = ast.literal_eval(msg[4:4 + n].decode())
        return cls(fds[0], size, dtype, shape, device)

    def __reduce__(self):
        from multiprocessing import reduction
        return (_rebuild, (reduction.DupFd(self.fd), self.size, str(self.dtype), self.shape,
                           self.device))


def _rebuild(dup, size, dtype, shape, device):
    return Handle(dup.detach(), size, dtype.replace("torch.", ""), shape, device)


def _torch():
    try:
        import torch  # pylint: disable=import-outside-toplevel
    except ImportError as e:
        raise gpumem.NotSupportedError(4, "gpumem.ipc needs PyTorch: %s" % e) from e
    return torch


def share(tensor):
    """A Handle for `tensor`'s memory (see the module text)."""
    torch = _torch()
    import gpumem.torch as gt  # pylint: disable=import-outside-toplevel
    if not tensor.is_cuda:
        raise gpumem.InvalidArgumentError(1, "gpumem.ipc.share: the tensor is not on a GPU")
    device = tensor.device.index if tensor.device.index is not None else torch.cuda.current_device()
    pool = gt.pool(device)
    src = tensor.contiguous()
    storage_ptr = src.untyped_storage().data_ptr()
    shared = src
    try:
        if src.storage_offset() != 0:
            raise gpumem.InvalidArgumentError(1, "not the start of its allocation")
        fd = pool.export(storage_ptr)
    except gpumem.InvalidArgumentError:
        with gt.tag("shared"):
            shared = torch.empty_like(src)
        shared.copy_(src)
        torch.cuda.current_stream(device).synchronize()
        fd = pool.export(shared.untyped_storage().data_ptr())
    return Handle(fd, shared.untyped_storage().nbytes(), str(src.dtype).replace("torch.", ""),
                  src.shape, device, keep=shared)


class _Mapped:
    """An imported range as __cuda_array_interface__; unmapped when the last tensor over it
    goes."""

    def __init__(self, pool, ptr, size, shape, typestr):
        self._pool, self._ptr, self._size = pool, ptr, size
        self.__cuda_array_interface__ = {"shape": (size,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 2}

    def __del__(self):
        try:
            self._pool.free(self._ptr, self._size)
        except Exception:  # pylint: disable=broad-except
            pass


def open(handle):  # pylint: disable=redefined-builtin
    """A tensor over the memory `handle` names, mapped into this process (no copy)."""
    torch = _torch()
    import gpumem.torch as gt  # pylint: disable=import-outside-toplevel
    pool = gt.pool(handle.device)
    ptr = pool.import_fd(handle.fd, handle.size)
    mapped = _Mapped(pool, ptr, handle.size, handle.shape, "|u1")
    raw = torch.as_tensor(mapped, device="cuda:%d" % handle.device)
    dtype = getattr(torch, handle.dtype)
    count = 1
    for d in handle.shape:
        count *= d
    return raw[:count * torch.empty((), dtype=dtype).element_size()].view(dtype).view(handle.shape)
