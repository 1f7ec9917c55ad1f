"""A rendezvous before `jax.distributed.initialize`: every process reports to process 0 over TCP,
so that a peer that never arrives is named instead of JAX aborting every process after its timeout.

Why not JAX alone: when a process never starts, JAX's start-up (jax 0.10.2) aborts the others
with "Terminating process because the JAX distributed service detected fatal errors ...
DEADLINE_EXCEEDED: Deadline Exceeded ... RPC: /xla.coordination.CoordinationService/RegisterTask",
which names neither the missing process nor the coordinator, on process 0 and on its peers alike.

The rendezvous uses the coordinator's own port, before JAX's service binds it: process 0 listens
where JAX's coordinator will (JAX_COORDINATOR_BIND_ADDRESS, else every interface, as JAX binds),
answers once all have reported, and closes the port for JAX to take. No port beyond JAX's own is
opened, and this one carries nothing but process ids (JAX's coordinator, like it, is
unauthenticated: "gRPC insecure server credentials are used"). Connections are served together
(select), and one that says nothing within `HELLO_TIMEOUT_S` is dropped, so a port scanner or a
health check cannot hold up the run.

A host range (elastic runs): with `min_processes` below the count, process 0 waits until every
process has reported or the deadline passes, and then admits those that came when they are at
least the minimum: it numbers them 0..n-1 in the order of their ids (it stays 0) and tells each
its new id and n, with which JAX then starts. Fewer than the minimum by the deadline is a
TransientError naming who is missing (exit 75: retry once the hosts are back).

Spares: a count on which the run would leave a whole host's devices idle cannot start (that
process would hold no shard: training/elastic.py). Given `runs_on` (checks.py), process 0 admits
the largest count of those that came on which the run runs, the lowest ids, and answers the others
"spare": they wait as a late process does, and a narrower run takes them back once enough have
come for a count that runs (runtime/arrivals.py).

A process that arrives after the others started (a host back from a loss, a pod started late) finds
JAX's coordination service on the port instead: a gRPC server, which answers any connection at once
with HTTP/2's SETTINGS frame and closes it (jax 0.10.2). That answer, not a timeout, tells it the
run started without it (`RunStarted`): within milliseconds, and never mistaken for a rendezvous,
whose answers are lines of words.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import time
from collections.abc import Callable

from jaxscale.errors import JaxscaleError, TransientError

HELLO = "jaxscale-rendezvous"  # the first word a peer sends: tells our peers from anything else
HELLO_TIMEOUT_S = 10.0
MAX_LINE = 256
# HTTP/2's server preface: a SETTINGS frame (type 4) on stream 0, after its 3-byte length.
SETTINGS_TYPE, STREAM_0 = 4, b"\0\0\0\0"
# A peer waits this long past its own deadline for process 0's verdict, which names who is
# missing: process 0 may have started (and so give up) a little later.
ANSWER_GRACE_S = 5.0


class RunStarted(TransientError):
    """The coordinator port answered as JAX's service, not as a rendezvous: the run started
    without this process (runtime/arrivals.py then announces it)."""


class Spare(RunStarted):
    """Process 0 started the run without this process, which came in time: with it, the run
    would leave a whole host's devices idle. It waits as a late process does."""


def rendezvous(spec, deadline: float, min_processes: int | None = None,
               runs_on: Callable[[int], bool] = lambda count: True) -> tuple[int, int]:
    """Returns (this process's id, the process count) JAX starts with, once all
    `spec.num_processes` processes have reported in, or at `deadline` (a time.monotonic() value)
    once at least `min_processes` have (default: all): the largest count of those that came on
    which the run runs (`runs_on`, which `min_processes` must satisfy). Raises TransientError
    naming who did not arrive by then, or the coordinator when it cannot be reached; Spare when
    this process is left out; JaxscaleError when the processes disagree (counts, ids). `spec` is
    a distributed.ClusterSpec."""
    if spec.process_id == 0:
        bind = os.environ.get("JAX_COORDINATOR_BIND_ADDRESS",
                              "[::]:" + spec.coordinator_address.rsplit(":", 1)[1])
        admitted = _gather(spec.num_processes, min_processes or spec.num_processes, bind,
                           deadline, runs_on)
        return 0, admitted
    return _report(spec, deadline)


def _split(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host.strip("[]"), int(port)


def _gather(num_processes: int, min_processes: int, bind: str, deadline: float,
            runs_on: Callable[[int], bool]) -> int:
    """Gathers the peers; returns how many processes were admitted (process 0 among them)."""
    server = _listen(bind)
    hellos: dict[socket.socket, tuple[bytes, float]] = {}  # not yet identified: (read, drop at)
    peers: dict[int, socket.socket] = {}
    accepted: dict[int, float] = {}  # when each peer's connection was accepted (as its drop at)
    try:
        while len(peers) < num_processes - 1:
            now = time.monotonic()
            if now >= deadline and len(peers) + 1 >= min_processes:
                break  # the range's minimum came: start with those that did
            if now >= deadline:
                missing = sorted(set(range(1, num_processes)) - set(peers))
                _send_all(peers.values(), f"missing {','.join(map(str, missing))}")
                raise TransientError(
                    f"process 0 waited for the other {num_processes - 1} processes until the "
                    f"timeout, but process(es) {missing} never arrived at the coordinator port "
                    f"{_split(bind)[1]}; check that they were started, and that they can reach "
                    "this host")
            for conn, (_, drop_at) in list(hellos.items()):
                if now >= drop_at:  # silent: not one of ours, or stuck
                    del hellos[conn]
                    conn.close()
            ready, _, _ = select.select([server, *hellos, *peers.values()], [], [],
                                        min(deadline - now, 1.0))
            for sock in ready:
                if sock is server:
                    conn, _ = server.accept()
                    conn.setblocking(False)
                    hellos[conn] = (b"", now + HELLO_TIMEOUT_S)
                elif sock in hellos:
                    _read_hello(sock, hellos, peers, accepted, num_processes)
                else:  # a peer that reported says nothing more: it closed (stopped, restarted)
                    for gone in [i for i, conn in peers.items() if conn is sock]:
                        del peers[gone]
                    sock.close()
        admitted = max(n for n in range(min_processes, len(peers) + 2) if runs_on(n))
        for new_id, peer_id in enumerate(sorted(peers), start=1):
            _send_all([peers[peer_id]], f"ok {new_id} {admitted}" if new_id < admitted
                      else f"spare {admitted}")
        return admitted
    finally:
        for conn in [*hellos, *peers.values()]:
            conn.close()
        server.close()


def _read_hello(conn: socket.socket, hellos: dict, peers: dict[int, socket.socket],
                accepted: dict[int, float], num_processes: int) -> None:
    """Reads what `conn` sent; once it is a whole line, moves it to `peers` (or drops it)."""
    received, drop_at = hellos.pop(conn)
    try:
        chunk = conn.recv(MAX_LINE)
    except OSError:
        chunk = b""
    received += chunk
    if chunk and b"\n" not in received and len(received) < MAX_LINE:
        hellos[conn] = (received, drop_at)
        return
    words = received.decode(errors="replace").split()
    if len(words) != 3 or words[0] != HELLO or not (words[1].isdigit() and words[2].isdigit()):
        conn.close()  # not one of ours: a port scanner, a health check
        return
    peer_id, peer_count = int(words[1]), int(words[2])
    if peer_id in peers:
        # Two starts of the same process: its pod was replaced, and the earlier start's
        # connection may never close (a lost node sends no FIN). The one connected last counts,
        # whichever hello was read first.
        earlier, later = (peers[peer_id], conn) if accepted[peer_id] <= drop_at else \
            (conn, peers[peer_id])
        _send_all([earlier], f"error process {peer_id} reported again from a newer start; this "
                  "earlier one stops")
        earlier.close()
        if earlier is conn:
            return
        del peers[peer_id]
    problem = None
    if peer_count != num_processes:
        problem = (f"process {peer_id} expects {peer_count} processes but process 0 expects "
                   f"{num_processes}; start every process with the same count")
    elif not 0 < peer_id < num_processes:
        problem = (f"process id {peer_id} is outside 1..{num_processes - 1}; give every process "
                   "its own id below the process count")
    if problem:
        _send_all([conn, *peers.values()], f"error {problem}")
        conn.close()
        raise JaxscaleError(problem)
    peers[peer_id], accepted[peer_id] = conn, drop_at


def _listen(bind: str) -> socket.socket:
    host, port = _split(bind)
    try:
        if host in ("", "::"):  # every interface, IPv4 and IPv6, as JAX's coordinator binds
            if socket.has_dualstack_ipv6():
                return socket.create_server(("", port), family=socket.AF_INET6,
                                            dualstack_ipv6=True)
            return socket.create_server(("", port))  # a host without IPv6: every IPv4 one
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:  # most often an earlier start of this run, still stopping
            raise TransientError(
                f"process 0 cannot listen on the coordinator port {port}: another process holds "
                "it; if it is not an earlier start of this run, set JAX_COORDINATOR_PORT to a "
                "free port") from None
        raise JaxscaleError(f"process 0 cannot listen on the coordinator address {bind}: "
                            f"{e.strerror or e}; set JAX_COORDINATOR_BIND_ADDRESS or "
                            "JAX_COORDINATOR_PORT") from None


def _report(spec, deadline: float) -> tuple[int, int]:
    host, port = _split(spec.coordinator_address)
    where = spec.coordinator_address
    while True:
        try:
            conn = socket.create_connection(
                (host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            break
        except OSError:  # refused (not listening yet), unknown host (DNS not ready), timeout
            if time.monotonic() >= deadline:
                raise TransientError(
                    f"process {spec.process_id} of {spec.num_processes} could not reach process 0 "
                    f"(the coordinator) at {where} before the timeout; check that process 0 was "
                    "started and that this host can resolve and reach it") from None
            time.sleep(0.2)
    with conn:
        conn.settimeout(max(0.1, deadline - time.monotonic()) + ANSWER_GRACE_S)
        try:
            conn.sendall(f"{HELLO} {spec.process_id} {spec.num_processes}\n".encode())
            reply = _read_line(conn)
        except OSError:
            reply = b""
    if len(reply) >= 9 and reply[3] == SETTINGS_TYPE and reply[5:9] == STREAM_0:
        raise RunStarted(
            f"process {spec.process_id} of {spec.num_processes} arrived after the run had started "
            f"without it: JAX's service, not a rendezvous, answered at {where}")
    answer = reply.decode(errors="replace").strip()
    words = answer.split()
    if len(words) == 3 and words[0] == "ok" and words[1].isdigit() and words[2].isdigit():
        return int(words[1]), int(words[2])
    if len(words) == 2 and words[0] == "spare" and words[1].isdigit():
        raise Spare(
            f"process {spec.process_id} of {spec.num_processes} is a spare: process 0 started the "
            f"run on {words[1]} of the processes that came, since on more a whole host's devices "
            "would be idle")
    if answer.startswith("missing "):
        raise TransientError(
            f"process 0 gave up waiting: process(es) [{answer.split(' ', 1)[1]}] of "
            f"{spec.num_processes} never arrived; check that they were started")
    if answer.startswith("error "):
        raise JaxscaleError(answer.split(" ", 1)[1])
    # No answer: process 0 stopped, or a service that does not answer as JAX's does (RunStarted)
    # holds the port already (this process started after the others had met).
    raise TransientError(
        f"process {spec.process_id} reached {where} but process 0 gave no rendezvous answer "
        "before the timeout; if the other processes are already running, stop them all and "
        "start every process again")


def _read_line(conn: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"\n") and len(data) < MAX_LINE:
        chunk = conn.recv(MAX_LINE)
        if not chunk:
            break
        data += chunk
    return data


def _send_all(conns, message: str) -> None:
    for conn in conns:
        try:
            conn.setblocking(True)
            conn.settimeout(1.0)  # a peer that does not read must not hold up the others
            conn.sendall(f"{message}\n".encode())
        except OSError:
            pass  # that peer is gone; the others still hear the news
