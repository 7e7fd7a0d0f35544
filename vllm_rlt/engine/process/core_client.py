"""The frontend's handle on the engine core: start it (its own process by default, or a
thread in this process), send it commands, make control calls, and read its outputs on the
caller's event loop.

Outputs are read by a task of the event loop that serves the requests, not by a thread: a
second Python thread would contend with the loop for the interpreter lock at every engine
step. A watcher thread that sleeps in the kernel until the core process exits notices its
death at once, so callers never wait on a dead engine."""

from __future__ import annotations

import atexit
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from vllm_rlt.config import require
from vllm_rlt.engine.core_outputs import CoreStats
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.process.core_proc import run_engine_core, serve_engine
from vllm_rlt.engine.process.messages import (
    AbortAll,
    Command,
    ControlCall,
    ControlReply,
    EngineInfo,
    EngineOutputs,
    Ready,
    StartupFailed,
    StopCore,
    command_codec,
    message_codec,
)
from vllm_rlt.engine.process.output_reader import OutputReader
from vllm_rlt.engine.process.remote_channel import (
    ChannelKeys,
    LinkWatch,
    Peer,
    secure_server,
)
from vllm_rlt.engine_config import EngineConfig

logger = logging.getLogger(__name__)

# How long a command may wait for a core whose process runs but whose connection is down.
PEERLESS_SEND_TIMEOUT_S = 2.0


class EngineCoreDied(RuntimeError):
    """The engine core stopped; the message says why."""


@dataclass
class CoreAttachment:
    """What another process (an API server) needs to join a core it did not start: its
    client number, the addresses reserved for it, the core's handshake, and the read end of
    the core's lifeline (end-of-file once the core has exited)."""

    client: int
    addresses: Peer
    info: EngineInfo
    lifeline: multiprocessing.connection.Connection


class EngineCoreClient:
    """Owns the core's process (or thread) and the three sockets: commands in, control calls
    (request-reply), outputs back. It answers the questions `AsyncLLM` asks of every client
    (engine/process/clients.py) as the single core it is.

    Construction blocks until the core has loaded its model: a startup failure raises the
    core's own error (ValueError / OSError with its one-line message, else RuntimeError).
    `api_servers` reserves that many more clients for other processes to `attach` with
    (`attachments`). `env` is set in the core's process first (its GPU). `on_death(reason)` may
    run on any thread."""

    def __init__(
        self,
        config: EngineConfig,
        on_death: Callable[[str], None],
        in_process: bool = False,
        api_servers: int = 0,
        env: dict[str, str] | None = None,
    ) -> None:
        require(
            not (in_process and api_servers),
            "an engine core on a thread serves this process alone",
        )
        if in_process:
            tag = uuid.uuid4().hex
            peers = [(f"inproc://in-{tag}", f"inproc://ctl-{tag}", f"inproc://out-{tag}")]
            ipc_dir = None
        else:
            ipc_dir = tempfile.mkdtemp(prefix="vllm-rlt-")
            peers = [
                tuple(f"ipc://{ipc_dir}/{name}-{client}" for name in ("in", "ctl", "out"))
                for client in range(1 + api_servers)
            ]
        self._open(on_death, 0, peers[0], ipc_dir)
        self.in_process = in_process
        self.process: multiprocessing.process.BaseProcess | None = None
        self.thread: threading.Thread | None = None
        self.core_engine: EngineCore | None = None  # in-process only: the engine itself
        self.attachments: list[CoreAttachment] = []
        lifeline_read = lifeline_write = None
        if in_process:
            self.thread = threading.Thread(
                target=serve_engine,
                args=(config, self.context, peers, self._built),
                name="vllm-rlt-engine-core",
                daemon=True,
            )
            self.thread.start()
        else:
            # spawn: the parent may hold CUDA state and threads that fork would copy.
            spawn = multiprocessing.get_context("spawn")
            if api_servers:
                lifeline_read, lifeline_write = spawn.Pipe(duplex=False)
            self.process = spawn.Process(
                target=run_engine_core,
                args=(config, peers, os.getpid(), lifeline_write, env),
                name="vllm-rlt-engine-core",
                daemon=False,
            )
            self.process.start()
            # after multiprocessing's own exit hook (which joins child processes), so run
            # before it: a script that ends without shutdown() still exits
            atexit.register(self._stop_at_exit)
            if lifeline_write is not None:
                lifeline_write.close()  # the core holds the only write end now
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._stop_core(timeout=5.0)
            self._release_sockets()
            raise
        if lifeline_read is not None:
            self.attachments = [
                CoreAttachment(client, peers[client], self.info, lifeline_read)
                for client in range(1, 1 + api_servers)
            ]
        threading.Thread(target=self._watch, name="vllm-rlt-core-watch", daemon=True).start()

    @classmethod
    def attach(cls, attachment: CoreAttachment, on_death: Callable[[str], None]):
        """Join a running core as client `attachment.client` (in an API-server process).
        Blocks until the core's connections to this client's sockets are up."""
        self = cls.__new__(cls)
        self._open(on_death, attachment.client, attachment.addresses, None, watch_accepts=True)
        self.in_process = False
        self.process = self.thread = self.core_engine = None
        self.attachments = []
        self.info = attachment.info
        self._lifeline = attachment.lifeline
        try:
            self._wait_connected()
        except BaseException:
            self._release_sockets()
            raise
        threading.Thread(target=self._watch, name="vllm-rlt-core-watch", daemon=True).start()
        return self

    @classmethod
    def remote(cls, addresses: Peer, keys: ChannelKeys, on_death: Callable[[str], None], rank: int):
        """Serve a core on another host (`serve --headless`) over the encrypted channel:
        bind its TCP addresses and block until it has loaded its model and reported ready.
        Its death is the end of its connection."""
        self = cls.__new__(cls)
        try:
            self._open(on_death, 0, addresses, None, keys)
        except zmq.ZMQError as exc:  # an address of another host, a port in use
            if self._link is not None:
                self._link.close()
            self.context.destroy(linger=0)
            raise OSError(
                f"cannot listen for engine core {rank} at {addresses[0]}: {exc.strerror}"
            ) from None
        self.in_process = False
        self.process = self.thread = self.core_engine = None
        self.attachments = []
        logger.info("waiting for engine core %d to connect at %s", rank, addresses[0])
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._release_sockets()
            raise
        threading.Thread(target=self._watch, name="vllm-rlt-core-watch", daemon=True).start()
        return self

    def _open(
        self,
        on_death: Callable[[str], None],
        client: int,
        addresses: Peer,
        ipc_dir: str | None,
        keys: ChannelKeys | None = None,
        watch_accepts: bool = False,
    ) -> None:
        """Bind this client's sockets (the core connects to them), encrypted with `keys`.
        `watch_accepts`: watch the core's connections from before the bind (a running core
        retries its connection and may get in at once), for `_wait_connected`."""
        self.on_death = on_death
        self.client = client
        self.context = zmq.Context()
        self._encode = command_codec()[0].encode
        self._decode = message_codec()[1].decode
        self._decode_reply = msgspec.msgpack.Decoder(ControlReply).decode
        self._send_lock = threading.Lock()
        self._call_lock = threading.Lock()
        self._call_ids = itertools.count()
        self._closing = False  # the sockets are being released: send nothing more
        self._stopping = False  # this side is leaving: the core's end is no death
        self._reader: OutputReader | None = None
        self._lifeline: multiprocessing.connection.Connection | None = None
        self._link: LinkWatch | None = None  # a core on another host
        self.dead_reason: str | None = None
        self._heard = time.monotonic()  # the core's latest output, for `stalled`
        self._ipc_dir = ipc_dir
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.control = self.context.socket(zmq.REQ)
        # A call that timed out must not wedge the socket: the next call may send again,
        # and a late reply to the old call is told apart and dropped.
        self.control.setsockopt(zmq.REQ_RELAXED, 1)
        self.control.setsockopt(zmq.REQ_CORRELATE, 1)
        self.output = self.context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        if keys is not None:  # watched from before an engine can connect
            self._link = LinkWatch(self.output)
        self._accepts = (
            [s.get_monitor_socket(zmq.EVENT_ACCEPTED) for s in self.sockets]
            if watch_accepts
            else []
        )
        for socket, address in zip(self.sockets, addresses, strict=True):
            if keys is not None:
                secure_server(socket, keys)
            socket.bind(address)

    # ----------------------------------------------------------------- startup
    def _built(self, engine: EngineCore) -> None:
        self.core_engine = engine

    def _wait_ready(self) -> EngineInfo:
        while True:
            if self.output.poll(200):
                message = self._decode(self.output.recv(copy=False))
                if isinstance(message, Ready):
                    return message.info
                if isinstance(message, StartupFailed):
                    if message.traceback:
                        logger.error(
                            "the engine core failed to start:\n%s", message.traceback.rstrip()
                        )
                    raise message.error()
                raise RuntimeError(f"engine core sent {type(message).__name__} before ready")
            if not self.core_alive():
                raise RuntimeError(
                    f"the engine core process exited during startup ({self._exit_status()})"
                )

    def _wait_connected(self, timeout: float = 60.0) -> None:
        """Until the core has connected to all three sockets: a command sent before would
        block the caller, and outputs would have no way back."""
        monitors, self._accepts = self._accepts, []
        deadline = time.monotonic() + timeout
        try:
            for monitor in monitors:
                while not monitor.poll(100):
                    if self._lifeline is not None and self._lifeline.poll(0):
                        raise RuntimeError("the engine core exited before this server joined")
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the engine core did not connect within {timeout} s")
                recv_monitor_message(monitor)
        finally:
            for socket in self.sockets:
                socket.disable_monitor()
            for monitor in monitors:
                monitor.close(linger=0)

    @property
    def sockets(self) -> tuple[zmq.Socket, zmq.Socket, zmq.Socket]:
        return self.input, self.control, self.output

    # ----------------------------------------------------------------- as one of many
    @property
    def size(self) -> int:
        """Engine cores behind this client."""
        return 1

    @property
    def processes(self) -> list[multiprocessing.process.BaseProcess]:
        """The core processes this client started."""
        return [] if self.process is None else [self.process]

    def attachments_of(self, server: int) -> list[CoreAttachment]:
        """What API server `server` (0-based) joins the core with."""
        return [self.attachments[server]]

    def lost_reason(self) -> str | None:
        """Cores gone while others serve on: a single core's loss is a death instead."""
        return None

    def forget_core(self, rank: int) -> list[str]:
        """The requests of a lost core that others outlive: none, as above."""
        return []

    def holds(self, request_id: str) -> bool:
        """Whether records of the id wait for a core's later report: a single core's, none."""
        return False

    def stalled(self, timeout: float, busy: bool) -> str | None:
        """Why the core counts as stalled (`busy`, and no pass for `timeout` s), or None."""
        if busy and time.monotonic() - self._heard > timeout:
            return f"no pass completed for {timeout:g} s"
        return None

    # ----------------------------------------------------------------- commands
    def send(self, command: Command) -> bool:
        """Queue a command for the core (any thread); dropped once the core is gone. Never
        blocks on a dead core: False when the command was dropped."""
        if self.dead_reason is not None:
            return False
        data = self._encode(command)
        with self._send_lock:
            if self._closing:
                return False
            return self._send_now(self.input, data)

    def _send_now(self, socket: zmq.Socket, data: Any) -> bool:
        """Send without blocking on a core that is gone. Our sockets are bound: once the
        core's end of the connection closes, a send has no peer and would wait forever, so
        it waits only while the core still runs (it may be reconnecting) and marks the core
        dead, at once, once it does not."""
        deadline = time.monotonic() + PEERLESS_SEND_TIMEOUT_S
        while True:
            try:
                socket.send(data, zmq.NOBLOCK, copy=False)
                return True
            except zmq.Again:
                pass
            if self._stopping:
                return False
            if not self.core_alive():
                self._died(f"the engine core process died ({self._exit_status()})")
                return False
            if time.monotonic() > deadline:
                self._died(
                    f"the engine core took no command for {PEERLESS_SEND_TIMEOUT_S:g} s "
                    "although its process runs"
                )
                return False
            socket.poll(10, zmq.POLLOUT)

    def call(self, name: str, timeout: float = 30.0) -> CoreStats | dict[str, bool | str]:
        """A control call ("stats": a CoreStats; sleep mode's and the weight calls),
        answered by the core between passes; blocks the calling thread."""
        if self.dead_reason is not None:
            raise EngineCoreDied(self.dead_reason)
        # one call at a time; a caller waiting behind a long one (a trainer's rendezvous)
        # keeps its own limit rather than piling up threads
        if not self._call_lock.acquire(timeout=timeout):
            raise TimeoutError(f"the engine core was busy with another call for {timeout} s")
        try:
            call_id = next(self._call_ids)
            if not self._send_now(self.control, self._encode(ControlCall(call_id, name))):
                raise EngineCoreDied(self.dead_reason or "the engine core is gone")
            deadline = time.monotonic() + timeout
            # in slices: a core that dies while it owes the answer fails the call at once
            while not self.control.poll(100):
                if self.dead_reason is not None or not self.core_alive():
                    raise EngineCoreDied(self.dead_reason or "the engine core is gone")
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"the engine core did not answer {name!r} within {timeout} s"
                    )
            reply = self._decode_reply(self.control.recv())
        finally:
            self._call_lock.release()
        if self.dead_reason is not None:
            raise EngineCoreDied(self.dead_reason)
        return reply.value

    def core_alive(self) -> bool:
        if self._link is not None:
            return not self._link.gone.is_set()
        if self.process is not None:
            return self.process.is_alive()
        if self._lifeline is not None:
            return not self._lifeline.poll(0)
        return self.thread is not None and self.thread.is_alive()

    # ----------------------------------------------------------------- outputs
    def start_reading(self, on_outputs: Callable[[EngineOutputs], None]) -> None:
        """Read outputs on the running event loop from now on (call it there, once)."""
        if self._reader is not None:
            raise RuntimeError("outputs are already read on an event loop")
        self._reader = OutputReader(self.output, self._decode, on_outputs, self._hear, self._died)

    def _hear(self) -> None:
        self._heard = time.monotonic()

    def _watch(self) -> None:
        """Sleep until the core ends; an end nobody asked for is a death."""
        if self._link is not None:
            self._link.gone.wait()
        elif self.process is not None:
            multiprocessing.connection.wait([self.process.sentinel])
        elif self._lifeline is not None:
            multiprocessing.connection.wait([self._lifeline])
        elif self.thread is not None:
            self.thread.join()
        if not self._stopping:
            # A core that failed a pass sent its traceback first: give the reader a moment
            # to report that cause rather than the bare exit.
            threading.Event().wait(0.5)
            self._died(f"the engine core process died ({self._exit_status()})")

    def _died(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        self.on_death(reason)

    def _exit_status(self) -> str:
        if self._link is not None:
            return "its connection from another host closed"
        if self._lifeline is not None:
            return "the server's main process logs its exit status"
        if self.process is None:
            return "its thread ended"
        code = self.process.exitcode
        if code is not None and code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    # ----------------------------------------------------------------- shutdown
    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to stop (it aborts what is left), wait for it, free the sockets.
        A client that joined with `attach` only aborts its own requests and leaves: the
        core's owner stops it."""
        atexit.unregister(self._stop_at_exit)
        self._stopping = True
        if self._lifeline is not None:
            self.send(AbortAll(self.client))
        elif self.dead_reason is None and self.core_alive():
            self.send(StopCore())  # read also while a call is in flight (a rendezvous)
        self._stop_core(timeout)
        if self._reader is not None:
            self._reader.stop()
        self._release_sockets()

    def _stop_at_exit(self) -> None:
        """The interpreter is exiting and nobody called shutdown() (a script that returned
        or raised without it): stop the core now, or the exit would wait for it forever."""
        try:
            self.shutdown(timeout=5.0)
        except Exception:  # noqa: BLE001 - at exit: the process must go whatever failed
            if self.process is not None and self.process.is_alive():
                self.process.kill()

    def _stop_core(self, timeout: float) -> None:
        self._stopping = True
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        elif self.thread is not None:
            self.thread.join(timeout)
        elif self._link is not None:  # its last commands leave before the sockets close
            self._link.gone.wait(timeout)

    def _release_sockets(self) -> None:
        if self._link is not None:
            self._link.close()
        with self._send_lock:
            self._closing = True
            # An attached client's last aborts must still leave; the owner's core is gone.
            self.context.destroy(linger=1000 if self._lifeline is not None else 0)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)
