"""The socket through which a worker hands its save jobs to its node's uploader.

A save that returned must survive its worker being killed, so the job has to be out of
the worker's process before ``save()`` returns. Over a Unix socket a save waits only for
its job's frame to be written, and only when the socket's send buffer has room for it
(``submit(now=True)``; the caller keeps the job in a file otherwise): once ``send``
returns, the frame is in the uploader's receive queue, where the kernel keeps it when the
worker dies (the uploader reads it before it sees the close). An actor call would wait
for the uploader's answer (docs/design/uploader-channel.md has the measurements). The
uploader maps the job's arena when it handles the frame; its reply (accepted, or refused
with an error) comes back later, like the job's other events. A final close waits for
the reply to its "bye": requests are served in order, so by then every job sent before it
has mapped its arena, and the worker may unlink its arenas.

A job's arena is free once the uploader says so, or once the uploader is gone. A connection
that breaks while the uploader lives (a send stuck past its bound, a frame it could not
read, a reconnect) does not free it, and does not decide the job's outcome: the uploader
may still be writing from the arena, and may still commit. The worker hands those jobs to
``on_lost``, which asks the actor; it answers once that connection's frames are all
handled, and then for each job as it lets go of its arena and as it ends. Child processes
forked from a worker (DataLoader workers) close their inherited copy of the socket, so a
dead worker's connection ends when the worker does.

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

import fcntl
import functools
import itertools
import logging
import os
import pickle
import socket
import stat
import struct
import tempfile
import termios
import threading
import uuid
import weakref
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from pathlib import Path
from typing import Any

from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.errors import CheckpointError
from ray_goodput.runtime import pid_alive

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("!Q")  # a job is KBs (slots, leaves, RNG state) plus its pickled plain values
# Bound on one frame's send when the other end stopped reading (a full socket buffer).
_SEND_TIMEOUT_S = 60
# The send buffer a worker asks for (the kernel caps it at net.core.wmem_max): room for
# the frames of saves made while the uploader does not read.
_SEND_BUFFER = 4 << 20


def _bound_sends(sock: socket.socket, seconds: int) -> None:
    """Make a blocking ``send`` on ``sock`` fail after ``seconds`` (receives stay unbounded:
    a reader thread waits for the next event as long as there is none)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", seconds, 0))


class UploaderGoneError(CheckpointError):
    """The connection to the node uploader closed: it died or exited."""


class UploaderExitingError(CheckpointError):
    """The uploader a worker tried to register with is exiting (it was idle with no live
    client); the worker waits until it is gone and makes a new one."""


def _has_room(sock: socket.socket, size: int) -> bool:
    """Whether writing a frame of ``size`` bytes to ``sock`` cannot block. The caller holds
    the send lock (the peer's reads only make room).

    On a Unix stream socket the sender is charged for what the peer has not read, buffers'
    overhead included (``TIOCOUTQ``), against ``SO_SNDBUF`` (the doubled value the kernel
    keeps); a send blocks only when the charge has reached the limit before it takes its
    next buffer (of up to ~36 KB, each charged its bytes plus under 1 KB, a lone small one
    up to ~2.6 KB). So the charge now, the frame and a margin of 1 KB per 16 KB plus 3 KB
    staying within the limit means no buffer of the send finds it reached. Where the
    socket cannot tell (not Linux), the frame is written as before, and may block."""
    global _room_unknown_logged  # noqa: PLW0603 - one log line per process
    try:
        limit = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        charged = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    except OSError as exc:
        if not _room_unknown_logged:
            _room_unknown_logged = True
            logger.warning("cannot read the uploader socket's queue (%s): a save may wait for the uploader", exc)
        return True
    return charged + size + (size // 16384 + 3) * 1024 <= limit


_room_unknown_logged = False


def _peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket (None where unknown)."""
    try:
        pid, _, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    except (OSError, AttributeError):  # AttributeError: no SO_PEERCRED (not Linux)
        return None
    return pid or None


# ---- frames ---------------------------------------------------------------------------


def _frame(message: tuple[Any, ...]) -> bytes:
    """``message`` as a frame's body (a pickling error raises here, before any byte is sent)."""
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def _write(sock: socket.socket, lock: threading.Lock, blob: bytes) -> None:
    """Write one frame under the connection's send lock (see :func:`_send_frame`)."""
    with lock:
        _send_frame(sock, blob)


def _send_frame(sock: socket.socket, blob: bytes) -> None:
    """Write one frame; the caller holds the send lock. Anything that stops it midway (an
    error, a timeout, an interrupt) leaves a partial frame that would put the reader out
    of step: the socket is shut."""
    try:
        sock.sendall(_LENGTH.pack(len(blob)))
        sock.sendall(blob)
    except BaseException:
        _shut(sock)
        raise


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
        self.final = False  # its goodbye said the worker is done: nobody asks about its jobs
        self.conn = ""  # the connection's id, from the worker's hello
        self.pid: int | None = None  # the worker's process, once its hello was accepted
        self.ended = threading.Event()  # set once its last frame is handled

    def send(self, message: tuple[Any, ...]) -> bool:
        """Send; False when the worker is gone or the connection broke (its jobs go on,
        and the worker asks the actor for what it did not hear)."""
        try:
            _write(self.sock, self.lock, _frame(message))
            return True
        except OSError as exc:
            logger.debug("a worker's uploader connection failed before %s reached it: %s", message[0], exc)
        except Exception:  # a message that does not pickle: the worker must still hear
            logger.exception("uploader channel: could not send %s", message[0])
            _shut(self.sock)  # the worker sees the end and asks the actor
        return False


class ChannelServer:
    """Listens for workers; runs ``on_hello(peer, pid, root, token, conn)`` (False: refuse,
    the uploader is exiting), then ``on_request(peer, message)`` per request (its return value
    is the reply, a raise is sent back to be raised there) and ``on_close(peer)`` once the
    connection's last frame is handled. ``name``: this node's, in the socket's file name."""

    def __init__(
        self,
        name: str,
        on_hello: Callable[[Peer, int, bytes | None, str, str], bool],
        on_request: Callable[[Peer, tuple[Any, ...]], Any],
        on_close: Callable[[Peer], None],
    ) -> None:
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
            except Exception:  # one connection's set-up must not end the accepting
                logger.exception("uploader channel: could not set up a worker's connection")
                sock.close()

    def _serve(self, peer: Peer) -> None:
        hello = None
        try:
            hello = _recv(peer.sock)
            if hello is None or hello[0] != "hello":
                return
            accepted = self._on_hello(peer, *hello[1:5])
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
                peer.said_bye, peer.final = True, bool(message[3])
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


_open_clients: weakref.WeakSet[ChannelClient] = weakref.WeakSet()


def _close_in_child() -> None:
    """After a fork: the child closes its copies of the worker's sockets (closing a copy
    leaves the parent's connection alone; a shutdown would end it). Else a killed
    worker's connection would stay open, to the uploader a live client, while its
    DataLoader children live."""
    for client in list(_open_clients):
        client._forked()  # noqa: SLF001 - this module's own client class


os.register_at_fork(after_in_child=_close_in_child)


class ChannelClient:
    """A worker's connection to its node uploader: send jobs, get their events.

    Raises UploaderExitingError when the uploader refuses the hello (it is exiting),
    OSError when the socket cannot be reached; both within ``timeout_s``. ``on_lost(conn,
    jobs)`` gets the jobs that had not ended when the connection broke, unless a final
    close's goodbye was answered (see the module docstring); without it their arenas are
    released and their outcome fails. ``conn`` (also :attr:`conn`) names this connection
    to the uploader.
    """

    def __init__(
        self,
        path: str,
        hello: tuple[int, bytes | None, str],
        timeout_s: float,
        on_lost: Callable[[str, list[Handoff]], None] | None = None,
    ) -> None:
        self.conn = uuid.uuid4().hex
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        _open_clients.add(self)  # from here: a fork during the hello closes the child's copy too
        self._lock = threading.Lock()  # sends
        self._state_lock = threading.Lock()
        self._replies: dict[int, Future[Any]] = {}
        self._jobs: dict[str, Handoff] = {}
        self._ids = itertools.count()
        self._closed = False
        self._release_held = False  # a final close's goodbye was answered
        self._on_lost = on_lost
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SEND_BUFFER)
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
            _write(self._sock, self._lock, _frame(("hello", *hello, self.conn)))
            answer = _recv(self._sock)
            self._sock.settimeout(None)
            _bound_sends(self._sock, max(1, int(timeout_s)))
        except BaseException:
            _open_clients.discard(self)
            self._sock.close()
            raise
        #: The uploader's pid (the process whose receive queue holds what was sent).
        self.peer_pid: int | None = _peer_pid(self._sock)
        if answer is None or answer[0] != "welcome":
            _open_clients.discard(self)
            self._sock.close()
            if answer is not None and answer[0] == "exiting":
                raise UploaderExitingError(
                    "the node uploader is exiting (idle with no live client); register with a new one"
                )
            raise UploaderGoneError("the node uploader closed the connection during the hello")
        self._reader = threading.Thread(target=self._read, name="rg-channel-reader", daemon=True)
        self._reader.start()

    def _forked(self) -> None:
        """In a forked child: this copy is not the worker's connection; close it quietly."""
        self._closed = True
        self._jobs, self._replies = {}, {}
        try:
            self._sock.close()
        except OSError:
            pass

    @property
    def alive(self) -> bool:
        return not self._closed

    def submit(self, job: Any, root: bytes | None, handoff: Handoff, *, now: bool = False) -> bool:
        """Hand ``job`` over: return once its frame is in the uploader's socket queue.
        ``handoff`` gets its acceptance (a refusal fails it), release and end. ``now``: only
        if the send buffer has room for the frame, so that the send cannot wait for the
        uploader to read; returns False, having sent nothing, when it has not. Raises
        UploaderGoneError when the uploader's end is closed or the send ran past its bound."""
        reply = self._send_request(("submit", job, root), handoff, now=now)
        if reply is None:
            return False
        reply.add_done_callback(functools.partial(self._refused, handoff.key))
        return True

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
        except (TimeoutError, FutureTimeout) as exc:  # two classes before Python 3.11
            raise TimeoutError(f"the node uploader did not answer {body[0]!r} within {timeout_s:.0f}s") from exc

    def _send_request(
        self, body: tuple[Any, ...], handoff: Handoff | None = None, *, now: bool = False
    ) -> Future[Any] | None:
        """Send a request (``handoff``: the job it submits). A job is registered, and its
        frame written, under the send lock, which ``_fail_all`` takes to collect the jobs
        of a broken connection: a job whose send failed is never among them (its error is
        the caller's alone), and one sent whole always is. ``now``: None, nothing sent,
        when the send buffer has no room for the frame."""
        rid = next(self._ids)
        blob = _frame(("request", rid, *body))  # a pickling error raises here, before anything is kept
        reply: Future[Any] = Future()
        with self._lock:
            if now and not self._closed and not _has_room(self._sock, _LENGTH.size + len(blob)):
                return None
            with self._state_lock:
                if self._closed:
                    raise UploaderGoneError("the connection to the node uploader is closed")
                self._replies[rid] = reply
                if handoff is not None:
                    self._jobs[handoff.key] = handoff  # before the send: its events may come first
            try:
                _send_frame(self._sock, blob)  # shuts the socket if cut midway: the reader sees the end
            except BaseException as exc:
                with self._state_lock:
                    self._replies.pop(rid, None)
                    if handoff is not None:
                        self._jobs.pop(handoff.key, None)
                if isinstance(exc, OSError):
                    raise UploaderGoneError(f"could not send {body[0]!r} to the node uploader: {exc}") from exc
                raise
        return reply

    def _read(self) -> None:
        try:
            while (message := _recv(self._sock)) is not None:
                self._dispatch(message)
        except (OSError, pickle.UnpicklingError, EOFError, ValueError) as exc:
            logger.debug("uploader channel read ended: %s", exc)
        finally:
            _shut(self._sock)  # the uploader's next send fails: it keeps what it could not tell
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
        with self._lock, self._state_lock:  # a send in flight ends first (the socket is shut)
            self._closed = True
            replies, self._replies = list(self._replies.values()), {}
            jobs, self._jobs = list(self._jobs.values()), {}
        gone = UploaderGoneError(
            "the connection to the node uploader closed before the save was durable "
            "(the uploader died, exited or could not read it); see `ray-goodput status`"
        )
        for reply in replies:  # a submit's refusal callback leaves a gone job to what follows
            settle(reply, None, gone)
        if jobs and self._on_lost is not None and not self._release_held:
            try:
                self._on_lost(self.conn, jobs)  # the uploader may live on, write from them, commit them
                return
            except Exception:  # nobody to ask: the jobs fail here
                logger.exception("could not ask the node uploader about %d jobs of a broken connection", len(jobs))
        for handoff in jobs:
            settle(handoff.released, None, None)
            settle(handoff.durable, None, gone)

    def close(self, timeout_s: float = 30.0, final: bool = True) -> bool:
        """Say bye and wait for the answer (bounded by ``timeout_s``): every job sent before
        has mapped its arena by then. Returns whether it was answered. ``final``: the worker
        unlinks its arenas next and reuses none, so jobs still running once the goodbye
        was answered release them here; a reconnect (``final=False``) leaves them to
        ``on_lost``."""
        answered = False
        try:
            self.request(("bye", final), timeout_s)
            answered = True
        except (UploaderGoneError, TimeoutError) as exc:
            logger.warning("closing the uploader connection without its goodbye: %s", exc)
        self._release_held = final and answered
        _open_clients.discard(self)
        _shut(self._sock)
        self._reader.join(timeout_s)
        self._sock.close()
        return answered


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
