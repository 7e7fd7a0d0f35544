"""The TCP channel between a frontend and engine cores on other hosts (`serve --headless`).

It is CurveZMQ: encrypted and authenticated, with both key pairs derived from the API key
that the frontend and the headless engines were given. A CurveZMQ client must know the
server's public key to be let in, and here only the API key yields it: it is never sent
or shown. So only an engine given the key can join, and nobody on the path can read or
forge its messages. ZMTP heartbeats make a vanished host count as a disconnect within
seconds.

Rank r's three sockets (commands, control, outputs) are at ports rpc_port + 3r .. + 3r + 2
of the frontend's address; the frontend binds those of the ranks that run elsewhere.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from socket import getaddrinfo

import zmq
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from vllm_rlt.config import ParamError, require

logger = logging.getLogger(__name__)

HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 5000
MONITOR_POLL_MS = 200
FRONTEND_GONE_GRACE_S = 8.0  # more than a core's orderly exit (its sockets linger 5 s)
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)

Peer = tuple[str, str, str]  # a client's (commands, control, outputs) addresses (bound by it)


@dataclass(frozen=True)
class ChannelKeys:
    """Curve25519 key pairs (z85) of the frontend (server) and of the engines (client)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def channel_keys(api_key: str) -> ChannelKeys:
    def secret(role: str) -> bytes:
        return z85.encode(hashlib.sha256(f"vllm-rlt {role}\0{api_key}".encode()).digest())

    server, client = secret("frontend"), secret("engine")
    return ChannelKeys(zmq.curve_public(server), server, zmq.curve_public(client), client)


def remote_peer(address: str, rpc_port: int, rank: int) -> Peer:
    base = rpc_port + 3 * rank
    return tuple(f"tcp://{address}:{base + i}" for i in range(3))  # type: ignore[return-value]


def check_ports(rpc_port: int, size: int) -> None:
    last = rpc_port + 3 * size - 1
    require(
        1024 <= rpc_port and last <= 65535,
        f"data_parallel_rpc_port must leave room for 3 ports per core: {rpc_port} to {last} "
        "must lie in [1024, 65535]",
        "data_parallel_rpc_port",
    )


def check_address(address: str) -> None:
    """An address both sides can use: a name or IP that resolves."""
    try:
        getaddrinfo(address, None)
    except (OSError, UnicodeError) as exc:
        raise ParamError(
            f"data_parallel_address {address!r} does not resolve: {exc}", "data_parallel_address"
        ) from None


def _heartbeats(socket: zmq.Socket) -> None:
    socket.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def secure_server(socket: zmq.Socket, keys: ChannelKeys) -> None:
    """Before bind, on the frontend's side."""
    socket.curve_server = True
    socket.curve_secretkey = keys.server_secret
    _heartbeats(socket)


def secure_client(socket: zmq.Socket, keys: ChannelKeys) -> None:
    """Before connect, on an engine's side."""
    socket.curve_serverkey = keys.server_public
    socket.curve_publickey = keys.client_public
    socket.curve_secretkey = keys.client_secret
    _heartbeats(socket)


class LinkWatch:
    """Watches a bound socket of the frontend: `joined` once an engine completed the
    encrypted handshake, `gone` once that connection closed. A connection that fails its
    handshake (another key, a port probe) is no engine: libzmq reports its failure right
    before its disconnect, so that disconnect changes nothing."""

    def __init__(self, socket: zmq.Socket) -> None:
        self.joined = threading.Event()
        self.gone = threading.Event()
        self._stop = threading.Event()
        self._monitor = socket.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED
        )
        self._thread = threading.Thread(target=self._run, name="vllm-rlt-link", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        failed = 0  # failed handshakes whose disconnect is still to come
        try:
            while not self._stop.is_set():
                if not self._monitor.poll(MONITOR_POLL_MS):
                    continue
                kind = recv_monitor_message(self._monitor)["event"]
                if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    self.joined.set()
                elif kind & HANDSHAKE_FAILED:
                    failed += 1
                elif failed:
                    failed -= 1
                elif self.joined.is_set():
                    self.gone.set()
                    return
        except zmq.ZMQError:  # the context is being destroyed
            pass
        finally:
            self._monitor.close(linger=0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * MONITOR_POLL_MS / 1000)


def watch_frontend(socket: zmq.Socket, address: str, on_lost) -> None:
    """On an engine's side: `on_lost(message)` when the frontend at `address` fails the
    encrypted handshake (another API key), instead of retrying forever in silence, or once
    its connection closes after the handshake (the frontend is gone: the engine leaves, so
    its host's supervisor can restart it for the next frontend)."""
    monitor = socket.get_monitor_socket(
        HANDSHAKE_FAILED | zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED
    )

    def watch() -> None:
        joined = False
        while True:
            kind = recv_monitor_message(monitor)["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                joined = True
            elif kind & HANDSHAKE_FAILED and not joined:
                on_lost(
                    f"the frontend at {address} refused this engine's encrypted handshake: "
                    "the two were given different API keys (--api-key or VLLM_RLT_API_KEY)"
                )
                return
            elif kind == zmq.EVENT_DISCONNECTED and joined:
                # A shutdown the frontend asked for ends this process well within this.
                threading.Event().wait(FRONTEND_GONE_GRACE_S)
                on_lost(f"the frontend at {address} went away")
                return

    threading.Thread(target=watch, name="vllm-rlt-frontend-watch", daemon=True).start()
