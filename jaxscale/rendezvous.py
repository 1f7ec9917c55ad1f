"""A rendezvous before `jax.distributed.initialize`: every process reports to process 0 over TCP
(the coordinator port + 1), so that a peer that never arrives is named in an error instead of JAX
aborting after its timeout without saying who is missing.
"""

from __future__ import annotations

import select
import socket
import time

from jaxscale.errors import JaxscaleError

def rendezvous_address(coordinator_address: str) -> tuple[str, int]:
    host, port = coordinator_address.rsplit(":", 1)
    return host.strip("[]"), int(port) + 1


def rendezvous(spec, deadline: float) -> None:
    """Returns once all `spec.num_processes` processes have reported in, or raises naming who did
    not by `deadline` (a time.monotonic() value). `spec` is a distributed.ClusterSpec."""
    host, port = rendezvous_address(spec.coordinator_address)
    if spec.process_id == 0:
        _gather(spec.num_processes, port, deadline)
    else:
        _report(spec, host, port, deadline)


def _gather(num_processes: int, port: int, deadline: float) -> None:
    server = _listen(port)
    peers: dict[int, socket.socket] = {}
    try:
        while len(peers) < num_processes - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(1, num_processes)) - set(peers))
                _send_all(peers.values(), f"missing {','.join(map(str, missing))}")
                raise JaxscaleError(
                    f"process 0 waited for the other {num_processes - 1} processes until the "
                    f"timeout, but process(es) {missing} never arrived at rendezvous port {port}; "
                    "check that they were started, and that they can reach this host")
            if not select.select([server], [], [], min(left, 1.0))[0]:
                continue
            conn, _ = server.accept()
            conn.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                peer_id, peer_count = map(int, _read_line(conn).split())
            except (ValueError, OSError):
                conn.close()  # not one of ours (a port scanner, a health check)
                continue
            problem = None
            if peer_count != num_processes:
                problem = (f"process {peer_id} expects {peer_count} processes but process 0 "
                           f"expects {num_processes}; start every process with the same count")
            elif peer_id in peers or not 0 < peer_id < num_processes:
                problem = (f"two processes claim id {peer_id}, or it is outside 1.."
                           f"{num_processes - 1}; give every process its own id")
            if problem:
                _send_all([conn, *peers.values()], f"error {problem}")
                raise JaxscaleError(problem)
            peers[peer_id] = conn
        _send_all(peers.values(), "ok")
    finally:
        for conn in peers.values():
            conn.close()
        server.close()


def _listen(port: int) -> socket.socket:
    try:  # peers may resolve the coordinator's name to IPv4 or IPv6
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
    except (OSError, ValueError):
        pass
    try:
        return socket.create_server(("", port))
    except OSError as e:
        raise JaxscaleError(
            f"process 0 cannot listen on rendezvous port {port} (the coordinator port + 1): "
            f"{e.strerror}; set JAX_COORDINATOR_PORT (or the coordinator address) to a free "
            "port") from None


def _report(spec, host: str, port: int, deadline: float) -> None:
    where = f"{host}:{port}"
    while True:
        try:
            conn = socket.create_connection((host, port),
                                            timeout=max(0.1, min(5.0, deadline - time.monotonic())))
            break
        except OSError:  # refused (not listening yet), unknown host (DNS not ready), timeout
            if time.monotonic() >= deadline:
                raise JaxscaleError(
                    f"process {spec.process_id} of {spec.num_processes} could not reach process 0 "
                    f"(the coordinator) at rendezvous {where} before the timeout; check that "
                    "process 0 was started and that this host can resolve and reach it") from None
            time.sleep(0.2)
    with conn:
        conn.settimeout(max(0.1, deadline - time.monotonic()) + 5.0)  # process 0 answers first
        try:
            conn.sendall(f"{spec.process_id} {spec.num_processes}\n".encode())
            answer = _read_line(conn)
        except OSError:
            answer = ""
    if answer == "ok":
        return
    if answer.startswith("missing "):
        raise JaxscaleError(
            f"process 0 gave up waiting: process(es) [{answer.split(' ', 1)[1]}] of "
            f"{spec.num_processes} never arrived; check that they were started")
    if answer.startswith("error "):
        raise JaxscaleError(answer.split(" ", 1)[1])
    raise JaxscaleError(f"process {spec.process_id} reached process 0 at {where} but got no "
                        "answer before the timeout")


def _read_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(1024)
        if not chunk:
            break
        data += chunk
    return data.decode(errors="replace").strip()


def _send_all(conns, message: str) -> None:
    for conn in conns:
        try:
            conn.sendall(f"{message}\n".encode())
        except OSError:
            pass  # that peer is gone; the others still hear the news
