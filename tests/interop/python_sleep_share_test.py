"""gpumem's tags, sleep / wake and sharing from Python (ctypes, sim device, no PyTorch
needed): a pattern survives sleep and wake at the same address while the device's free
memory rises by the tag's bytes; the refusals as typed exceptions; memory shared with a
forked process over a Unix socket; gpumem.torch.tag sets the thread's tag; the pinned host
memory of offload sleeps stays flat over cycles and goes back on request; KV storage made
under a tag takes that tag's pages and goes back with its sleep; tags are shown by name. The PyTorch
parts (gpumem.ipc.open, gpumem.torch.sleep) run in tests/interop/torch_sleep_share_test.py."""
import ctypes
import os
import socket
import sys

import gpumem
import gpumem.kv as gkv
import gpumem.torch as gt

MIB = 1 << 20


def pattern(n, seed):
    return bytes((i * 131 + seed * 17) & 0xFF for i in range(n))


def refused(call, what):
    try:
        call()
    except gpumem.InvalidArgumentError as e:
        assert what in str(e), e
    else:
        raise AssertionError("refusal expected: " + what)


def host_memory_of_offload():
    with gpumem.Pool("sim_capacity:256M") as pool:
        p = pool.malloc_tagged(8 * MIB, "train")
        ctypes.memmove(p, pattern(4096, 5), 4096)
        assert pool.host_bytes("train") == 0
        held = None
        for _ in range(20):
            pool.sleep("train", "offload")
            held = held or pool.host_bytes("train")
            pool.wake("train")
            assert pool.host_bytes("train") == held, (pool.host_bytes("train"), held)
        assert held >= 8 * MIB, held
        pool.sleep("train", "offload")
        refused(lambda: pool.release_host("train"), "wake it first")
        assert pool.host_bytes("train") == held
        pool.wake("train")
        pool.stream_synchronize()
        assert ctypes.string_at(p, 4096) == pattern(4096, 5)
        refused(lambda: pool.release_host("never-used"), "never allocated in")
        assert pool.release_host("train") == held
        assert pool.host_bytes("train") == 0
        assert pool.release_host("train") == 0
        pool.free(p, 8 * MIB)


def kv_storage_in_a_tag():
    layout = dict(layers=2, kv_heads=2, head_dim=64, dtype="bf16")  # 1 KiB a token
    with gpumem.Pool("sim_capacity:256M") as pool:
        with gt.tag("rollout"):  # the current tag at creation decides; growth stays there
            vs = gkv.VirtualSequences(max_sequence_tokens=16384, pool=pool, **layout)
        seq = vs.add(4096)
        vs.append(seq, 4096)
        assert pool.tag_stats("rollout")["reserved_bytes"] == 8 * MIB
        assert pool.tag_stats(0)["reserved_bytes"] == 0
        refused(lambda: pool.sleep("rollout", "discard"), "lent out")
        vs.free(seq)
        vs.close()
        del vs
        free_before, _ = pool.device_memory()
        pool.sleep("rollout", "discard")
        assert pool.device_memory()[0] - free_before == 8 * MIB
        refused(lambda: gkv.VirtualSequences(pool=pool, tag="rollout", **layout), "asleep")
        pool.wake("rollout")
        # tag= names the tag without a scope; a paged KVCache follows it the same way.
        cache = gkv.KVCache(pool=pool, tag="kv-paged", initial_blocks=4, **layout)
        assert pool.tag_stats("kv-paged")["reserved_bytes"] > 0
        assert pool.tag_stats(0)["reserved_bytes"] == 0
        refused(lambda: pool.sleep("kv-paged", "discard"), "lent out")
        cache.close()
        del cache
        pool.sleep("kv-paged", "discard")
        assert pool.tag_stats("kv-paged")["reserved_bytes"] == 0
        pool.wake("kv-paged")


def reports_cover_every_tag():
    """gpumem_pool_explain and gpumem_snapshot show a tag's memory, not only tag 0's."""
    import pickle
    import tempfile

    with gpumem.Pool("sim_capacity:256M") as pool:
        p0 = pool.malloc(4 * MIB)
        t = pool.malloc_tagged(6 * MIB, "rollout")
        tag = gpumem.tag_id("rollout")
        text = pool.explain()
        assert ("tag rollout (%d):" % tag) in text, text
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "s.pickle")
            pool.snapshot(path)
            with open(path, "rb") as f:
                snap = pickle.load(f)
        by_pool = {}
        for seg in snap["segments"]:
            by_pool.setdefault(seg["segment_pool_id"], []).append(seg)
        assert set(by_pool) == {(0, 0), (tag, 0)}, sorted(by_pool)
        tagged = sum(b["size"] for seg in by_pool[(tag, 0)] for b in seg["blocks"]
                     if b["state"] == "active_allocated")
        assert tagged >= 6 * MIB, tagged
        assert any(b["address"] == t for seg in by_pool[(tag, 0)] for b in seg["blocks"])
        pool.free(t, 6 * MIB)
        pool.free(p0, 4 * MIB)


def tags_are_shown_by_name():
    """A tag's name reaches the library with its number: refusals name it; a name the
    library could not show (empty, too long, not printable ASCII) is refused up front."""
    with gpumem.Pool("sim_capacity:256M") as pool:
        p = pool.malloc_tagged(MIB, "policy")
        n = gpumem.tag_id("policy")
        pool.free(p, MIB)
        pool.sleep("policy", "discard")
        refused(lambda: pool.malloc_tagged(MIB, "policy"), "tag policy (%d) is asleep" % n)
        pool.wake("policy")
    for bad in ("", "x" * (gpumem.MAX_TAG_NAME + 1), "caf\u00e9", "a\tb"):
        try:
            gpumem.tag_id(bad)
        except ValueError as e:
            assert "printable ASCII" in str(e), e
        else:
            raise AssertionError("tag name %r accepted" % bad)
        assert bad not in gpumem._tag_ids  # pylint: disable=protected-access
    assert gpumem.tag_id("x" * gpumem.MAX_TAG_NAME) > 0


def main():
    reports_cover_every_tag()
    tags_are_shown_by_name()
    host_memory_of_offload()
    kv_storage_in_a_tag()
    lib = gpumem.load()
    with gpumem.Pool("sim_capacity:256M") as pool:
        size = 6 * MIB + 100
        p = pool.malloc_tagged(size, "weights")
        data = pattern(4096, 3)
        ctypes.memmove(p, data, len(data))
        ctypes.memmove(p + size - 4096, data, len(data))
        reserved = pool.tag_stats("weights")["reserved_bytes"]
        assert reserved >= size, reserved
        free_before, _ = pool.device_memory()
        pool.sleep("weights", "offload")
        assert pool.asleep("weights")
        free_asleep, _ = pool.device_memory()
        assert free_asleep - free_before == reserved, (free_asleep, free_before, reserved)
        for bad in (lambda: pool.malloc_tagged(MIB, "weights"),
                    lambda: pool.sleep("weights"),
                    lambda: pool.wake("kv")):
            try:
                bad()
            except gpumem.InvalidArgumentError:
                pass
            else:
                raise AssertionError("refusal expected")
        try:
            pool.sleep("weights", "later")
        except ValueError:
            pass
        else:
            raise AssertionError("bad mode accepted")
        pool.wake("weights")
        pool.stream_synchronize()
        assert ctypes.string_at(p, 4096) == data
        assert ctypes.string_at(p + size - 4096, 4096) == data
        assert pool.device_memory()[0] == free_before
        pool.free(p, size)

        # Sharing with a forked process: it maps the memory and writes its half.
        shared = pool.malloc_tagged(4 * MIB, "shared")
        ctypes.memmove(shared, pattern(1024, 7), 1024)
        fd = pool.export(shared)
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                parent.close()
                with gpumem.Pool("sim_capacity:64M") as mine:
                    _, fds, _, _ = socket.recv_fds(child, 16, 1)
                    q = mine.import_fd(fds[0], 4 * MIB)
                    os.close(fds[0])
                    if ctypes.string_at(q, 1024) == pattern(1024, 7):
                        ctypes.memset(q + 2 * MIB, 0xAB, 2 * MIB)
                        child.send(b"k")
                        mine.free(q, 4 * MIB)
                        code = 0
            finally:
                os._exit(code)
        child.close()
        socket.send_fds(parent, [b"x"], [fd])
        os.close(fd)
        assert parent.recv(1) == b"k"
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
        assert ctypes.string_at(shared + 4 * MIB - 1, 1) == b"\xab"
        try:
            pool.import_fd(parent.fileno(), 4 * MIB)  # a socket is no exported memory
        except gpumem.InvalidArgumentError:
            pass
        else:
            raise AssertionError("a foreign descriptor was imported")
        parent.close()
        pool.free(shared, 4 * MIB)

    # gpumem.torch.tag sets (and restores) this thread's tag for the plug-in's allocations.
    assert lib.gpumem_current_tag() == 0
    with gt.tag("kv") as t:
        assert lib.gpumem_current_tag() == t.id == gpumem.tag_id("kv") != 0
        with gt.tag("shared"):
            assert lib.gpumem_current_tag() == gpumem.SHARED_TAG
        assert lib.gpumem_current_tag() == t.id
    assert lib.gpumem_current_tag() == 0

    # all_threads=True: threads that never chose a tag (autograd's backward thread) follow
    # it for the block; a thread that chose one keeps its own.
    import threading

    def seen_by_a_new_thread(choose=None):
        out = []

        def run():
            if choose is not None:
                lib.gpumem_set_current_tag(choose)
            out.append(lib.gpumem_current_tag())
        th = threading.Thread(target=run)
        th.start()
        th.join()
        return out[0]

    with gt.tag("train", all_threads=True) as t:
        assert lib.gpumem_current_tag() == t.id
        assert seen_by_a_new_thread() == t.id
        assert seen_by_a_new_thread(choose=0) == 0
        with gt.tag("kv"):
            assert lib.gpumem_current_tag() == gpumem.tag_id("kv")
            assert seen_by_a_new_thread() == t.id
    assert lib.gpumem_current_tag() == 0
    assert seen_by_a_new_thread() == 0
    print("python_sleep_share_test: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
