"""Sleep / wake and sharing under PyTorch on a GPU (skips with 77 without torch or a
device): tensors made under gpumem.torch.tag sleep (the driver's free memory rises by the
tag's bytes) and wake with the same bytes at the same addresses; a CUDA graph captured
before the sleep replays with identical results after the wake; allocating in a sleeping
tag raises; a cuBLAS workspace first made inside a tag that then sleeps does not take
the next matrix product down with it; AdamW's states sleep between steps in a tag awake for opt.step() alone (gpumem.torch.awake) and
step as an optimizer whose states never sleep; gpumem.ipc shares a tensor with a spawned
process that checks and writes it."""
import os
import socket
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from torch_test_support import require_torch_and_gpu  # noqa: E402


def consumer(fd):
    torch = require_torch_and_gpu()
    import gpumem.torch as gt
    import gpumem.ipc as ipc
    gt.enable()
    sock = socket.socket(fileno=fd)
    t = ipc.open(ipc.Handle.receive(sock))
    ok = bool(torch.equal(t[:1000], torch.arange(1000, device="cuda", dtype=torch.float32)))
    t[1000:].fill_(7.0)
    torch.cuda.synchronize()
    sock.sendall(b"ok" if ok else b"no")
    return 0


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--consumer":
        return consumer(int(sys.argv[2]))
    torch = require_torch_and_gpu()
    import gpumem
    import gpumem.torch as gt
    import gpumem.ipc as ipc
    gt.enable()

    # The process's first matrix product runs inside a tag: PyTorch makes the stream's
    # cuBLAS workspace there. The tag sleeps; the next product (outside it) must still
    # find a mapped workspace and compute the right numbers.
    with gt.tag("scratch"):
        a = torch.randn(512, 512, device="cuda")
        first = a @ a
    torch.cuda.synchronize()
    a_host, first_host = a.cpu(), first.cpu()
    del first
    gt.sleep("scratch", "offload")
    m = torch.randn(512, 512, device="cuda")
    product = (m @ m).cpu()
    assert torch.allclose(product, m.cpu() @ m.cpu(), rtol=1e-3, atol=1e-3), \
        "a product after the sleep of the tag that made the cuBLAS workspace is wrong"
    gt.wake("scratch")
    assert torch.allclose((a @ a).cpu(), first_host, rtol=1e-3, atol=1e-3)
    assert torch.equal(a.cpu(), a_host)
    del a, m

    with gt.tag("weights"):
        w = torch.randn(4096, 4096, device="cuda")
        b = torch.randn(4096, device="cuda")
    x = torch.randn(8, 4096, device="cuda")
    address = w.data_ptr()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        y = x @ w + b
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = x @ w + b
    graph.replay()
    torch.cuda.synchronize()
    expected = y.clone()
    w_copy = w.clone()

    reserved = gt.tag_stats("weights")["reserved_bytes"]
    free_before = torch.cuda.mem_get_info()[0]
    gt.sleep("weights", "offload")
    free_asleep = torch.cuda.mem_get_info()[0]
    assert free_asleep - free_before >= reserved * 95 // 100, (free_asleep, free_before, reserved)
    try:
        with gt.tag("weights"):
            torch.empty(1024, device="cuda")
    except RuntimeError as e:
        assert "asleep" in str(e), e
    else:
        raise AssertionError("allocation in a sleeping tag succeeded")
    gt.wake("weights")
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert w.data_ptr() == address
    assert torch.equal(w, w_copy), "weights changed across sleep/wake"
    assert torch.equal(y, expected), "the graph's output changed across sleep/wake"
    del graph

    # AdamW's states in a tag awake for the step alone (gpumem.torch.awake): the first step
    # makes them inside the tag, they sleep between steps, and the steps match an
    # optimizer whose states never sleep.
    torch.manual_seed(3)
    model = torch.nn.Linear(256, 256, device="cuda")
    twin = torch.nn.Linear(256, 256, device="cuda")
    twin.load_state_dict(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_twin = torch.optim.AdamW(twin.parameters(), lr=1e-2)
    assert not gt.asleep("optim")
    for step in range(3):
        xb = torch.randn(32, 256, device="cuda")
        for m in (model, twin):
            m(xb).square().mean().backward()
        with gt.awake("optim") as update:
            assert update.woke == (step > 0), (step, update.woke)
            opt.step()
        opt_twin.step()
        assert gt.asleep("optim")
        assert gt.tag_stats("optim")["live_bytes"] >= 2 * 4 * (256 * 256 + 256), gt.tag_stats("optim")
        opt.zero_grad()
        opt_twin.zero_grad()
    with gt.awake("optim", then=None):
        pass
    assert not gt.asleep("optim")
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q), "a step whose states slept differs"
    for st, st_twin in zip(opt.state.values(), opt_twin.state.values()):
        assert torch.equal(st["exp_avg_sq"], st_twin["exp_avg_sq"])
    del model, twin, opt, opt_twin

    with gt.tag("shared"):
        t = torch.zeros(1 << 20, device="cuda")
    t[:1000] = torch.arange(1000, device="cuda", dtype=torch.float32)
    torch.cuda.synchronize()
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--consumer",
                             str(child.fileno())], pass_fds=[child.fileno()])
    child.close()
    ipc.share(t).send(parent)
    answer = parent.recv(2)
    assert proc.wait() == 0
    assert answer == b"ok", answer
    torch.cuda.synchronize()
    assert float(t[-1]) == 7.0, "the consumer's write is not visible"
    print("torch_sleep_share_test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
