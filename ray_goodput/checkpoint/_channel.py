"""The socket through which a worker hands its save jobs to its node's uploader.

``save()`` returns only once the node uploader has accepted the job (a save that returned
survives its worker), so the hand-off's round trip is on every save's blocking path. As a
Ray actor call it measured 7-23 ms on this project's 2-core machine with the training
ranks busy (several processes and threads between the caller and the method), against a
5-20 ms copy. Over a Unix socket a save waits only for its job's frame to be written:
once ``send`` returns, the frame is in the uploader's receive queue, where the kernel keeps
it when the worker dies (the uploader reads it before it sees the close). The uploader's
reply (accepted, or refused with an error) comes back later, like the job's other events.
A clean close waits for the reply to its "bye": requests are served in order, so by then
every job sent before it has mapped its arena, and the worker may unlink its arenas.

A job's arena is free once the uploader says so, or once the uploader is gone. A connection
that breaks while the uploader lives (a send stuck past its bound, a frame it could not
read) does not free it: the uploader may still be writing from it. The worker then asks
the actor (``on_lost``), which answers once that connection's frames are all handled and
the job let go of its arena.

The uploader listens on a socket in a directory only its user can enter (the frames are
pickles: whoever can connect can run code as that user). A worker finds its path with one
actor call, connects and says hello; from then on the connection *is* its registration:
the uploader counts connections as clients, and one that closes without ``bye`` is a
worker that died. Jobs go as requests that get a reply; each job's "released" and "done"
come back on the same connection when they happen, so no actor thread waits on a job.

A frame is an 8-byte big-endian length and a pickle. Both ends run this library, on one
node, as one user.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import pickle
import socket
import stat
import struct
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from pathlib import Path
from typing import Any

from ray_goodput.checkpoint._backends import Handoff
from ray_goodput.errors import CheckpointError
from ray_goodput.runtime import pid_alive

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!Q")  # a job is KBs (slots, leaves, RNG state) plus its pickled plain values
# Bound on one frame's send when the other end stopped reading (a full socket buffer).
_SEND_TIMEOUT_S = 60


def _bound_sends(sock: socket.socket, seconds: int) -> None:
    """Make a blocking ``send`` on ``sock`` fail after ``seconds`` (receives stay unbounded:
    a reader thread waits for the next event as long as there is none)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, 0))


class UploaderGoneError(CheckpointError):
    """The connection to the node uploader closed: it died or exited."""


class UploaderExitingError(CheckpointError):
    """The uploader a worker tried to register with is exiting (it was idle with no live
    client); the worker waits until it is gone and makes a new one."""


# ---- frames ---------------------------------------------------------------------------


def _send(sock: socket.socket, lock: threading.Lock, message: tuple[Any, ...]) -> None:
    blob = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    with lock:
        sock.sendall(_LENGTH.pack(len(blob)))
        sock.sendall(blob)


def _recv_exact(sock: socket.socket, n: int) -> bytearray | None:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        count = sock.recv_into(view[got:])
        if not count:
            return None
        got += count
    return buf


def _recv(sock: socket.socket) -> tuple[Any, ...] | None:
    """The next message, or None when the peer closed the connection."""
    head = _recv_exact(sock, _LENGTH.size)
    if head is None:
        return None
    body = _recv_exact(sock, _LENGTH.unpack(head)[0])
    return None if body is None else pickle.loads(body)  # noqa: S301 - our own user's process


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` when it pickles, else a CheckpointError carrying its type and text."""
    try:
        pickle.loads(pickle.dumps(exc))  # noqa: S301 - round trip of our own object
        return exc
    except Exception:  # noqa: BLE001 - any exception that does not survive a pickle
        return CheckpointError(f"{type(exc).__name__}: {exc}")


def socket_dir() -> tuple[Path, bool]:
    """A directory of this machine's temp dir that only this user can enter, and whether
    it is a private one made for this caller alone (to remove when done)."""
    base = Path(tempfile.gettempdir()) / f"ray_goodput-{os.getuid()}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        info = base.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return base, False
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="rg-")), True  # someone else's or unusable


# ---- the uploader's end ---------------------------------------------------------------


class Peer:
    """One worker's connection, as the uploader sees it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.said_bye = False
        self.token = ""  # the worker's, from its hello
        self.ended = threading.Event()  # set once its last frame is handled

    def send(self, message: tuple[Any, ...]) -> None:
        """Send, dropping the message when the worker is gone (its jobs go on). A send
        that failed midway leaves the stream unusable: the connection is shut."""
        try:
            _send(self.sock, self.lock, message)
        except OSError as exc:
            logger.debug("a worker's uploader connection failed before %s reached it: %s", message[0], exc)
            _shut(self.sock)
        except Exception:  # noqa: BLE001 - a message that does not pickle: the worker must still hear
            logger.exception("uploader channel: could not send %s", message[0])
            _shut(self.sock)


class ChannelServer:
    """Listens for workers; runs ``on_hello(peer, pid, root, token)`` (False: refuse, the
    uploader is exiting), then ``on_request(peer, message)`` per request (its return value
    is the reply, a raise is sent back to be raised there) and ``on_close(peer)`` once the
    connection's last frame is handled. ``name``: this node's, in the socket's file name."""

    def __init__(self, name: str, on_hello: Callable[[Peer, int, bytes | None, str], bool],
                 on_request: Callable[[Peer, tuple[Any, ...]], Any],
                 on_close: Callable[[Peer], None]) -> None:
        self._on_hello, self._on_request, self._on_close = on_hello, on_request, on_close
        directory, self._private_dir = socket_dir()
        self.path = str(directory / f"up-{name[:12]}-{os.getpid()}.sock")
        Path(self.path).unlink(missing_ok=True)  # a dead process's, with our pid reused
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        sweep_stale_sockets(directory, name[:12])
        threading.Thread(target=self._accept, name="rg-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                sock.settimeout(None)  # reads wait for the next frame however long (not setdefaulttimeout)
                _bound_sends(sock, _SEND_TIMEOUT_S)
                threading.Thread(target=self._serve, args=(Peer(sock),), name="rg-channel", daemon=True).start()
            except Exception:  # noqa: BLE001 - one connection's set-up must not end the accepting
                logger.exception("uploader channel: could not set up a worker's connection")
                sock.close()

    def _serve(self, peer: Peer) -> None:
        hello = None
        try:
            hello = _recv(peer.sock)
            if hello is None or hello[0] != "hello":
                return
            accepted = self._on_hello(peer, *hello[1:4])
            peer.send(("welcome",) if accepted else ("exiting",))
            if accepted:
                self._serve_requests(peer)
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
            # A killed worker's connection ends in ECONNRESET when it had unread events.
            logger.debug("uploader channel: a worker's connection ended: %s", exc)
        finally:
            if hello is not None and hello[0] == "hello":
                self._on_close(peer)
            peer.ended.set()
            peer.sock.close()

    def _serve_requests(self, peer: Peer) -> None:
        while (message := _recv(peer.sock)) is not None:
            rid = message[1]
            if message[2] == "bye":
                peer.said_bye = True
                peer.send(("reply", rid, True, None))
                continue
            try:
                peer.send(("reply", rid, True, self._on_request(peer, message[2:])))
            except Exception as exc:  # noqa: BLE001 - the worker raises it
                peer.send(("reply", rid, False, portable_error(exc)))

    def close(self) -> None:
        Path(self.path).unlink(missing_ok=True)
        _shut(self._listener)  # wakes the accepting thread (a bare close does not, on Linux)
        self._listener.close()
        if self._private_dir:
            Path(self.path).parent.rmdir()


def sweep_stale_sockets(directory: Path, name: str) -> None:
    """Remove the sockets of this node's uploaders that died without removing their own."""
    for path in directory.glob(f"up-{name}-*.sock"):
        try:
            pid = int(path.stem.rsplit("-", 1)[1])
        except ValueError:
            continue
        if not pid_alive(pid):
            path.unlink(missing_ok=True)


# ---- the worker's end -----------------------------------------------------------------


class ChannelClient:
    """A worker's connection to its node uploader: send jobs, get their events.

    Raises UploaderExitingError when the uploader refuses the hello (it is exiting),
    OSError when the socket cannot be reached; both within ``timeout_s``. ``on_lost``
    gets the jobs whose arena was not released when the connection broke (see the module
    docstring); without it they are released.
    """

    def __init__(self, path: str, hello: tuple[int, bytes | None, str], timeout_s: float,
                 on_lost: Callable[[list[Handoff]], None] | None = None) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()  # sends
        self._state_lock = threading.Lock()
        self._replies: dict[int, Future[Any]] = {}
        self._jobs: dict[str, Handoff] = {}
        self._ids = itertools.count()
        self._closed = False
        self._closing = False
        self._on_lost = on_lost
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
            _send(self._sock, self._lock, ("hello", *hello))
            answer = _recv(self._sock)
            self._sock.settimeout(None)
            _bound_sends(self._sock, max(1, int(timeout_s)))
        except BaseException:
            self._sock.close()
            raise
        if answer is None or answer[0] != "welcome":
            self._sock.close()
            if answer is not None and answer[0] == "exiting":
                raise UploaderExitingError("the node uploader is exiting (idle with no live client); "
                                           "register with a new one")
            raise UploaderGoneError("the node uploader closed the connection during the hello")
        self._reader = threading.Thread(target=self._read, name="rg-channel-reader", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return not self._closed

    def submit(self, job: Any, root: bytes | None, handoff: Handoff) -> None:
        """Hand ``job`` over: return once its frame is in the uploader's socket queue.
        ``handoff`` gets its acceptance (a refusal fails it), release and end. Raises
        UploaderGoneError when the uploader's end is closed or the send ran past its bound."""
        with self._state_lock:
            if self._closed:
                raise UploaderGoneError("the connection to the node uploader is closed")
            self._jobs[handoff.key] = handoff  # before the send: its events may come first
        try:
            reply = self._send_request(("submit", job, root))
        except BaseException:
            with self._state_lock:
                self._jobs.pop(handoff.key, None)
            raise
        reply.add_done_callback(functools.partial(self._refused, handoff.key))

    def _refused(self, key: str, reply: Future[Any]) -> None:
        error = reply.exception()
        if error is None or isinstance(error, UploaderGoneError):  # gone: _fail_all settles the job
            return
        with self._state_lock:
            handoff = self._jobs.pop(key, None)
        if handoff is not None:  # never accepted: its arena was not mapped
            settle(handoff.released, None, None)
            settle(handoff.durable, None, error)

    def request(self, body: tuple[Any, ...], timeout_s: float) -> Any:
        """Send one request and return its reply within ``timeout_s`` (TimeoutError)."""
        try:
            return self._send_request(body).result(timeout=timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"the node uploader did not answer {body[0]!r} within {timeout_s:.0f}s") from exc

    def _send_request(self, body: tuple[Any, ...]) -> Future[Any]:
        reply: Future[Any] = Future()
        with self._state_lock:
            if self._closed:
                raise UploaderGoneError("the connection to the node uploader is closed")
            rid = next(self._ids)
            self._replies[rid] = reply
        try:
            _send(self._sock, self._lock, ("request", rid, *body))
        except BaseException as exc:
            with self._state_lock:
                self._replies.pop(rid, None)
            if not isinstance(exc, OSError):
                raise
            _shut(self._sock)  # a frame cut midway: the reader sees the end and fails the rest
            raise UploaderGoneError(f"could not send {body[0]!r} to the node uploader: {exc}") from exc
        return reply

    def _read(self) -> None:
        try:
            while (message := _recv(self._sock)) is not None:
                self._dispatch(message)
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
            logger.debug("uploader channel read ended: %s", exc)
        finally:
            self._fail_all()

    def _dispatch(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "reply":
            _, rid, ok, value = message
            with self._state_lock:
                reply = self._replies.pop(rid, None)
            if reply is not None:
                settle(reply, value if ok else None, None if ok else value)
            return
        with self._state_lock:
            handoff = self._jobs.get(message[1]) if kind == "released" else self._jobs.pop(message[1], None)
        if handoff is None:
            return
        if kind == "released":
            settle(handoff.released, None, None)
        else:  # "done": (key, result, error); its arena is free too
            settle(handoff.released, None, None)
            settle(handoff.durable, message[2], message[3])

    def _fail_all(self) -> None:
        with self._state_lock:
            self._closed = True
            replies, self._replies = list(self._replies.values()), {}
            jobs, self._jobs = list(self._jobs.values()), {}
        gone = UploaderGoneError("the connection to the node uploader closed before the save was durable "
                                 "(the uploader died, exited or could not read it); see `ray-goodput status`")
        for reply in replies:
            settle(reply, None, gone)
        for handoff in jobs:
            settle(handoff.durable, None, gone)
        held = [h for h in jobs if not h.released.done()]
        if held and self._on_lost is not None and not self._closing:
            self._on_lost(held)  # the uploader may live on and still write from those arenas
            return
        for handoff in held:
            settle(handoff.released, None, None)

    def close(self, timeout_s: float = 30.0) -> None:
        """Say bye and wait for the answer (every job sent before has mapped its arena by
        then; bounded by ``timeout_s``), then close: a clean close, the uploader may exit."""
        self._closing = True
        try:
            self.request(("bye",), timeout_s)
        except (UploaderGoneError, TimeoutError) as exc:
            logger.warning("closing the uploader connection without its goodbye: %s", exc)
        _shut(self._sock)
        self._reader.join(timeout_s)
        self._sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def settle(future: Future[Any], result: Any, error: BaseException | None) -> None:
    """Set ``future``'s outcome unless it has one (the first to settle it wins)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
