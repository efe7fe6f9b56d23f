"""The socket through which a worker hands its save jobs to its node's uploader.

``save()`` returns only once the node uploader has accepted the job (a save that returned
survives its worker), so the hand-off's round trip is on every save's blocking path. As a
Ray actor call it measured 7-23 ms on this project's 2-core machine with the training
ranks busy (several processes and threads between the caller and the method), against a
5-20 ms copy. Over a Unix socket a save waits only for its job's frame to be written:
once ``send`` returns, the frame is in the uploader's receive queue, where the kernel keeps
it when the worker dies (the uploader reads it before it sees the close). The uploader's
reply (accepted, or refused with an error) comes back later, like the job's other events.

The uploader listens on a socket in a directory only its user can enter (the frames are
pickles: whoever can connect can run code as that user). A worker finds its path with one
actor call, connects and says hello; from then on the connection *is* its registration:
the uploader counts connections as clients, and one that closes without ``bye`` is a
worker that died. Jobs go as requests that get a reply; each job's "released" and "done"
come back on the same connection when they happen, so no actor thread waits on a job.

A frame is a 4-byte big-endian length and a pickle. Both ends run this library, on one
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
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ray_goodput.checkpoint._backends import Handoff
from ray_goodput.errors import CheckpointError
from ray_goodput.runtime import pid_alive

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!I")
_MAX_FRAME = 1 << 30  # a job is tens of KB (slots, leaves, RNG state); more is a broken peer
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
        sock.sendall(_LENGTH.pack(len(blob)) + blob)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    parts, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def _recv(sock: socket.socket) -> tuple[Any, ...] | None:
    """The next message, or None when the peer closed the connection."""
    head = _recv_exact(sock, _LENGTH.size)
    if head is None:
        return None
    (size,) = _LENGTH.unpack(head)
    if size > _MAX_FRAME:
        raise CheckpointError(f"a {size}-byte frame on the uploader channel: the peer is not a ray_goodput channel")
    body = _recv_exact(sock, size)
    return None if body is None else pickle.loads(body)  # noqa: S301 - our own user's process


def portable_error(exc: BaseException) -> BaseException:
    """``exc`` when it pickles, else a CheckpointError carrying its type and text."""
    try:
        pickle.loads(pickle.dumps(exc))  # noqa: S301 - round trip of our own object
        return exc
    except Exception:  # noqa: BLE001 - any exception that does not survive a pickle
        return CheckpointError(f"{type(exc).__name__}: {exc}")


def socket_dir() -> Path:
    """A directory of this machine's temp dir that only this user can enter."""
    base = Path(tempfile.gettempdir()) / f"ray_goodput-{os.getuid()}"
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        info = base.lstat()
        if stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077:
            return base
    except OSError:
        pass
    return Path(tempfile.mkdtemp(prefix="rg-"))  # someone else's or unusable: a private one


# ---- the uploader's end ---------------------------------------------------------------


class Peer:
    """One worker's connection, as the uploader sees it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.said_bye = False

    def send(self, message: tuple[Any, ...]) -> None:
        """Send, dropping the message when the worker is gone (its jobs go on). A send
        that failed midway leaves the stream unusable: the connection is shut."""
        try:
            _send(self.sock, self.lock, message)
        except OSError as exc:
            logger.debug("a worker's uploader connection failed before %s reached it: %s", message[0], exc)
            _shut(self.sock)


class ChannelServer:
    """Listens for workers; runs ``on_hello(peer, pid, root)`` (False: refuse, the uploader
    is exiting), then ``on_request(peer, message)`` per request (its return value is the
    reply, a raise is sent back to be raised there) and ``on_close(peer)`` at the end."""

    def __init__(self, on_hello: Callable[[Peer, int, bytes | None], bool],
                 on_request: Callable[[Peer, tuple[Any, ...]], Any],
                 on_close: Callable[[Peer], None]) -> None:
        self._on_hello, self._on_request, self._on_close = on_hello, on_request, on_close
        self.path = str(socket_dir() / f"up-{os.getpid()}.sock")
        Path(self.path).unlink(missing_ok=True)  # a dead process's, with our pid reused
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        self._listener.listen(64)
        sweep_stale_sockets(Path(self.path).parent)
        threading.Thread(target=self._accept, name="rg-channel-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            _bound_sends(sock, _SEND_TIMEOUT_S)
            threading.Thread(target=self._serve, args=(Peer(sock),), name="rg-channel", daemon=True).start()

    def _serve(self, peer: Peer) -> None:
        hello = None
        try:
            hello = _recv(peer.sock)
            if hello is None or hello[0] != "hello":
                return
            accepted = self._on_hello(peer, hello[1], hello[2])
            peer.send(("welcome",) if accepted else ("exiting",))
            if accepted:
                self._serve_requests(peer)
        except (OSError, CheckpointError, pickle.UnpicklingError, EOFError) as exc:
            logger.warning("uploader channel: a worker's connection failed: %s", exc)
        finally:
            if hello is not None and hello[0] == "hello":
                self._on_close(peer)
            peer.sock.close()

    def _serve_requests(self, peer: Peer) -> None:
        while (message := _recv(peer.sock)) is not None:
            if message[0] == "bye":
                peer.said_bye = True
                continue
            rid = message[1]
            try:
                peer.send(("reply", rid, True, self._on_request(peer, message[2:])))
            except Exception as exc:  # noqa: BLE001 - the worker raises it
                peer.send(("reply", rid, False, portable_error(exc)))

    def close(self) -> None:
        Path(self.path).unlink(missing_ok=True)
        _shut(self._listener)  # wakes the accepting thread (a bare close does not, on Linux)
        self._listener.close()


def sweep_stale_sockets(directory: Path) -> None:
    """Remove the sockets of uploaders that died without removing their own."""
    for path in directory.glob("up-*.sock"):
        try:
            pid = int(path.stem.split("-", 1)[1])
        except ValueError:
            continue
        if not pid_alive(pid):
            path.unlink(missing_ok=True)


# ---- the worker's end -----------------------------------------------------------------


class ChannelClient:
    """A worker's connection to its node uploader: send jobs, get their events.

    Raises UploaderExitingError when the uploader refuses the hello (it is exiting),
    OSError when the socket cannot be reached; both within ``timeout_s``.
    """

    def __init__(self, path: str, pid: int, root: bytes | None, timeout_s: float) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._lock = threading.Lock()  # sends
        self._state_lock = threading.Lock()
        self._replies: dict[int, Future[Any]] = {}
        self._jobs: dict[str, Handoff] = {}
        self._ids = itertools.count()
        self._closed = False
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
            _send(self._sock, self._lock, ("hello", pid, root))
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
        if error is None:
            return
        with self._state_lock:
            handoff = self._jobs.pop(key, None)
        if handoff is not None:
            _settle(handoff.released, None, None)
            _settle(handoff.durable, None, error)

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
        except OSError as exc:
            _shut(self._sock)  # a frame cut midway: the reader sees the end and fails the rest
            raise UploaderGoneError(f"could not send {body[0]!r} to the node uploader: {exc}") from exc
        return reply

    def _read(self) -> None:
        try:
            while (message := _recv(self._sock)) is not None:
                self._dispatch(message)
        except (OSError, CheckpointError, pickle.UnpicklingError, EOFError) as exc:
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
                _settle(reply, value if ok else None, None if ok else value)
            return
        with self._state_lock:
            handoff = self._jobs.get(message[1]) if kind == "released" else self._jobs.pop(message[1], None)
        if handoff is None:
            return
        if kind == "released":
            _settle(handoff.released, None, None)
        else:  # "done": (key, result, error); its arena is free too
            _settle(handoff.released, None, None)
            _settle(handoff.durable, message[2], message[3])

    def _fail_all(self) -> None:
        with self._state_lock:
            self._closed = True
            replies, self._replies = list(self._replies.values()), {}
            jobs, self._jobs = list(self._jobs.values()), {}
        gone = UploaderGoneError("the node uploader closed its connection (it died or exited) "
                                 "before the save was durable; see `ray-goodput status`")
        for reply in replies:
            _settle(reply, None, gone)
        for handoff in jobs:
            _settle(handoff.released, None, None)  # its mapping died with it: the arena is free
            _settle(handoff.durable, None, gone)

    def close(self, timeout_s: float = 10.0) -> None:
        """Say bye (a clean close: the uploader may exit soon) and close."""
        if not self._closed:
            try:
                _send(self._sock, self._lock, ("bye",))
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._reader.join(timeout_s)
        self._sock.close()


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _settle(future: Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
