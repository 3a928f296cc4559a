import sys

changes = []  # (library path, alloc name, free name, torch fully imported at the swap)


class CUDAPluggableAllocator:
    def __init__(self, path, alloc_fn_name, free_fn_name):
        self.args = (path, alloc_fn_name, free_fn_name)

    def allocator(self):
        return object()  # no set_record_stream_fn / set_reset_fn


def change_current_allocator(allocator):
    torch = sys.modules["torch"]
    changes.append(allocator.args + (getattr(torch, "IMPORTED_FULLY", False),))
