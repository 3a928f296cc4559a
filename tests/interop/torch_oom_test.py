"""gpumem as PyTorch's allocator running out of memory on a GPU (limit:1G): in the forward
pass, in backward (autograd's own thread) and on a side stream, PyTorch must raise the
exception this build's plug-in throws (GPUMEM_EXPECTED_OOM: torch.OutOfMemoryError when built
against libtorch, else RuntimeError), whose text starts "CUDA out of memory." and carries
gpumem's report; live tensors stay intact and training goes on once memory is freed.

Run by ctest with PYTHONPATH=python and GPUMEM_LIB=<libgpumem_torch.so>. Exits 77 (skipped)
without torch or without a CUDA device."""

import os
import unittest

from torch_test_support import require_torch_and_gpu  # noqa: E402

torch = require_torch_and_gpu()

import gpumem.torch  # noqa: E402

MiB = 1 << 20
gpumem.torch.enable(conf="limit:1G")  # before PyTorch's first CUDA allocation


def expected_type():
    return torch.OutOfMemoryError if os.environ.get("GPUMEM_EXPECTED_OOM") == \
        "torch.OutOfMemoryError" else RuntimeError


class TorchOutOfMemoryTest(unittest.TestCase):
    def assert_gpumem_oom(self, error):
        # The exact type: torch.OutOfMemoryError is a RuntimeError, so one that should be a
        # plain RuntimeError must not be it either.
        self.assertIs(type(error), expected_type())
        text = str(error)
        self.assertTrue(text.startswith("CUDA out of memory. gpumem: out of memory on device"), text)
        self.assertIn("where the reserved bytes go now:", text)

    def test_plugin_names_the_type_it_raises(self):
        self.assertEqual(gpumem.torch.out_of_memory_error(),
                         os.environ.get("GPUMEM_EXPECTED_OOM", "RuntimeError"))

    def test_a_tensor_past_the_limit_raises_and_the_pool_serves_on(self):
        base = torch.ones(512 * MiB, dtype=torch.uint8, device="cuda")
        failures = gpumem.torch.failures()
        with self.assertRaises(RuntimeError) as caught:
            torch.empty(768 * MiB, dtype=torch.uint8, device="cuda")
        self.assert_gpumem_oom(caught.exception)
        self.assertEqual(gpumem.torch.failures(), failures + 1)
        more = torch.ones(64 * MiB, dtype=torch.uint8, device="cuda")
        # The live tensor intact (min and max: a uint8 sum would need a 4 GiB int64 copy).
        self.assertEqual((int(base.min()), int(base.max())), (1, 1))
        self.assertEqual((int(more.min()), int(more.max())), (1, 1))
        del base, more

    def test_backward_and_a_side_stream_raise_and_training_goes_on(self):
        torch.manual_seed(0)
        # 4 x 64 MiB of weights, as much again for their gradients: at batch 6144 the
        # forward pass fits and backward (autograd's own thread) does not; at 16384 the
        # forward pass does not.
        layers = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(4)]).cuda()
        phase = []

        def step(batch):
            phase.append("forward")
            loss = layers(torch.randn(batch, 4096, device="cuda")).square().mean()
            phase[-1] = "backward"
            loss.backward()
            layers.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            phase[-1] = "done"

        step(64)
        for batch in (6144, 16384):
            try:
                step(batch)
            except RuntimeError as e:
                layers.zero_grad(set_to_none=True)
                self.assert_gpumem_oom(e)
        self.assertEqual(phase, ["done", "backward", "forward"])
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            with self.assertRaises(RuntimeError) as caught:
                torch.empty(900 * MiB, dtype=torch.uint8, device="cuda")
        self.assert_gpumem_oom(caught.exception)
        step(64)  # memory freed: training goes on
        self.assertEqual(phase[-1], "done")
        del layers


if __name__ == "__main__":
    unittest.main()
