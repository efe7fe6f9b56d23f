"""The worker-to-uploader socket (``checkpoint/uploader/_channel.py``) between real processes and
threads, with stand-in handlers for the uploader's side (its real use is in
test_uploader_faults and test_uploader); and, as pure logic, how the uploader
answers for the jobs of a broken connection."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from concurrent.futures import Future
from types import SimpleNamespace

import pytest

from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.checkpoint.uploader import _channel
from ray_goodput.checkpoint.uploader._channel import (
    ChannelClient,
    ChannelServer,
    UploaderExitingError,
    UploaderGoneError,
)
from ray_goodput.errors import CheckpointError
from ray_goodput.testing import wait_for


class _Uploader:
    """Stand-in handlers: records requests, answers a submit per ``answer``."""

    def __init__(self, *, welcome: bool = True) -> None:
        self.welcome = welcome
        self.requests: list[tuple] = []
        self.closed: list[bool] = []  # said_bye of each closed connection
        self.peers: list = []
        self.gate = threading.Event()
        self.gate.set()
        self.server = ChannelServer("node", self.hello, self.request, self.close)

    def hello(self, peer, pid: int, root: bytes | None, token: str, conn: str) -> bool:
        peer.conn = conn  # as the uploader does: the name its worker asks about it by
        self.peers.append(peer)
        return self.welcome

    def request(self, peer, body: tuple):
        if not self.gate.wait(60):
            raise TimeoutError("the test never opened the gate")
        self.requests.append(body)
        if body[0] == "submit" and body[1] == "refuse":
            raise CheckpointError("the uploader refused this job")
        return body[1] == "waiting" if body[0] == "cancel" else None

    def close(self, peer) -> None:
        self.closed.append(peer.said_bye)


def _handoff(key: str) -> Handoff:
    return Handoff(released=Future(), durable=Future(), key=key)


def _client_telling(uploader: _Uploader, lost: list) -> ChannelClient:
    """A client whose broken connection appends (conn, jobs) to ``lost``."""
    return ChannelClient(
        uploader.server.path, (os.getpid(), None, "t"), 10, on_lost=lambda conn, jobs: lost.append((conn, jobs))
    )


@pytest.fixture
def uploader():
    up = _Uploader()
    yield up
    up.server.close()


def test_a_job_gets_its_release_and_result_pushed_back_and_a_clean_close_says_bye(uploader):
    client = ChannelClient(uploader.server.path, (os.getpid(), b"root", "t"), 10)
    handoff = _handoff("job-1")
    client.submit("job-1", b"root", handoff)
    wait_for(lambda: uploader.requests == [("submit", "job-1", b"root")], timeout_s=10, what="the submit")
    peer = uploader.peers[0]
    peer.send(("released", "job-1"))
    assert handoff.released.result(timeout=10) is None and not handoff.durable.done()
    peer.send(("done", "job-1", {"state": "committed"}, None))
    assert handoff.durable.result(timeout=10) == {"state": "committed"}
    assert client.request(("cancel", "waiting"), 10) is True
    client.close()
    wait_for(lambda: uploader.closed == [True], timeout_s=10, what="the uploader seeing a clean close")


def test_a_refused_job_fails_its_save_and_frees_its_arena(uploader):
    client = ChannelClient(uploader.server.path, (os.getpid(), None, "t"), 10)
    handoff = _handoff("refuse")
    client.submit("refuse", None, handoff)  # returns before the answer
    with pytest.raises(CheckpointError, match="refused this job"):
        handoff.durable.result(timeout=10)
    assert handoff.released.done()
    client.close()


def test_a_clean_close_returns_only_once_every_job_sent_before_it_was_handled(uploader):
    # The worker unlinks its arenas right after: a job still unread then would find its
    # arena gone (found in review).
    uploader.gate.clear()
    client = ChannelClient(uploader.server.path, (os.getpid(), None, "t"), 10)
    client.submit("job-1", None, _handoff("job-1"))
    closer = threading.Thread(target=client.close)
    closer.start()
    closer.join(0.5)
    assert closer.is_alive() and uploader.requests == []
    uploader.gate.set()
    closer.join(30)
    assert not closer.is_alive() and uploader.requests == [("submit", "job-1", None)]
    # The uploader sees the end after the goodbye's answer went out: not yet, maybe.
    wait_for(lambda: uploader.closed == [True], timeout_s=10, what="the uploader seeing a clean close")


def test_a_connection_broken_while_the_uploader_lives_does_not_free_its_jobs_arenas(uploader):
    # The uploader may still be writing from a job's arena: reusing it would tear that
    # checkpoint, and may still commit it (found in review). The jobs go to on_lost, which
    # asks the uploader; nothing is decided here.
    lost: list = []
    client = _client_telling(uploader, lost)
    handoff = _handoff("job-1")
    client.submit("job-1", None, handoff)
    wait_for(lambda: uploader.requests, timeout_s=10, what="the submit")
    uploader.peers[0].sock.shutdown(socket.SHUT_RDWR)  # a send past its bound shuts it so
    wait_for(lambda: lost, timeout_s=10, what="the broken connection's jobs handed to on_lost")
    assert lost == [(client.conn, [handoff])] and uploader.peers[0].conn == client.conn
    assert not handoff.released.done() and not handoff.durable.done()
    client.close()


def test_a_reconnect_leaves_a_running_jobs_arena_to_on_lost_and_only_a_final_goodbye_frees_it(uploader):
    # Before, any close released the arenas of the jobs still running; a worker that
    # reconnects after a failed send goes on saving, and would overwrite an arena the
    # uploader was still writing from (found in review).
    lost: list = []
    client = _client_telling(uploader, lost)
    running = _handoff("job-1")
    client.submit("job-1", None, running)
    assert client.close(final=False) is True
    assert lost == [(client.conn, [running])] and not running.released.done()
    final = _client_telling(uploader, lost)
    assert final.conn != client.conn  # the uploader is asked about a broken one by its own id
    last = _handoff("job-2")
    final.submit("job-2", None, last)
    assert final.close() is True  # the goodbye was answered: the job mapped its arena
    assert len(lost) == 1 and last.released.done()
    with pytest.raises(UploaderGoneError):
        last.durable.result(timeout=10)


def test_the_uploaders_end_closing_fails_what_is_pending_and_every_later_send(uploader):
    client = ChannelClient(uploader.server.path, (os.getpid(), None, "t"), 10)
    handoff = _handoff("job-1")
    client.submit("job-1", None, handoff)
    wait_for(lambda: uploader.requests, timeout_s=10, what="the submit")
    uploader.peers[0].sock.shutdown(socket.SHUT_RDWR)  # as the uploader process dying closes it
    with pytest.raises(UploaderGoneError):
        handoff.durable.result(timeout=10)
    assert handoff.released.done()  # its mapping died with it
    wait_for(lambda: not client.alive, timeout_s=10, what="the client seeing the close")
    with pytest.raises(UploaderGoneError):
        client.submit("job-2", None, _handoff("job-2"))
    client.close()


def test_a_closed_server_stops_accepting_and_leaves_no_socket_file(uploader):
    uploader.server.close()
    assert not os.path.exists(uploader.server.path)
    with pytest.raises(OSError):
        ChannelClient(uploader.server.path, (os.getpid(), None, "t"), 10)


def test_an_exiting_uploader_refuses_the_hello():
    up = _Uploader(welcome=False)
    try:
        with pytest.raises(UploaderExitingError):
            ChannelClient(up.server.path, (os.getpid(), None, "t"), 10)
    finally:
        up.server.close()


_SUBMIT_AND_DIE = """
import os, signal, sys
from concurrent.futures import Future
from types import SimpleNamespace
from ray_goodput.checkpoint.save._handoff import Handoff
from ray_goodput.checkpoint.uploader._channel import ChannelClient
client = ChannelClient(sys.argv[1], (os.getpid(), None, "t"), 10)
for key in ("first", "second"):
    client.submit(key, None, Handoff(released=Future(), durable=Future(), key=key))
os.kill(os.getpid(), signal.SIGKILL)
"""


_FORK_THEN_DIE = """
import os, signal, sys, time
from ray_goodput.checkpoint.uploader._channel import ChannelClient
client = ChannelClient(sys.argv[1], (os.getpid(), None, "t"), 10)
child = os.fork()
if child == 0:  # a DataLoader worker: lives on a while after its parent is killed
    os.close(1), os.close(2)  # the test reads the parent's output to its end
    time.sleep(120)
    os._exit(0)
print(child, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_workers_connection_ends_while_its_forked_children_live(uploader):
    # A forked child holding a copy of the socket kept the connection open: the uploader
    # counted a dead worker as a live client until its DataLoader children exited.
    proc = subprocess.run(
        [sys.executable, "-c", _FORK_THEN_DIE, uploader.server.path], timeout=120, capture_output=True, text=True
    )
    assert proc.returncode == -9, proc.stderr
    child = int(proc.stdout.split()[0])
    try:
        wait_for(
            lambda: uploader.closed == [False],
            timeout_s=10,
            what="the killed worker's connection closing while its child lives",
        )
        assert os.path.exists(f"/proc/{child}")
    finally:
        os.kill(child, 9)


def test_a_job_written_before_its_worker_was_killed_is_still_read(uploader):
    # submit() returns once the frame is written; the uploader is still busy with the
    # first job when the worker is SIGKILLed, so the second frame is read only after its
    # writer is dead (the kernel keeps it in the socket's queue), and then the close.
    uploader.gate.clear()
    child = subprocess.run(
        [sys.executable, "-c", _SUBMIT_AND_DIE, uploader.server.path], timeout=120, capture_output=True, text=True
    )
    assert child.returncode == -9, child.stderr
    assert uploader.requests == [] and uploader.closed == []
    uploader.gate.set()
    wait_for(lambda: uploader.closed == [False], timeout_s=10, what="the dead worker's close")
    assert [r[1] for r in uploader.requests] == ["first", "second"]


def test_a_send_cut_midway_ends_the_connection_instead_of_leaving_a_partial_frame(uploader):
    # The uploader is busy (it stopped reading): a big frame fills the socket buffer and
    # its send runs past the bound. The frame's first bytes are in the socket already: a
    # later frame on the same connection would be read as the rest of it.
    uploader.gate.clear()
    lost: list = []
    # The hello gets 10 s (a loaded machine); the sends get the 1 s bound under test.
    client = ChannelClient(
        uploader.server.path, (os.getpid(), None, "t"), 10, on_lost=lambda conn, jobs: lost.append((conn, jobs))
    )
    _channel._bound_sends(client._sock, 1)
    running = _handoff("job-1")
    client.submit("job-1", None, running)
    wait_for(lambda: uploader.peers, timeout_s=10, what="the connection")
    big = _handoff("job-2")
    with pytest.raises(UploaderGoneError, match="could not send 'submit'"):
        client.submit(b"x" * (64 << 20), None, big)
    wait_for(lambda: lost, timeout_s=10, what="the cut connection's jobs handed to on_lost")
    assert not client.alive and not big.durable.done()  # never accepted: the caller has the error already
    assert lost == [(client.conn, [running])]  # the job sent whole is asked about
    uploader.gate.set()
    wait_for(lambda: uploader.closed == [False], timeout_s=10, what="the uploader seeing the end")
    assert uploader.requests == [("submit", "job-1", None)]  # the cut frame was never handled
    with pytest.raises(UploaderGoneError):
        client.submit("job-3", None, _handoff("job-3"))
    client.close(timeout_s=1)


def test_a_job_handed_over_now_is_not_sent_at_all_when_the_socket_has_no_room_for_it(uploader):
    # save() hands its job over "now": a send that would wait for the uploader to read
    # (its buffer full of frames it has not read, or a frame larger than the buffer) sends
    # nothing, so the caller can keep the job another way; the connection stays usable.
    uploader.gate.clear()  # the uploader reads the first frame, then stops reading
    client = ChannelClient(uploader.server.path, (os.getpid(), None, "t"), 10)
    assert client.submit("job-1", None, _handoff("job-1"), now=True)
    wait_for(lambda: uploader.peers, timeout_s=10, what="the connection")
    room = client._sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    assert not client.submit(b"x" * room, None, _handoff("huge"), now=True)  # never fits
    sent = []
    for i in range(2, 64):
        if not client.submit(b"x" * (room // 8), None, _handoff(f"job-{i}"), now=True):
            break
        sent.append(i)
    assert 4 <= len(sent) < 8, (len(sent), room)
    assert client.alive
    uploader.gate.set()
    wait_for(lambda: len(uploader.requests) == 1 + len(sent), timeout_s=30, what="every frame sent read")
    assert [len(r[1]) for r in uploader.requests[1:]] == [room // 8] * len(sent)  # whole, in order
    assert client.submit("job-last", None, _handoff("job-last"), now=True)  # read: room again
    wait_for(lambda: len(uploader.requests) == 2 + len(sent), timeout_s=30, what="the last frame read")
    assert client.close(timeout_s=10)


def test_a_connection_that_breaks_while_a_job_is_pickled_leaves_that_job_to_its_caller(uploader):
    # The job used to be registered before its frame was pickled: a break in between
    # handed it to on_lost as well as raising to the caller (found in review).
    lost: list = []
    client = _client_telling(uploader, lost)
    wait_for(lambda: uploader.peers, timeout_s=10, what="the connection")

    class _BreaksTheConnection:
        def __reduce__(self):
            uploader.peers[0].sock.shutdown(socket.SHUT_RDWR)
            client._reader.join(10)  # the reader saw the end and failed what it had
            return (str, ("job",))

    with pytest.raises(UploaderGoneError):
        client.submit(_BreaksTheConnection(), None, _handoff("job-1"))
    assert lost == [] and not client.alive
    client.close(timeout_s=1)


def test_a_request_nobody_answers_raises_timeout_naming_it(uploader):
    uploader.gate.clear()
    client = ChannelClient(uploader.server.path, (os.getpid(), None, "t"), 10)
    with pytest.raises(TimeoutError, match="did not answer 'cancel' within"):
        client.request(("cancel", "waiting"), 0.3)
    uploader.gate.set()
    assert client.close() is True


# ---- the uploader's bookkeeping for broken connections (pure logic, no actor) ---------


def _bare_uploader():
    """A CheckpointUploader without its actor, socket or watchdog (nor its os.nice)."""
    from ray_goodput.checkpoint.uploader._actor import CheckpointUploader

    up = CheckpointUploader.__new__(CheckpointUploader)
    up.node_id, up._lock = "node", threading.Lock()
    up._jobs, up._clients, up._peers, up._connections = {}, set(), set(), {}
    return up


def _ended_ticket(key: str, owner_pid: int, origin: str, result=None):
    from ray_goodput.checkpoint.uploader._rank_queue import Ticket

    ticket = Ticket(
        SimpleNamespace(
            key=key, slots=(), arena_path="/nonexistent/a.arena", step=1, rank=0, save_id="n", owner_pid=owner_pid
        )
    )
    ticket.origin = origin
    ticket.finish(result, None)
    return ticket


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True, timeout=60, check=True
    )
    return int(proc.stdout)


def test_a_broken_connections_job_is_answered_only_to_the_connection_it_came_on():
    # A retry of the same key on a new connection must not answer for the old one: the
    # old attempt's arena and outcome are that connection's (found in review).
    up = _bare_uploader()
    up._jobs["k"] = _ended_ticket("k", os.getpid(), origin="conn-new", result="committed")
    up.wait_released("k", "conn-old")  # returns at once: not that connection's job
    with pytest.raises(CheckpointError, match="no job k from that connection"):
        up.wait_durable("k", 5, "conn-old")
    assert "k" in up._jobs  # still there for its own connection
    assert up.wait_durable("k", 5, "conn-new") == "committed"
    assert "k" not in up._jobs  # collected


def test_waiting_on_a_connection_waits_for_its_last_frame_only_while_it_is_open():
    # After a final goodbye nobody answered, the worker asks before unlinking its arenas.
    up = _bare_uploader()
    assert up.wait_connection("", 0) is True and up.wait_connection("unknown", 0) is True
    peer = SimpleNamespace(ended=threading.Event())
    up._connections["c"] = peer
    assert up.wait_connection("c", 0.2) is False
    threading.Timer(0.2, peer.ended.set).start()
    assert up.wait_connection("c", 30) is True


def test_an_ended_job_keeps_the_uploader_up_only_while_its_worker_lives_to_collect_it():
    up = _bare_uploader()
    dead = _dead_pid()
    up._jobs["mine"] = _ended_ticket("mine", os.getpid(), origin="c1")  # its worker will ask
    up._jobs["theirs"] = _ended_ticket("theirs", dead, origin="c2")  # nobody will
    up._clients = {(dead, "t")}
    assert up._live_clients() == 1
    assert list(up._jobs) == ["mine"] and up._clients == set()
    up.wait_durable("mine", 5, "c1")
    assert up._live_clients() == 0


def test_a_broken_connections_jobs_fail_when_the_actor_cannot_even_be_asked_and_keep_their_arenas():
    # Ray itself going away makes .remote() raise: the jobs must end (their saves fail
    # on every rank through wait()) rather than wait for an answer that never comes, and
    # their arenas stay held, since the uploader may still be writing from them.
    from ray_goodput.checkpoint.uploader._client import ActorBackend

    class _Gone:
        def remote(self, *args):
            raise RuntimeError("Ray is shutting down")

    backend = ActorBackend(durable_timeout_s=5)
    jobs = [_handoff("job-1"), _handoff("job-2")]
    backend._ask_actor(SimpleNamespace(wait_released=_Gone(), wait_durable=_Gone()), "conn", jobs)
    for job in jobs:
        with pytest.raises(CheckpointError, match=f"could not ask the node uploader about {job.key}: RuntimeError"):
            job.durable.result(timeout=0)
        assert not job.released.done()
