"""A stand-in for PyTorch with only what gpumem.torch.enable() touches, for tests on a
machine without torch: it records the allocator swap and the optimizer hooks, and its CUDA
state comes from the environment (FAKE_TORCH_CUDA_INITIALIZED=1, FAKE_TORCH_ALLOCATED=N)."""
from . import cuda, optim  # noqa: F401

IMPORTED_FULLY = True  # set last: enable() must run after this module's body


class Tensor:
    def record_stream(self, stream):
        pass
