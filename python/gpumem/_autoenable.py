"""Turns gpumem on as PyTorch's allocator as soon as `torch` finishes importing, before any
tensor exists: `python -m gpumem run` installs it, and so does gpumem-enable.pth (put in
site-packages by `pip install`) when GPUMEM_ENABLE is set to anything but "" or "0".

How: a meta-path finder that answers for "torch" only. It asks the other finders for
torch's spec and wraps that loader's exec_module, so that once torch's __init__ has run
(torch is complete in sys.modules) gpumem.torch.enable() runs, with GPUMEM_CONF,
GPUMEM_ALLOCATOR and GPUMEM_MARK_STEPS from the environment. Then the finder removes
itself. A failure of enable() fails the `import torch` with enable()'s error, never
silently leaving PyTorch's allocator in place.
"""

import os
import sys

_ENV = "GPUMEM_ENABLE"


def requested():
    """Does the environment ask for gpumem (GPUMEM_ENABLE set, not "" or "0")?"""
    return os.environ.get(_ENV, "") not in ("", "0")


def _enable():
    import gpumem.torch

    gpumem.torch.enable()


class _TorchFinder:
    """A meta-path finder for the top-level "torch" module only."""

    def __init__(self, on_import):
        self._on_import = on_import

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        spec = None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                break
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        uninstall()
        loader, on_import = spec.loader, self._on_import
        original = loader.exec_module

        def exec_module(module):
            original(module)
            try:
                del loader.exec_module  # the loader's own method again
            except AttributeError:
                pass
            on_import()

        loader.exec_module = exec_module  # this spec's loader instance only
        return spec


_finder = None


def install(on_import=_enable):
    """Arranges on_import() to run right after `import torch` completes; at once when torch
    is already imported. Idempotent."""
    global _finder
    if "torch" in sys.modules:
        on_import()
        return
    if _finder is None:
        _finder = _TorchFinder(on_import)
        sys.meta_path.insert(0, _finder)


def uninstall():
    global _finder
    if _finder is not None:
        try:
            sys.meta_path.remove(_finder)
        except ValueError:
            pass
        _finder = None


def install_if_requested():
    """What gpumem-enable.pth calls at interpreter start-up."""
    if requested():
        install()
