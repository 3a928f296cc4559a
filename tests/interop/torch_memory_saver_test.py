"""gpumem.memory_saver under PyTorch on a GPU (skips with 77 without torch or a device), as
an engine written for torch_memory_saver uses it: install() in place of the package, the first
region enables gpumem, tensors made in regions with and without a CPU backup and a CUDA
graph captured with cuda_graph() are released by pause() (the driver's free memory rises by
their bytes) and come back by resume() at the same addresses: the backed-up weights and graph
output equal, the graphs replaying to the same output, no host copy left behind; a second pause is refused; memory_margin_bytes
keeps that much of the device free."""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_test_support import require_torch_and_gpu  # noqa: E402


def main():
    torch = require_torch_and_gpu()
    import gpumem
    import gpumem.memory_saver
    gpumem.memory_saver.install()
    from torch_memory_saver import torch_memory_saver as tms  # pylint: disable=import-error

    with tms.region(tag="kv_cache"):
        kv = torch.full((256 << 20,), 7, dtype=torch.uint8, device="cuda")
    import gpumem.torch as gt
    assert gt.enabled(), "the first region enables gpumem"
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(4096, 4096, device="cuda")
    x = torch.randn(16, 4096, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _ = x @ w
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with tms.cuda_graph(graph, tag="graph"):
        y = x @ w
    graph.replay()
    backed = torch.cuda.CUDAGraph()  # its private pool offloads and comes back
    with tms.cuda_graph(backed, tag="graph", enable_cpu_backup=True):
        z = torch.relu(x @ w)
    backed.replay()
    torch.cuda.synchronize()
    expected, expected_z, w_copy = y.clone(), z.clone(), w.clone()
    kv_address, w_address = kv.data_ptr(), w.data_ptr()

    free_before = torch.cuda.mem_get_info()[0]
    tms.pause()
    free_paused = torch.cuda.mem_get_info()[0]
    released = free_paused - free_before
    assert released >= (256 << 20) + w.numel() * 4, released
    try:
        tms.pause("weights")
    except gpumem.InvalidArgumentError as e:
        assert "paused already" in str(e), e
    else:
        raise AssertionError("a second pause was accepted")
    tms.resume()
    assert kv.data_ptr() == kv_address and w.data_ptr() == w_address
    assert torch.equal(w, w_copy), "the backed-up weights changed across pause / resume"
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, expected), "the graph's output changed across pause / resume"
    assert torch.equal(z, expected_z), "the backed-up graph's output changed across pause / resume"
    z.zero_()
    backed.replay()
    torch.cuda.synchronize()
    assert torch.equal(z, expected_z), "the backed-up graph replays differently after resume"
    for name in ("tms/weights/cpu", "tms/graph/cpu"):
        assert gt.host_bytes(name) == 0, (name, gt.host_bytes(name), "host copy kept after resume")
    kv.fill_(3)
    assert int(kv[-1]) == 3
    # memory_margin_bytes (gpumem's keep_free): a growth that would leave less free fails.
    torch.cuda.empty_cache()
    tms.memory_margin_bytes = torch.cuda.mem_get_info()[0] - (64 << 20)
    try:
        with tms.region(tag="kv_cache"):
            torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    except RuntimeError as e:  # torch.OutOfMemoryError, or RuntimeError through CUDAPluggableAllocator
        assert "keep_free" in str(e), e
    else:
        raise AssertionError("an allocation past memory_margin_bytes succeeded")
    tms.memory_margin_bytes = 0
    with tms.region(tag="kv_cache"):
        more = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    del more
    print("torch_memory_saver_test: ok (released %.1f MiB)" % (released / 2**20))
    return 0


if __name__ == "__main__":
    sys.exit(main())
