"""torch_memory_saver's interface on gpumem's tags, for engines written against it (SGLang,
slime, verl's SGLang rollout):

    import gpumem.memory_saver
    gpumem.memory_saver.install()          # `import torch_memory_saver` finds this module
    from torch_memory_saver import torch_memory_saver

    with torch_memory_saver.region(tag="kv_cache"):
        kv = torch.empty(...)              # in gpumem tag "tms/kv_cache"
    with torch_memory_saver.region(tag="weights", enable_cpu_backup=True):
        w = torch.empty(...)               # in gpumem tag "tms/weights/cpu"
    torch_memory_saver.pause()             # every tag: kv_cache discarded, weights offloaded
    torch_memory_saver.resume("weights")

Each (tag, enable_cpu_backup) pair is one gpumem tag: "tms/TAG" sleeps with discard (the
bytes are dropped, as torch_memory_saver without a backup), "tms/TAG/cpu" with offload
(copied to pinned host memory and back). Addresses stay, so tensors and CUDA graphs made
before a pause serve after the resume; `cuda_graph` captures a graph whose private memory
pauses with its tag. gpumem is then PyTorch's allocator for the whole process (the first
call enables it when CUDA has not started; before that, `python -m gpumem run` or
GPUMEM_ENABLE=1 does).

Where torch_memory_saver ends the process (a pause of a paused tag, a resume of a running
one), this raises gpumem.InvalidArgumentError and changes nothing. The host copy is pinned
memory whatever `cpu_backup_backend` names; with `retain_cpu_backup` false (the default, as
there) a resume gives it back, that of the CUDA graphs' private pools included.
`memory_margin_bytes` is gpumem's keep_free: every new page,
of any tag or none, leaves that much device memory free. Not offered, raising
gpumem.NotSupportedError: `enable_disk_backup`, `set_disk_backup_dir` and `get_cpu_backup`
(the host copy is one block per tag, not a tensor per allocation).
"""
import contextlib
import os
import sys

import gpumem

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "install"]

_PREFIX = "tms/"
_DEFAULT_TAG = "default"


def _refuse(why):
    raise gpumem.NotSupportedError(gpumem.ERROR_NOT_SUPPORTED, "gpumem.memory_saver: " + why)


class TorchMemorySaver:
    """torch_memory_saver.TorchMemorySaver on gpumem (the module comment). `backend` serves
    the tags: gpumem.torch by default (tag, sleep, wake, asleep, tag_used, host_bytes,
    release_host, set_keep_free);
    tests give one over a gpumem.Pool."""

    def __init__(self, backend=None):
        self._backend = backend
        self._tags = {}  # (tag, cpu backup) -> gpumem tag name, in the order first used
        self._retain = False

    def _serving(self):
        if self._backend is None:
            import gpumem.torch as gt  # pylint: disable=import-outside-toplevel
            if not gt.enabled():
                gt.enable()
            self._backend = gt
        return self._backend

    def _name(self, tag, cpu_backup):
        if not isinstance(tag, str):
            raise TypeError("gpumem.memory_saver: a tag is a str, not %r" % (tag,))
        name = _PREFIX + tag + ("/cpu" if cpu_backup else "")
        gpumem.tag_id(name)  # a name gpumem cannot take is refused here, before any use
        return name

    @contextlib.contextmanager
    def region(self, tag=_DEFAULT_TAG, enable_cpu_backup=False, enable_disk_backup=False,
               cpu_backup_backend=None):
        """What this thread allocates inside goes to the tag's gpumem tag (the module
        comment), which pause() and resume() release and restore."""
        if enable_disk_backup:
            _refuse("enable_disk_backup: paused bytes go to pinned host memory, not to files")
        if cpu_backup_backend is not None:
            if not enable_cpu_backup:
                raise ValueError("gpumem.memory_saver: cpu_backup_backend requires "
                                 "enable_cpu_backup=True")
            if cpu_backup_backend not in ("pinned", "mmap"):
                raise ValueError("gpumem.memory_saver: cpu_backup_backend is 'pinned' or "
                                 "'mmap', not %r" % (cpu_backup_backend,))
        name = self._name(tag, bool(enable_cpu_backup))
        backend = self._serving()
        self._tags.setdefault((tag, bool(enable_cpu_backup)), name)
        with backend.tag(name):
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag=_DEFAULT_TAG, enable_cpu_backup=False, cpu_backup_backend=None):
        """torch.cuda.graph inside region(tag): the graph's private memory is the tag's, and
        the graph replays after a pause and resume."""
        import torch  # pylint: disable=import-outside-toplevel
        with self.region(tag, enable_cpu_backup, cpu_backup_backend=cpu_backup_backend):
            with torch.cuda.graph(cuda_graph, pool=pool, stream=stream,
                                  capture_error_mode=capture_error_mode):
                yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations inside are untagged (they never pause), also within a region."""
        with self._serving().tag(0):
            yield

    def _targets(self, tag):
        backend = self._serving()
        return [(name, cpu) for (t, cpu), name in self._tags.items()
                if (tag is None or t == tag) and backend.tag_used(name)]

    def pause(self, tag=None):
        """Releases the device memory of `tag` (None: every tag): offloaded where the region
        asked for a CPU backup, dropped elsewhere. InvalidArgumentError, with nothing
        paused, where one of them is paused already."""
        backend = self._serving()
        targets = self._targets(tag)
        for name, _ in targets:
            if backend.asleep(name):
                raise gpumem.InvalidArgumentError(
                    gpumem.ERROR_INVALID_ARGUMENT,
                    "gpumem.memory_saver.pause: %s is paused already (resume it first)" % name)
        for name, cpu in targets:
            backend.sleep(name, "offload" if cpu else "discard")

    def resume(self, tag=None):
        """Maps the memory of `tag` (None: every tag) again at the same addresses, the
        backed-up bytes restored, then gives the host copy back unless retain_cpu_backup.
        InvalidArgumentError where none of them is paused; a resume that ran out of memory
        part way resumes the rest when called again."""
        backend = self._serving()
        paused = [(name, cpu) for name, cpu in self._targets(tag) if backend.asleep(name)]
        if not paused:
            raise gpumem.InvalidArgumentError(
                gpumem.ERROR_INVALID_ARGUMENT,
                "gpumem.memory_saver.resume: nothing of %s is paused"
                % ("any tag" if tag is None else repr(tag)))
        for name, _ in paused:
            backend.wake(name)
        if not self._retain:
            for name, cpu in paused:
                if cpu:
                    backend.release_host(name)

    @property
    def enabled(self):
        return True

    @property
    def hook_mode(self):
        raise AttributeError("hook_mode can only be set")

    @hook_mode.setter
    def hook_mode(self, mode):
        """'preload' or 'torch': either way gpumem is PyTorch's allocator."""
        if mode not in ("preload", "torch"):
            raise ValueError("gpumem.memory_saver: hook_mode is 'preload' or 'torch', not %r"
                             % (mode,))

    @property
    def memory_margin_bytes(self):
        raise NotImplementedError("memory_margin_bytes can only be set")

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value):
        """Device memory every new page leaves free (gpumem's keep_free, for every tag and
        the untagged memory as well as the regions')."""
        self._serving().set_keep_free(value)

    @property
    def retain_cpu_backup(self):
        return self._retain

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value):
        self._retain = bool(value)

    def get_cpu_backup(self, x, zero_copy=False):  # pylint: disable=unused-argument
        _refuse("get_cpu_backup: a paused tag's bytes are one host block, not a tensor "
                "per allocation")

    def set_disk_backup_dir(self, path):  # pylint: disable=unused-argument
        _refuse("set_disk_backup_dir: paused bytes go to pinned host memory, not to files")


torch_memory_saver = TorchMemorySaver()


@contextlib.contextmanager
def configure_subprocess():
    """Python processes started inside run with gpumem as their allocator (GPUMEM_ENABLE,
    read at start-up by the .pth that `pip install` puts in site-packages)."""
    before = os.environ.get("GPUMEM_ENABLE")
    os.environ["GPUMEM_ENABLE"] = "1"
    try:
        yield
    finally:
        if before is None:
            del os.environ["GPUMEM_ENABLE"]
        else:
            os.environ["GPUMEM_ENABLE"] = before


def install():
    """Makes `import torch_memory_saver` (and `from torch_memory_saver import
    torch_memory_saver, configure_subprocess`) find this module."""
    sys.modules["torch_memory_saver"] = sys.modules[__name__]
