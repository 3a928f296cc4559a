"""The mechanics of examples/rl_colocate.py's two-process layout on the sim device, through
gpumem.colocate and gpumem's Pool (no torch, no GPU): a trainer whose weights live in the
shared tag, exported once as a descriptor to a generator process that maps them; the
trainer's gradients in a tag that sleeps with offload while the generator works, its
optimizer states in one that sleeps from the end of one step to the next's update (the
bytes of both survive every sleep); the generator's KV memory in a tag that sleeps with discard
while the trainer works. Each generate checks that the generator reads the trainer's newest
weights (the bytes the last training step wrote, no copy). Over the iterations, the open
descriptors and the pools' reserved bytes of both processes stay equal. The generator
killed with SIGKILL mid-iteration: the trainer goes on (its tag awake, its bytes intact)
with no descriptor or device byte more than before the generator started, and a new
generator serves the next iteration. A wake with no room raises OutOfMemoryError and leaves
the bytes on the host: a wake once there is room restores them. The host memory of the
offload is given back on request; a tag still asleep refuses that until it wakes.

    python tests/interop/python_rl_colocate_test.py     # GPUMEM_LIB, PYTHONPATH as ctest's
"""
import ctypes
import os
import sys
import unittest
import zlib

import gpumem
from gpumem import colocate

MIB = 1 << 20
WEIGHT_BYTES = 6 * MIB + 4096
STATE_BYTES = 8 * MIB
OPTIM_BYTES = 12 * MIB
KV_BYTES = 10 * MIB
CONF = "sim_capacity:96M"
ITERATIONS = 6


def fill(ptr, nbytes, seed):
    """Writes a pattern that depends on seed at 64 KiB strides (cheap, and any lost page
    shows)."""
    for off in range(0, nbytes, 64 << 10):
        word = (seed * 2654435761 + off) & 0xFFFFFFFF
        ctypes.memmove(ptr + off, word.to_bytes(4, "little") * 16, min(64, nbytes - off))


def checksum(ptr, nbytes):
    crc = 0
    for off in range(0, nbytes, 64 << 10):
        crc = zlib.crc32(ctypes.string_at(ptr + off, min(64, nbytes - off)), crc)
    return crc


def expected_checksum(nbytes, seed):
    buf = ctypes.create_string_buffer(nbytes)
    fill(ctypes.addressof(buf), nbytes, seed)
    return checksum(ctypes.addressof(buf), nbytes)


# --- the generator process ---------------------------------------------------------------

class SimGenerator:
    """Maps the trainer's weights, keeps its KV memory in tag "rollout" (discarded while
    the trainer works), and answers each generate with a checksum of the weights it reads
    and its own resource counts."""

    def __init__(self):
        self.pool = gpumem.Pool(CONF, allocator="vmm_page_pool", platform="sim")
        self.weights = None
        self.kv = self.pool.malloc_tagged(KV_BYTES, "rollout")
        self.pool.sleep("rollout", "discard")

    def on_weights(self, msg, channel):
        fd = msg.take_fd()
        try:
            self.weights = self.pool.import_fd(fd, msg.meta["bytes"])
        finally:
            os.close(fd)
        return {"mapped": True}, b""

    def on_generate(self, msg, channel):
        channel.send("progress", {"stage": "generating"})
        if msg.meta.get("hold"):
            channel.recv()  # never answered: the trainer kills this process meanwhile
        self.pool.wake("rollout")
        fill(self.kv, KV_BYTES, msg.meta["version"])  # the rollouts' keys and values
        crc = checksum(self.weights, WEIGHT_BYTES)
        self.pool.sleep("rollout", "discard")
        return {"weights_crc": crc, "fds": colocate.open_fds(),
                "reserved": self.pool.stats()["reserved_bytes"]}, b"rollouts"


def generator_main(fd):
    gen = SimGenerator()
    channel = colocate.Channel.from_fd(fd)
    colocate.serve(channel, {"weights": gen.on_weights, "generate": gen.on_generate})
    channel.close()
    if gen.weights is not None:
        gen.pool.free(gen.weights, WEIGHT_BYTES)
    gen.pool.close()
    return 0


# --- the trainer ---------------------------------------------------------------------------

class SimTrainer:
    """Weights in the shared tag, gradients in tag "train" (offloaded while the generator
    works), optimizer states in tag "optim" (offloaded from the end of one step to the start
    of the next's update, as the example's AdamW states); each step writes new weights, new
    gradients and new states."""

    def __init__(self, test):
        self.test = test
        self.pool = gpumem.Pool(CONF, allocator="vmm_page_pool", platform="sim")
        self.weights = self.pool.malloc_tagged(WEIGHT_BYTES, "shared")
        self.state = self.pool.malloc_tagged(STATE_BYTES, "train")
        self.optim = self.pool.malloc_tagged(OPTIM_BYTES, "optim")
        self.version = 0
        self.hold = False  # the generator waits after its progress message (to be killed)
        fill(self.weights, WEIGHT_BYTES, self.version)
        fill(self.state, STATE_BYTES, 1000 + self.version)
        fill(self.optim, OPTIM_BYTES, 2000 + self.version)
        self.pool.sleep("optim", "offload")

    def share_weights(self, channel):
        fd = self.pool.export(self.weights)
        try:
            channel.call("weights", {"bytes": WEIGHT_BYTES}, fds=[fd]).close()
        finally:
            os.close(fd)

    def sleep(self):
        self.pool.sleep("train", "offload")

    def wake(self):
        self.pool.wake("train")
        self.pool.stream_synchronize()

    def request(self, iteration):
        return {"version": self.version, "iteration": iteration, "hold": self.hold}, b""

    def train(self, reply):
        self.test.assertEqual(reply.payload, b"rollouts")
        # The state slept with offload while the generator worked: its bytes are back.
        self.test.assertEqual(checksum(self.state, STATE_BYTES),
                              expected_checksum(STATE_BYTES, 1000 + self.version))
        # The update: the optimizer states wake for it alone, with the last step's bytes.
        with self.pool.awake("optim", then="offload") as update:
            self.test.assertTrue(update.woke)
            self.pool.stream_synchronize()
            self.test.assertEqual(checksum(self.optim, OPTIM_BYTES),
                                  expected_checksum(OPTIM_BYTES, 2000 + self.version))
            self.version += 1
            fill(self.weights, WEIGHT_BYTES, self.version)
            fill(self.state, STATE_BYTES, 1000 + self.version)
            fill(self.optim, OPTIM_BYTES, 2000 + self.version)
        return float(self.version)

    def publish(self):
        self.pool.stream_synchronize()  # the sim's "event": the step's writes are done

    def close(self):
        self.pool.free(self.weights, WEIGHT_BYTES)
        self.pool.free(self.state, STATE_BYTES)
        if self.pool.asleep("optim"):
            self.pool.wake("optim")
        self.pool.free(self.optim, OPTIM_BYTES)
        self.pool.close()


def spawn_generator():
    return colocate.Peer.spawn([sys.executable, os.path.abspath(__file__), "--generator",
                                "{fd}"])


class RlColocateTest(unittest.TestCase):
    def setUp(self):
        self.trainer = SimTrainer(self)

    def tearDown(self):
        self.trainer.close()

    def iterate(self, peer, iteration, **kw):
        loss, meta, timings = colocate.trainer_iteration(self.trainer, peer.channel, iteration,
                                                         **kw)
        # The generator read the weights of the last step, through its own mapping.
        self.assertEqual(meta["weights_crc"],
                         expected_checksum(WEIGHT_BYTES, self.trainer.version - 1))
        self.assertEqual(loss, float(self.trainer.version))
        self.assertEqual(set(timings), {"trainer_sleep_s", "generate_round_trip_s",
                                        "trainer_wake_s", "train_s", "publish_s"})
        return meta

    def counts(self):
        return (colocate.open_fds(), self.trainer.pool.stats()["reserved_bytes"])

    def test_iterations_are_steady_and_a_killed_generator_leaks_nothing(self):
        before_spawn = self.counts()
        peer = spawn_generator()
        self.trainer.share_weights(peer.channel)
        trainer_counts, generator_counts, host = [], [], []
        for it in range(ITERATIONS):
            meta = self.iterate(peer, it)
            trainer_counts.append(self.counts())
            generator_counts.append((meta["fds"], meta["reserved"]))
            host.append((self.trainer.pool.host_bytes("train"),
                         self.trainer.pool.host_bytes("optim")))
        # Steady: nothing grows from the first iteration on, in either process; each
        # offload's pinned host memory is one block of its tag's size, reused.
        self.assertEqual(len(set(trainer_counts)), 1, trainer_counts)
        self.assertEqual(len(set(generator_counts)), 1, generator_counts)
        self.assertEqual(len(set(host)), 1, host)
        self.assertGreaterEqual(host[0][0], STATE_BYTES)
        self.assertGreaterEqual(host[0][1], OPTIM_BYTES)
        # Between steps the optimizer states are on the host alone: the trainer holds
        # less device memory than with them awake.
        self.assertTrue(self.trainer.pool.asleep("optim"))

        # Killed mid-iteration: the trainer goes on, awake, its bytes intact.
        self.trainer.hold = True
        with self.assertRaises(colocate.PeerClosed):
            colocate.trainer_iteration(self.trainer, peer.channel, ITERATIONS,
                                       progress=lambda msg: peer.kill())
        self.assertEqual(peer.proc.returncode, -9)
        self.trainer.hold = False
        self.assertFalse(self.trainer.pool.asleep("train"))
        self.assertTrue(self.trainer.pool.asleep("optim"))  # as between any two steps
        self.assertEqual(checksum(self.trainer.state, STATE_BYTES),
                         expected_checksum(STATE_BYTES, 1000 + self.trainer.version))
        self.assertEqual(self.counts(), before_spawn)
        # A new generator maps the same weights and serves the next iterations.
        peer = spawn_generator()
        self.trainer.share_weights(peer.channel)
        for it in range(2):
            self.iterate(peer, ITERATIONS + 1 + it)
        self.assertEqual(peer.stop(), 0)
        self.assertEqual(self.counts(), before_spawn)
        # The host memory of the offload goes back when the trainer asks: a tag awake at
        # once; a tag asleep (the optimizer states after the last step) holds its only copy
        # there, so its release is refused until it wakes, its bytes intact.
        pool = self.trainer.pool
        self.assertEqual(pool.host_bytes("train"), host[0][0])
        self.assertEqual(pool.release_host("train"), host[0][0])
        self.assertEqual(pool.host_bytes("train"), 0)
        with self.assertRaisesRegex(gpumem.InvalidArgumentError, "wake it first"):
            pool.release_host("optim")
        self.assertEqual(pool.host_bytes("optim"), host[0][1])
        pool.wake("optim")
        pool.stream_synchronize()
        self.assertEqual(checksum(self.trainer.optim, OPTIM_BYTES),
                         expected_checksum(OPTIM_BYTES, 2000 + self.trainer.version))
        self.assertEqual(pool.release_host("optim"), host[0][1])
        self.assertEqual(pool.host_bytes("optim"), 0)

    def test_a_wake_with_no_room_keeps_the_bytes_on_the_host(self):
        pool = self.trainer.pool
        self.trainer.sleep()
        free, _ = pool.device_memory()
        filler = pool.malloc(free - 2 * MIB)  # less room than the tag's 8 MiB
        with self.assertRaises(gpumem.OutOfMemoryError) as err:
            pool.wake("train")
        self.assertIn("no room", str(err.exception))
        self.assertIn("stay on the host", str(err.exception))
        self.assertTrue(pool.asleep("train"))
        pool.free(filler, free - 2 * MIB)
        self.trainer.wake()
        self.assertEqual(checksum(self.trainer.state, STATE_BYTES),
                         expected_checksum(STATE_BYTES, 1000))

    def test_awake_wakes_for_the_block_and_sleeps_after_it_even_when_it_raises(self):
        pool = self.trainer.pool
        self.assertTrue(pool.asleep("optim"))
        # A mode refused before anything wakes.
        with self.assertRaises(ValueError):
            pool.awake("optim", then="nap")
        self.assertTrue(pool.asleep("optim"))
        # The block raises: the tag sleeps again with what the block wrote.
        with self.assertRaises(KeyError):
            with pool.awake("optim") as update:
                self.assertTrue(update.woke)
                self.assertFalse(pool.asleep("optim"))
                fill(self.trainer.optim, OPTIM_BYTES, 77)
                raise KeyError("the step failed")
        self.assertTrue(pool.asleep("optim"))
        # then=None: it stays awake; a tag already awake is not woken again.
        with pool.awake("optim", then=None) as update:
            self.assertTrue(update.woke)
        self.assertFalse(pool.asleep("optim"))
        pool.stream_synchronize()
        self.assertEqual(checksum(self.trainer.optim, OPTIM_BYTES), expected_checksum(OPTIM_BYTES, 77))
        with pool.awake("optim", then="offload") as update:
            self.assertFalse(update.woke)
        self.assertTrue(pool.asleep("optim"))
        # A wake with no room raises from the `with` line: the block does not run, and the
        # bytes stay on the host until a wake with room.
        free, _ = pool.device_memory()
        filler = pool.malloc(free - 2 * MIB)  # less room than the states' 12 MiB
        ran = []
        with self.assertRaises(gpumem.OutOfMemoryError):
            with pool.awake("optim"):
                ran.append(True)
        self.assertEqual(ran, [])
        self.assertTrue(pool.asleep("optim"))
        pool.free(filler, free - 2 * MIB)
        with pool.awake("optim"):
            pool.stream_synchronize()
            self.assertEqual(checksum(self.trainer.optim, OPTIM_BYTES),
                             expected_checksum(OPTIM_BYTES, 77))
        self.assertTrue(pool.asleep("optim"))

    def test_the_channel_refuses_bad_frames_and_closes_their_descriptors(self):
        a, b = colocate.Channel.pair()
        try:
            r, w = os.pipe()
            os.close(w)
            fds_before = colocate.open_fds()
            # A header that is not the protocol's JSON object, with a descriptor.
            import socket
            import struct
            socket.send_fds(a.sock, [struct.pack("<IQ", 4, 0) + b"[1]\n"], [r])
            os.close(r)
            with self.assertRaisesRegex(gpumem.InvalidArgumentError, "header"):
                b.recv()
            self.assertEqual(colocate.open_fds(), fds_before - 1)
            with self.assertRaisesRegex(gpumem.InvalidArgumentError, "kind"):
                a.send("Bad Kind")
            a.send("ok", {"n": 1}, b"xyz")
            msg = b.recv()
            self.assertEqual((msg.kind, msg.meta, msg.payload), ("ok", {"n": 1}, b"xyz"))
            a.close()
            with self.assertRaises(colocate.PeerClosed):
                b.recv()
        finally:
            a.close()
            b.close()

    def test_a_failing_handler_answers_with_its_error_type_and_the_loop_goes_on(self):
        import threading

        def boom(msg, channel):
            raise MemoryError("no room for the rollouts")

        a, b = colocate.Channel.pair()
        served = []
        server = threading.Thread(target=lambda: served.append(
            colocate.serve(b, {"boom": boom, "echo": lambda m, c: ({}, m.payload)})))
        server.start()
        try:
            with self.assertRaises(colocate.PeerError) as err:
                a.call("boom")
            self.assertEqual(err.exception.error_type, "MemoryError")
            self.assertIn("no room for the rollouts", str(err.exception))
            with a.call("echo", payload=b"still serving") as reply:
                self.assertEqual(reply.payload, b"still serving")
            a.call("stop").close()
        finally:
            server.join(10)
            a.close()
            b.close()
        self.assertEqual(served, [True])

    def test_flat_layout_aligns_and_refuses_duplicates(self):
        offsets, total = colocate.flat_layout([("a", 10), ("b", 256), ("c", 0), ("d", 1)])
        self.assertEqual(offsets, {"a": 0, "b": 256, "c": 512, "d": 512})
        self.assertEqual(total, 768)
        with self.assertRaises(ValueError):
            colocate.flat_layout([("a", 1), ("a", 2)])


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--generator":
        sys.exit(generator_main(int(sys.argv[2])))
    unittest.main(verbosity=2)
