"""The frontend's handle on the engine core: start it (its own process by default, or a
thread in this process), send it commands, and receive its messages on a reader thread.

The reader hands every `EngineOutputs` to a callback, once per engine step, and notices
at once when the core process dies (its sentinel joins the poll), so callers never wait
on a dead engine.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import shutil
import signal
import tempfile
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import zmq

from vllm_rlt.engine.core_proc import run_engine_core, serve_engine
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.messages import (
    Command,
    ControlCall,
    ControlReply,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    Ready,
    StartupFailed,
    command_codec,
    message_codec,
)

logger = logging.getLogger(__name__)


class EngineCoreDied(RuntimeError):
    """The engine core stopped; the message says why."""


class EngineCoreClient:
    """Owns the core's process (or thread) and both sockets.

    `on_outputs(outputs)` and `on_death(reason)` run on the reader thread. Construction
    blocks until the core has loaded its model: a startup failure raises the core's own
    error (ValueError / OSError with its one-line message, else RuntimeError).
    """

    def __init__(
        self,
        llm_kwargs: dict[str, Any],
        on_outputs: Callable[[EngineOutputs], None],
        on_death: Callable[[str], None],
        in_process: bool = False,
    ) -> None:
        self.on_outputs = on_outputs
        self.on_death = on_death
        self.in_process = in_process
        self.context = zmq.Context()
        self._encode = command_codec()[0].encode
        self._decode = message_codec()[1].decode
        self._send_lock = threading.Lock()
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        self._closing = False  # the sockets are being released: send nothing more
        self._stopping = False  # the core was told to stop: its exit is no death
        self.dead_reason: str | None = None
        self._ipc_dir: str | None = None
        if in_process:
            tag = uuid.uuid4().hex
            input_address, output_address = f"inproc://in-{tag}", f"inproc://out-{tag}"
        else:
            self._ipc_dir = tempfile.mkdtemp(prefix="vllm-rlt-")
            input_address = f"ipc://{self._ipc_dir}/in"
            output_address = f"ipc://{self._ipc_dir}/out"
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)
        self.input.bind(input_address)
        self.output = self.context.socket(zmq.PULL)
        self.output.setsockopt(zmq.RCVHWM, 0)
        self.output.bind(output_address)
        self.process: multiprocessing.process.BaseProcess | None = None
        self.thread: threading.Thread | None = None
        self.core_engine: EngineCore | None = None  # in-process only: the engine itself
        if in_process:
            self.thread = threading.Thread(
                target=serve_engine,
                args=(llm_kwargs, self.context, input_address, output_address, self._built),
                name="vllm-rlt-engine-core",
                daemon=True,
            )
            self.thread.start()
        else:
            # spawn: the parent may hold CUDA state and threads that fork would copy.
            self.process = multiprocessing.get_context("spawn").Process(
                target=run_engine_core,
                args=(llm_kwargs, input_address, output_address, os.getpid()),
                name="vllm-rlt-engine-core",
                daemon=False,
            )
            self.process.start()
        try:
            self.info = self._wait_ready()
        except BaseException:
            self._stop_core(timeout=5.0)
            self._release_sockets()
            raise
        self._reader = threading.Thread(target=self._read, name="vllm-rlt-core-reader", daemon=True)
        self._reader.start()

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
                    raise _startup_error(message)
                raise RuntimeError(f"engine core sent {type(message).__name__} before ready")
            if not self.core_alive():
                raise RuntimeError(
                    f"the engine core process exited during startup ({self._exit_status()})"
                )

    # ----------------------------------------------------------------- commands
    def send(self, command: Command) -> None:
        """Queue a command for the core (any thread); dropped once the core is gone."""
        if self.dead_reason is not None:
            return
        data = self._encode(command)
        with self._send_lock:
            if not self._closing:
                self.input.send(data, copy=False)

    def call(self, name: str, timeout: float = 30.0) -> dict[str, Any]:
        """A control call ("stats", "shutdown"), answered by the core between passes."""
        if self.dead_reason is not None:
            raise EngineCoreDied(self.dead_reason)
        call_id = next(self._call_ids)
        future: Future = Future()
        self._calls[call_id] = future
        self.send(ControlCall(call_id, name))
        try:
            return future.result(timeout)
        finally:
            self._calls.pop(call_id, None)

    def core_alive(self) -> bool:
        if self.process is not None:
            return self.process.is_alive()
        return self.thread is not None and self.thread.is_alive()

    # ----------------------------------------------------------------- reader thread
    def _read(self) -> None:
        poller = zmq.Poller()
        poller.register(self.output, zmq.POLLIN)
        sentinel = self.process.sentinel if self.process is not None else None
        if sentinel is not None:
            poller.register(sentinel, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(None if sentinel is not None else 500))
            if self.output in ready:
                # Everything already queued goes first, so a death notice comes last.
                while self.output.poll(0):
                    if not self._handle(self._decode(self.output.recv(copy=False))):
                        return
                continue
            if sentinel is not None and sentinel in ready or not self.core_alive():
                if not self._stopping:
                    self._died(f"the engine core process died ({self._exit_status()})")
                return

    def _handle(self, message) -> bool:
        """Act on one message; False once the core has stopped."""
        if isinstance(message, EngineOutputs):
            try:
                self.on_outputs(message)
            except Exception:  # noqa: BLE001 - a caller's bug must not stop the reader
                logger.exception("handling engine outputs failed")
        elif isinstance(message, ControlReply):
            future = self._calls.get(message.call_id)
            if future is not None and not future.done():
                future.set_result(message.value)
        elif isinstance(message, EngineDead):
            logger.error("engine stopped after an error:\n%s", message.traceback.rstrip())
            self._died(f"engine stopped: {message.message}")
            return False
        return True

    def _died(self, reason: str) -> None:
        self.dead_reason = reason
        for future in list(self._calls.values()):
            if not future.done():
                future.set_exception(EngineCoreDied(reason))
        self.on_death(reason)

    def _exit_status(self) -> str:
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
        """Ask the core to stop (it aborts what is left), wait for it, free the sockets."""
        self._stopping = True
        if self.dead_reason is None and self.core_alive():
            try:
                self.call("shutdown", timeout)
            except Exception:  # noqa: BLE001 - stopped below by force
                logger.warning("the engine core did not answer the shutdown call")
        self._stop_core(timeout)
        self._reader.join(timeout=5)
        self._release_sockets()

    def _stop_core(self, timeout: float) -> None:
        self._stopping = True
        if self.process is not None:
            self.process.join(timeout)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        elif self.thread is not None:
            self.thread.join(timeout)

    def _release_sockets(self) -> None:
        with self._send_lock:
            self._closing = True
            self.context.destroy(linger=0)
        if self._ipc_dir is not None:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _startup_error(failure: StartupFailed) -> BaseException:
    if failure.kind == "invalid":
        return ValueError(failure.message)
    if failure.kind == "os":
        return OSError(failure.message)
    if failure.traceback:
        logger.error("the engine core failed to start:\n%s", failure.traceback.rstrip())
    return RuntimeError(failure.message)
