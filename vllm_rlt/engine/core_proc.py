"""The engine core's own loop, in its own process (or a thread, for tests that reach into
the engine): take commands from a ZeroMQ socket, step, push one message per step that
produced something.

The loop never waits while it has work: it drains the commands that arrived, answers the
control calls (a request-reply socket of their own), runs a pass, and sends that pass's
deltas with the engine counters. Idle, it blocks on its inputs. It
leaves when told to, when its parent process dies, or after an error, which it reports
in its last message.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    ControlCall,
    ControlReply,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    Ready,
    RequestDelta,
    StartupFailed,
    command_codec,
    message_codec,
)

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


HEARTBEAT_S = 0.1  # while busy without new tokens, counters still go out this often


class CoreLoop:
    """Drives one EngineCore from the commands on `inputs` and the calls on `control`,
    writing to `outputs`."""

    def __init__(
        self, engine: EngineCore, inputs: zmq.Socket, control: zmq.Socket, outputs: zmq.Socket
    ) -> None:
        self.engine = engine
        self.inputs = inputs
        self.control = control
        self.outputs = outputs
        self.encode = message_codec()[0].encode
        self.decode = command_codec()[1].decode
        self.decode_call = msgspec.msgpack.Decoder(ControlCall).decode
        self.poller = zmq.Poller()
        self.poller.register(inputs, zmq.POLLIN)
        self.poller.register(control, zmq.POLLIN)
        self.stopping = False
        self.last_sent = 0.0

    def run(self) -> None:
        """Serve until a shutdown call; any error is sent as the last message, then raised."""
        try:
            while not self.stopping:
                deltas = self._take_commands(block=not self.engine.has_unfinished)
                if self.engine.has_unfinished and not self.stopping:
                    deltas.extend(self.engine.step_deltas())
                now = time.monotonic()
                if deltas or self.stopping or now - self.last_sent >= HEARTBEAT_S:
                    self._send(EngineOutputs(deltas, self.engine.stats()))
                    self.last_sent = now
        except BaseException as exc:
            self._send(EngineDead(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            raise

    def _send(self, message) -> None:
        self.outputs.send(self.encode(message), copy=False)

    def _take_commands(self, block: bool) -> list[RequestDelta]:
        """Apply every command and answer every call that arrived (idle: wait for one)."""
        deltas: list[RequestDelta] = []
        if block:
            self.poller.poll(None)
        while self.inputs.poll(0):
            command = self.decode(self.inputs.recv(copy=False))
            if isinstance(command, AddRequest):
                failure = self._add(command)
                if failure is not None:
                    deltas.append(failure)
            elif isinstance(command, AbortRequest):
                delta = self.engine.abort_request_delta(command.request_id, command.index)
                if delta is not None:
                    deltas.append(delta)
            elif isinstance(command, AbortAll):
                deltas.extend(self._abort_all())
        while self.control.poll(0):
            call = self.decode_call(self.control.recv(copy=False))
            reply = ControlReply(call.call_id, self._control(call.name, deltas))
            self.control.send(self.encode(reply))
        return deltas

    def _add(self, command: AddRequest) -> RequestDelta | None:
        """Queue a request; a failure (bad input or otherwise) fails it alone."""
        try:
            self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
        except Exception as exc:  # noqa: BLE001 - fails this request only
            invalid = isinstance(exc, ValueError)
            return RequestDelta(
                command.request_id,
                [],
                True,
                error=str(exc) if invalid else f"{type(exc).__name__}: {exc}",
                error_param=getattr(exc, "param", None),
                invalid=invalid,
            )
        return None

    def _abort_all(self) -> list[RequestDelta]:
        deltas = []
        for request_id in list(self.engine.groups):
            delta = self.engine.abort_request_delta(request_id)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _control(self, name: str, deltas: list[RequestDelta]) -> dict[str, Any]:
        engine = self.engine
        if name == "shutdown":
            deltas.extend(self._abort_all())
            self.stopping = True
            return {"stopped": True}
        if name == "stats":
            stats = engine.stats()
            return {
                "num_requests": len(engine.groups),
                "has_unfinished": engine.has_unfinished,
                "all_blocks_free": engine.all_blocks_free(),
                "num_free_blocks": stats.num_free_blocks,
                "num_blocks": stats.num_blocks,
                "num_free_slots": len(engine.scheduler.free_slots),
                "num_running": stats.num_running,
                "num_waiting": stats.num_waiting,
                "num_passes": stats.num_passes,
                "num_rows": stats.num_rows,
            }
        return {"error": f"unknown control call {name!r}"}


def engine_info(engine: EngineCore, model_name: str) -> EngineInfo:
    return EngineInfo(
        model_name=model_name,
        device=str(engine.model.device),
        num_loops=engine.num_loops,
        vocab_size=engine.model.config.vocab_size,
        max_model_len=engine.max_model_len,
        num_blocks=engine.kv.num_blocks,
        block_size=engine.kv.block_size,
        max_num_seqs=engine.scheduler.config.max_num_seqs,
    )


def build_engine(llm_kwargs: dict[str, Any]) -> tuple[EngineCore, str]:
    """Load the model and build its engine; the core never makes text."""
    from vllm_rlt.engine.llm import LLM

    llm = LLM(**llm_kwargs)
    llm.engine.leave_text_to_caller()
    return llm.engine, llm.model_name


def startup_failure(exc: BaseException) -> StartupFailed:
    if isinstance(exc, ValueError):
        return StartupFailed("invalid", str(exc))
    if isinstance(exc, OSError):
        return StartupFailed("os", str(exc))
    return StartupFailed("internal", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def serve_engine(
    llm_kwargs: dict[str, Any],
    context: zmq.Context,
    addresses: tuple[str, str, str],
    on_built: Callable[[EngineCore], None] | None = None,
) -> int:
    """Build the engine, report ready (or why not), run the loop; the exit code.
    `on_built` hands an in-process caller the engine itself."""
    input_address, control_address, output_address = addresses
    inputs = context.socket(zmq.PULL)
    inputs.connect(input_address)
    control = context.socket(zmq.REP)
    control.connect(control_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.SNDHWM, 0)
    outputs.connect(output_address)
    encode = message_codec()[0].encode
    try:
        engine, model_name = build_engine(llm_kwargs)
    except BaseException as exc:  # noqa: BLE001 - reported to the frontend, one line
        outputs.send(encode(startup_failure(exc)))
        return 1
    if on_built is not None:
        on_built(engine)
    outputs.send(encode(Ready(engine_info(engine, model_name))))
    try:
        CoreLoop(engine, inputs, control, outputs).run()
    except BaseException:  # noqa: BLE001 - already sent as EngineDead
        logger.debug("engine core stopped after an error", exc_info=True)
        return 1
    return 0


def run_engine_core(
    llm_kwargs: dict[str, Any], addresses: tuple[str, str, str], parent_pid: int
) -> None:
    """Entry point of the engine-core process."""
    # The frontend owns the lifetime: Ctrl+C or SIGTERM reach it, it drains, then it tells
    # the core to stop. Without its parent (killed), the core leaves by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    context = zmq.Context()
    code = serve_engine(llm_kwargs, context, addresses)
    # Let the last messages leave, then exit without tearing the interpreter down: the
    # device and the runtime's threads need no orderly teardown, and it could hang.
    context.destroy(linger=5000)
    os._exit(code)


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(PARENT_POLL_S)
