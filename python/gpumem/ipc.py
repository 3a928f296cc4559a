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
import json
import os
import re
import socket

import gpumem

__all__ = ["Handle", "share", "open"]


class Handle(gpumem._Closing):  # pylint: disable=protected-access
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

    def _meta(self):
        return json.dumps([self.size, str(self.dtype).replace("torch.", ""),
                           [int(d) for d in self.shape], self.device]).encode()

    def send(self, sock):
        """Sends the descriptor and the metadata over a connected AF_UNIX socket."""
        meta = self._meta()
        socket.send_fds(sock, [len(meta).to_bytes(4, "little") + meta], [self.fd])

    @classmethod
    def receive(cls, sock):
        """The Handle another process sent. A message that is not send()'s (no or several
        descriptors, cut short, metadata that is not a size, dtype name, shape and device)
        raises InvalidArgumentError naming what is wrong; every descriptor it carried is
        closed first."""
        # Room for several descriptors, so extra ones arrive here and are closed rather
        # than cut off by the kernel.
        msg, fds, flags, _ = socket.recv_fds(sock, _MAX_MESSAGE, 8)
        try:
            size, dtype, shape, device = _parse_message(msg, fds, flags)
            return cls(fds[0], size, dtype, shape, device)
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    def __reduce__(self):
        from multiprocessing import reduction
        return (_rebuild, (reduction.DupFd(self.fd), self.size, str(self.dtype), self.shape,
                           self.device))


_MAX_MESSAGE = 65536
_DTYPE_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _refuse(why):
    raise gpumem.InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT, "gpumem.ipc: " + why)


def _parse_message(msg, fds, flags):
    """(size, dtype, shape, device) of a message of Handle.send, or InvalidArgumentError."""
    if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
        _refuse("the message was cut short (MSG_CTRUNC or MSG_TRUNC)")
    if len(fds) != 1:
        _refuse("expected one file descriptor with the message, received %d" % len(fds))
    if len(msg) < 4:
        _refuse("a message of %d bytes, shorter than its 4-byte length" % len(msg))
    n = int.from_bytes(msg[:4], "little")
    if n != len(msg) - 4:
        _refuse("the metadata is %d bytes, its length says %d" % (len(msg) - 4, n))
    try:
        meta = json.loads(msg[4:].decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        _refuse("the metadata is not JSON text (%s)" % e.__class__.__name__)

    def whole(v):
        return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < 2**63

    if not (isinstance(meta, list) and len(meta) == 4):
        _refuse("the metadata is not [size, dtype, shape, device]")
    size, dtype, shape, device = meta
    if not whole(size):
        _refuse("size %r is not a whole number in 0..2^63-1" % (size,))
    if not (isinstance(dtype, str) and _DTYPE_NAME.fullmatch(dtype)):
        _refuse("dtype %r is not a dtype name" % (dtype,))
    if not (isinstance(shape, list) and len(shape) <= 64 and all(whole(d) for d in shape)):
        _refuse("shape %r is not a list of at most 64 whole numbers" % (shape,))
    if not (whole(device) and device < 1024):
        _refuse("device %r is not a device index in 0..1023" % (device,))
    return size, dtype, shape, device


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
