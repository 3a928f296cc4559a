"""A trainer and a generator process that take turns on one GPU (docs/RL_COLOCATE.md): the
channel between them, the generator process's start, request loop and end, and the counts
that show nothing leaks across iterations.

    # trainer
    peer = Peer.spawn([sys.executable, "gen.py", "--channel-fd", "{fd}"])
    peer.channel.call("weights", {"layout": ...}, fds=[handle.fd])
    reply = peer.channel.call("generate", {"version": 3})
    peer.stop()

    # generator (gen.py)
    channel = Channel.from_fd(int(args.channel_fd))
    serve(channel, {"weights": on_weights, "generate": on_generate})

A message is a kind (a short name), a JSON object, a binary payload and file descriptors
(SCM_RIGHTS), sent whole with one sendmsg: the descriptors travel with the message's
first bytes. On the wire:

    u32 header length | u64 payload length | header (JSON: {"kind", "meta"}) | payload

A received message owns its descriptors: take_fd() hands one over, close() closes the rest.
A message that is not such a frame (a bad length, a header that is not the JSON object,
too many descriptors, a frame cut short by the kernel) raises InvalidArgumentError naming
what is wrong, every descriptor it carried closed. A peer that closed its end or died
raises PeerClosed, at a message boundary or in the middle of one.

Nothing here needs PyTorch or a GPU: the sim test (tests/interop/python_rl_colocate_test.py)
and the GPU example (examples/rl_colocate.py) run the same protocol.
"""
import json
import os
import signal
import socket
import struct
import subprocess
import traceback

import gpumem

__all__ = ["Channel", "Message", "Peer", "PeerClosed", "PeerError", "serve", "trainer_iteration",
           "flat_layout",
           "open_fds", "rss_bytes", "MAX_FDS"]

MAX_FDS = 64                 # descriptors in one message
MAX_HEADER = 16 << 20        # bytes of a message's JSON header
MAX_PAYLOAD = 1 << 34        # bytes of a message's payload
_PREFIX = struct.Struct("<IQ")
_KIND_CHARS = frozenset("abcdefghijklmnopqrstuvwxyz0123456789_-.")


class PeerClosed(ConnectionError):
    """The other process closed its end of the channel, or died."""


class PeerError(RuntimeError):
    """The other process answered a request with an error (its text is the message);
    `error_type` is the name of the exception's class there ("OutOfMemoryError", ...), or
    None where the reply did not say."""

    def __init__(self, text, error_type=None):
        super().__init__(text)
        self.error_type = error_type


def _refuse(why):
    raise gpumem.InvalidArgumentError(gpumem.ERROR_INVALID_ARGUMENT, "gpumem.colocate: " + why)


def _check_kind(kind):
    if not (isinstance(kind, str) and 0 < len(kind) <= 64 and set(kind) <= _KIND_CHARS):
        _refuse("message kind %r is not a name of 1..64 characters [a-z0-9_.-]" % (kind,))


class Message(gpumem._Closing):  # pylint: disable=protected-access
    """A received message: kind, meta (a dict), payload (bytes) and fds (owned)."""

    def __init__(self, kind, meta, payload, fds):
        self.kind = kind
        self.meta = meta
        self.payload = payload
        self.fds = list(fds)

    def take_fd(self, index=0):
        """Hands descriptor `index` to the caller (who closes it); IndexError if absent."""
        fd = self.fds[index]
        if fd < 0:
            raise IndexError("gpumem.colocate: descriptor %d was already taken" % index)
        self.fds[index] = -1
        return fd

    def close(self):
        for i, fd in enumerate(self.fds):
            if fd >= 0:
                os.close(fd)
                self.fds[i] = -1


class Channel:
    """Messages over a connected AF_UNIX stream socket (see the module text). Not shared
    between threads."""

    def __init__(self, sock):
        if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM:
            _refuse("a channel needs a connected AF_UNIX stream socket")
        self.sock = sock

    @classmethod
    def from_fd(cls, fd):
        """The channel over an inherited socket descriptor (Peer.spawn passes one)."""
        return cls(socket.socket(fileno=fd))

    @classmethod
    def pair(cls):
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        return cls(a), cls(b)

    def fileno(self):
        return self.sock.fileno()

    def close(self):
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def send(self, kind, meta=None, payload=b"", fds=()):
        """Sends one message. The descriptors stay the caller's (the peer gets copies)."""
        _check_kind(kind)
        fds = list(fds)
        if len(fds) > MAX_FDS:
            _refuse("%d descriptors in one message (at most %d)" % (len(fds), MAX_FDS))
        header = json.dumps({"kind": kind, "meta": meta if meta is not None else {}},
                            separators=(",", ":")).encode()
        payload = bytes(payload) if not isinstance(payload, (bytes, bytearray, memoryview)) \
            else payload
        if len(header) > MAX_HEADER or len(payload) > MAX_PAYLOAD:
            _refuse("a message of %d header and %d payload bytes is too large"
                    % (len(header), len(payload)))
        first = _PREFIX.pack(len(header), len(payload)) + header
        try:
            if fds:
                sent = socket.send_fds(self.sock, [first], fds)
            else:
                sent = self.sock.send(first)
            if sent < len(first):
                self.sock.sendall(memoryview(first)[sent:])
            if len(payload):
                self.sock.sendall(payload)
        except (BrokenPipeError, ConnectionResetError) as e:
            raise PeerClosed("gpumem.colocate: the peer is gone (%s)" % e) from None

    def _recv_exact(self, n, fds):
        """n bytes; descriptors arriving with them are appended to fds."""
        if self.sock is None:
            raise PeerClosed("gpumem.colocate: the channel is closed")
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            try:
                data, new_fds, flags, _ = socket.recv_fds(self.sock, min(n - got, 1 << 24),
                                                          MAX_FDS)
            except ConnectionResetError as e:
                raise PeerClosed("gpumem.colocate: the peer is gone (%s)" % e) from None
            fds.extend(new_fds)
            if flags & socket.MSG_CTRUNC:
                _refuse("the descriptors of a message were cut short (MSG_CTRUNC)")
            if not data:
                raise PeerClosed("gpumem.colocate: the peer closed the channel%s"
                                 % (" in the middle of a message" if got or fds else ""))
            view[got:got + len(data)] = data
            got += len(data)
        return bytes(buf)

    def recv(self):
        """The next message (see the module text for what is refused)."""
        fds = []
        try:
            hlen, plen = _PREFIX.unpack(self._recv_exact(_PREFIX.size, fds))
            if hlen > MAX_HEADER or plen > MAX_PAYLOAD:
                _refuse("a frame of %d header and %d payload bytes (at most %d and %d)"
                        % (hlen, plen, MAX_HEADER, MAX_PAYLOAD))
            raw = self._recv_exact(hlen, fds)
            try:
                header = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                _refuse("the header is not JSON text (%s)" % e.__class__.__name__)
            if not (isinstance(header, dict) and set(header) == {"kind", "meta"} and
                    isinstance(header["meta"], dict)):
                _refuse("the header is not {\"kind\": name, \"meta\": object}")
            _check_kind(header["kind"])
            payload = self._recv_exact(plen, fds) if plen else b""
            if len(fds) > MAX_FDS:
                _refuse("%d descriptors with one message (at most %d)" % (len(fds), MAX_FDS))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return Message(header["kind"], header["meta"], payload, fds)

    def call(self, kind, meta=None, payload=b"", fds=(), progress=None):
        """Sends a request and returns the peer's reply. Messages of kind "progress" before
        the reply go to progress(message) (which may end the peer: then PeerClosed). A reply
        of kind "error" raises PeerError with the peer's text."""
        self.send(kind, meta, payload, fds)
        while True:
            msg = self.recv()
            if msg.kind == "progress":
                try:
                    if progress is not None:
                        progress(msg)
                finally:
                    msg.close()
                continue
            if msg.kind == "error":
                msg.close()
                error_type = msg.meta.get("type")
                raise PeerError("gpumem.colocate: the peer failed %r: %s"
                                % (kind, msg.meta.get("text", "?")),
                                error_type if isinstance(error_type, str) else None)
            return msg


def serve(channel, handlers):
    """The generator's loop: each request goes to handlers[kind](message, channel), which
    returns (meta, payload) for the reply ("<kind>.done"); a handler's exception becomes an
    "error" reply and the loop goes on. "stop" ends the loop (replied "stop.done"); so does
    the peer closing the channel (returns False; True after "stop")."""
    while True:
        try:
            msg = channel.recv()
        except PeerClosed:
            return False
        with msg:
            if msg.kind == "stop":
                channel.send("stop.done")
                return True
            handler = handlers.get(msg.kind)
            try:
                if handler is None:
                    raise KeyError("no handler for %r (have %s)"
                                   % (msg.kind, ", ".join(sorted(handlers))))
                meta, payload = handler(msg, channel)
            except PeerClosed:
                return False
            except Exception as e:  # pylint: disable=broad-except
                text = "%s: %s\n%s" % (type(e).__name__, e,
                                       "".join(traceback.format_exc(limit=6)))
                channel.send("error", {"text": text, "type": type(e).__name__})
                continue
            channel.send(msg.kind + ".done", meta or {}, payload or b"")


class Peer:
    """A child process with a channel to it."""

    def __init__(self, proc, channel):
        self.proc = proc
        self.channel = channel

    @classmethod
    def spawn(cls, argv, env=None, **popen_args):
        """Starts argv, its "{fd}" items replaced by the child's end of a new channel (the
        only descriptor it inherits beyond stdio)."""
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            fd = theirs.fileno()
            args = [a.replace("{fd}", str(fd)) if isinstance(a, str) else a for a in argv]
            proc = subprocess.Popen(args, pass_fds=[fd], env=env, **popen_args)
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        return cls(proc, Channel(mine))

    @property
    def pid(self):
        return self.proc.pid

    def alive(self):
        return self.proc.poll() is None

    def kill(self):
        """SIGKILL, wait for its end, close the channel; returns the exit status."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        status = self.proc.wait()
        self.channel.close()
        return status

    def stop(self, timeout=60):
        """Asks the child to stop, waits for it (killing it after `timeout` s); returns the
        exit status."""
        try:
            if self.proc.poll() is None and self.channel.sock is not None:
                self.channel.call("stop").close()
        except (PeerClosed, PeerError, OSError):
            pass
        self.channel.close()
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return self.kill()


def flat_layout(entries, alignment=256):
    """Places named buffers side by side in one region: entries are (name, nbytes);
    returns ({name: offset}, total bytes), each offset a multiple of `alignment`. The
    trainer allocates the region once (one descriptor to share), the generator maps it
    and reads each buffer at its offset."""
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError("gpumem.colocate: alignment %r is not a power of two" % (alignment,))
    offsets = {}
    total = 0
    for name, nbytes in entries:
        if name in offsets:
            raise ValueError("gpumem.colocate: %r twice in one layout" % (name,))
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError("gpumem.colocate: %r has %r bytes" % (name, nbytes))
        offsets[name] = total
        total += (nbytes + alignment - 1) // alignment * alignment
    return offsets, total


def open_fds():
    """File descriptors open in this process now."""
    return len(os.listdir("/proc/self/fd")) - 1  # less the one listdir opened


def rss_bytes():
    """This process's resident host memory (pinned host memory included)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def trainer_iteration(trainer, channel, iteration, progress=None):
    """One iteration of the two-process layout, on the trainer's side. `trainer` provides
    sleep() (its idle tags), request(iteration) -> (meta, payload) for the generator,
    wake(), train(reply) -> loss (the reply's payload holds the rollouts) and publish()
    (makes the new weights visible: an event the generator waits on, or a synchronize).
    The generator answers "generate" with "generate.done". Returns (loss, reply meta,
    timings in seconds); PeerClosed when the generator dies meanwhile (the trainer is
    awake again then, its bytes intact, and may go on)."""
    import time  # pylint: disable=import-outside-toplevel
    timings = {}
    t = time.perf_counter()
    trainer.sleep()
    timings["trainer_sleep_s"] = time.perf_counter() - t
    meta, payload = trainer.request(iteration)
    t = time.perf_counter()
    try:
        reply = channel.call("generate", meta, payload, progress=progress)
    except BaseException:
        trainer.wake()
        raise
    timings["generate_round_trip_s"] = time.perf_counter() - t
    with reply:
        t = time.perf_counter()
        trainer.wake()
        timings["trainer_wake_s"] = time.perf_counter() - t
        t = time.perf_counter()
        loss = trainer.train(reply)
        timings["train_s"] = time.perf_counter() - t
        t = time.perf_counter()
        trainer.publish()
        timings["publish_s"] = time.perf_counter() - t
        return loss, reply.meta, timings
