import os

from . import memory  # noqa: F401


def is_initialized():
    return os.environ.get("FAKE_TORCH_CUDA_INITIALIZED") == "1"


def device_count():
    return 1


def current_device():
    return 0


def memory_allocated(device=None):
    return int(os.environ.get("FAKE_TORCH_ALLOCATED", "0"))
