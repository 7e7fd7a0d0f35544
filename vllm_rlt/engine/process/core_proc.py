"""The engine core's own loop, in its own process (or a thread, for tests that reach into
the engine): take commands from a ZeroMQ socket, step, push one message per step that
produced something.

The loop never waits while it has work: it drains the commands that arrived, answers the
control calls (a request-reply socket of their own), runs a pass, and sends that pass's
deltas with the engine counters. Idle, it blocks on its inputs (polling them every
millisecond while K/V copies from a prefill core still run, and every 10 ms while blocks
lent to decode cores hold back every pass). It
leaves when told to, when its parent process dies, or after an error, which it reports
in its last message.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from vllm_rlt.config import require
from vllm_rlt.engine.builder import build_engine
from vllm_rlt.engine.core_outputs import CoreStats, RequestDelta
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.parent_watch import leave_with_parent
from vllm_rlt.engine.process.core_handovers import CoreHandovers, HandoverNews
from vllm_rlt.engine.process.messages import (
    AbortAll,
    AbortRequest,
    AddRequest,
    ControlCall,
    ControlReply,
    EngineDead,
    EngineInfo,
    EngineOutputs,
    ForgetKVPool,
    ImportRequest,
    PrefetchKV,
    Ready,
    ReleaseHandover,
    StartupFailed,
    StopCore,
    command_codec,
    message_codec,
)
from vllm_rlt.engine.process.pass_rate import PassRate
from vllm_rlt.engine.process.remote_channel import (
    ChannelKeys,
    Peer,
    secure_client,
    watch_frontend,
)
from vllm_rlt.engine.process_setup import settle_engine_process
from vllm_rlt.engine.weight_sync import CoreRL
from vllm_rlt.engine_config import EngineConfig

logger = logging.getLogger(__name__)

LINGER_MS = 5000


HEARTBEAT_S = 0.1  # while busy without new tokens, counters still go out this often
RANKS_CHECK_MS = 500  # while idle, how often rank 0 looks at its tensor-parallel ranks


class CoreLoop:
    """Drives one EngineCore from the commands on `inputs` and the calls on `control`.

    `outputs` holds one socket per client (frontend): each request's deltas go back to the
    client that sent it, and the counters go with every message. With a single client,
    nothing needs routing.
    """

    def __init__(
        self,
        engine: EngineCore,
        inputs: zmq.Socket,
        control: zmq.Socket,
        outputs: list[zmq.Socket],
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
        self.routed = len(outputs) > 1
        self.owners: dict[str, int] = {}  # request id -> its client (routed mode only)
        self.outbox: list[list[RequestDelta]] = [[] for _ in outputs]
        # Prefill/decode disaggregation: what this core offers and copies, per client.
        self.handovers = (
            None if engine.disagg is None else CoreHandovers(engine.disagg, len(outputs))
        )
        self.last_sent = [0.0] * len(outputs)
        self.rate = PassRate()
        self.rl = CoreRL(engine)

    def run(self) -> None:
        """Serve until a StopCore command; any error is sent as the last message, then raised."""
        engine = self.engine
        group = engine.model.tensor_parallel
        ranks = group if group is not None and group.followers else None
        try:
            while not self.stopping:
                busy = engine.has_unfinished and not self.rl.frozen  # "keep": no pass runs
                wait = (10 if engine.held_back else 0) if busy else None  # ms
                if engine.disagg is not None:  # K/V in transit: look at it again soon
                    wait = engine.disagg.wait_ms(busy, engine.held_back)
                if ranks is not None and wait != 0:  # a rank lost while idle: say so now
                    ranks.check_followers()
                    wait = min(wait or RANKS_CHECK_MS, RANKS_CHECK_MS)
                self._take_commands(wait)
                if engine.has_unfinished and not (self.stopping or self.rl.frozen):
                    self._route(engine.step())
                    if self.handovers is not None:
                        self.handovers.after_step(self._client_of, self._client_of_offer)
                    self.rate.record(engine.passes.num_passes, engine.passes.num_rows_total)
                if self.handovers is not None:
                    self.handovers.collect_copied()
                self._publish()
        except BaseException as exc:
            dead = self.encode(EngineDead(f"{type(exc).__name__}: {exc}", traceback.format_exc()))
            for socket in self.outputs:
                socket.send(dead, copy=False)
            raise
        finally:
            if self.handovers is not None:
                self.handovers.close()

    def _client_of(self, request_id: str) -> int:
        return self.owners.get(request_id, 0) if self.routed else 0

    def _client_of_offer(self, request_id: str) -> int:
        """The client of a request handed over: it leaves this core."""
        return self.owners.pop(request_id, 0) if self.routed else 0

    # ----------------------------------------------------------------- outputs
    def _route(self, deltas: list[RequestDelta]) -> None:
        if not self.routed:
            self.outbox[0].extend(deltas)
            return
        owners, outbox = self.owners, self.outbox
        for delta in deltas:
            request_id = delta.request_id
            client = owners.pop(request_id, 0) if delta.finished else owners.get(request_id, 0)
            outbox[client].append(delta)

    def _publish(self) -> None:
        """Send each client its deltas; a client with requests in flight but nothing new
        still hears from the core every HEARTBEAT_S (its stall check reads that)."""
        now = time.monotonic()
        stats = None
        for client, deltas in enumerate(self.outbox):
            news = HandoverNews() if self.handovers is None else self.handovers.news[client]
            if not (deltas or news):
                if now - self.last_sent[client] < HEARTBEAT_S or not self._busy(client):
                    continue
            if stats is None:
                stats = self.engine.stats()
            message = EngineOutputs(
                deltas, stats, news.offers, news.imported, news.prefetches, news.prefetched
            )
            self.outputs[client].send(self.encode(message), copy=False)
            self.outbox[client] = []
            if self.handovers is not None:
                self.handovers.news[client] = HandoverNews()
            self.last_sent[client] = now

    def _busy(self, client: int) -> bool:
        if not self.routed:
            return self.engine.has_unfinished
        return client in self.owners.values()

    # ----------------------------------------------------------------- commands
    def _take_commands(self, wait_ms: int | None) -> None:
        """Apply every command and answer every call that arrived, waiting up to `wait_ms`
        (None: until one comes) for the first."""
        if wait_ms != 0:
            self.poller.poll(wait_ms)
        while self.inputs.poll(0):
            try:
                command = self.decode(self.inputs.recv(copy=False))
            except msgspec.ValidationError as exc:  # one bad message: not every request
                logger.error("dropped a command the engine core could not read: %s", exc)
                continue
            if isinstance(command, AddRequest):
                self._add(command)
            elif isinstance(command, AbortRequest):
                delta = self.engine.abort_request(command.request_id, command.index)
                if delta is not None:
                    self._route([delta])
            elif isinstance(command, AbortAll):
                self._abort_all(command.client)
            elif isinstance(command, StopCore):
                self._abort_all()
                self.stopping = True
            else:
                self._handover_command(command)
        while self.control.poll(0):
            call = self.decode_call(self.control.recv(copy=False))
            self.control.send(self.encode(ControlReply(call.call_id, self._control(call.name))))

    def _add(self, command: AddRequest) -> None:
        """Queue a request; a failure (bad input or otherwise) fails it alone."""
        engine = self.engine
        self._queue(
            command.request_id,
            command.client,
            lambda: engine.add_request(
                command.request_id,
                command.prompt_token_ids,
                command.params,
                handover=command.handover,
            ),
        )

    def _handover_command(
        self, command: ImportRequest | PrefetchKV | ReleaseHandover | ForgetKVPool
    ) -> None:
        """A command of prefill/decode disaggregation: only a disaggregated core gets one."""
        handovers = self.handovers
        if handovers is None:
            raise RuntimeError(f"{type(command).__name__} sent to a core not disaggregated")
        client = getattr(command, "client", 0) if self.routed else 0
        if isinstance(command, ImportRequest):  # continue a request a prefill core ran
            offer = command.offer
            self._queue(offer.request_id, command.client, handovers.importer(offer, client))
            handovers.after_import(offer.request_id)
        elif isinstance(command, PrefetchKV):
            handovers.prefetch(command.prefetch, client)
        elif isinstance(command, ReleaseHandover):
            handovers.disagg.release_handover(command.request_id)
        else:
            handovers.disagg.forget_kv(command.pool_id)

    def _queue(self, request_id: str, client: int, add: Callable[[], None]) -> None:
        try:
            if request_id in self.owners:
                raise ValueError(f"request_id {request_id!r} is already in use")
            add()
        except Exception as exc:  # noqa: BLE001 - fails this request only
            invalid = isinstance(exc, ValueError)
            failure = RequestDelta(
                request_id,
                [],
                True,
                error=str(exc) if invalid else f"{type(exc).__name__}: {exc}",
                error_param=getattr(exc, "param", None),
                invalid=invalid,
            )
            self.outbox[client if self.routed else 0].append(failure)
            return
        if self.routed:
            self.owners[request_id] = client

    def _abort_all(self, client: int | None = None) -> None:
        """Abort the requests of `client` (None: of every client)."""
        if client is None or not self.routed:
            request_ids = list(self.engine.groups)
        else:
            request_ids = [rid for rid, owner in self.owners.items() if owner == client]
        for request_id in request_ids:
            delta = self.engine.abort_request(request_id)
            if delta is not None:
                self._route([delta])

    def _control(self, name: str) -> CoreStats | dict[str, bool | str]:
        engine = self.engine
        if name == "stats":
            return CoreStats(
                **msgspec.structs.asdict(engine.stats()),
                num_requests=len(engine.groups),
                num_free_slots=len(engine.scheduler.free_slots),
                num_cached_blocks=engine.kv.num_cached_blocks,
                has_unfinished=engine.has_unfinished,
                all_blocks_free=engine.all_blocks_free(),
                passes_per_second=self.rate.passes_per_second(),
                rows_per_pass=self.rate.rows_per_pass(),
            )
        if name.startswith("kv_"):
            if self.handovers is None:
                return {"error": "this engine core was built without disaggregation"}
            return self.handovers.control(name)
        answer = self.rl.control(name)
        if answer is not None:
            return answer
        return self._memory_control(name)

    def _memory_control(self, name: str) -> dict[str, bool | str]:
        """vLLM's sleep mode and prefix-cache reset (the server's --enable-sleep-mode
        endpoints); a refusal is {"error": why}."""
        engine = self.engine
        try:
            if name in ("sleep_1", "sleep_2"):
                refusal = None if engine.disagg is None else engine.disagg.sleep_refusal()
                require(refusal is None, refusal or "", "level")
                engine.sleep(int(name[-1]))
            elif name.startswith("wake_up"):  # "wake_up" or "wake_up:TAG,TAG"
                _, _, tags = name.partition(":")
                engine.wake_up(tags.split(",") if tags else None)
            elif name == "reset_prefix_cache":
                return {"reset": engine.reset_prefix_cache()}
            elif name != "is_sleeping":
                return {"error": f"unknown control call {name!r}"}
        except ValueError as exc:
            return {"error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - answered; the core serves on
            logger.exception("control call %r failed", name)
            return {"error": f"{name} failed: {type(exc).__name__}: {exc}"}
        return {"is_sleeping": engine.is_sleeping}


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
        scheduling_policy=engine.scheduler.config.scheduling_policy,
        prompt_tables=engine.scheduler.table_planes,
        scheduler_note=engine.scheduler_note,
        eos_token_ids=sorted(engine.eos_token_ids),
    )


def build_core(config: EngineConfig) -> tuple[EngineCore, str]:
    """Load the model and build its engine (which speaks in token ids: text is the
    frontend's)."""
    built = build_engine(config)
    return built.engine, built.model_name


def startup_failure(exc: BaseException) -> StartupFailed:
    if isinstance(exc, ValueError):
        return StartupFailed("invalid", str(exc))
    if isinstance(exc, OSError):
        return StartupFailed("os", str(exc))
    return StartupFailed("internal", f"{type(exc).__name__}: {exc}", traceback.format_exc())


def serve_engine(
    config: EngineConfig,
    context: zmq.Context,
    peers: list[Peer],
    on_built: Callable[[EngineCore], None] | None = None,
    keys: ChannelKeys | None = None,
) -> int:
    """Build the engine, report ready (or why not) to the first peer, run the loop; the
    exit code. Each peer (frontend) bound its addresses; the core connects to all of them,
    over the encrypted channel when given its `keys` (a frontend on another host).
    `on_built` hands an in-process caller the engine itself."""
    inputs = context.socket(zmq.PULL)
    control = context.socket(zmq.REP)
    outputs = []
    for input_address, control_address, output_address in peers:
        output = context.socket(zmq.PUSH)
        output.setsockopt(zmq.SNDHWM, 0)
        if keys is not None:
            for socket in (inputs, control, output):
                secure_client(socket, keys)
            watch_frontend(output, output_address, _frontend_lost)
        inputs.connect(input_address)
        control.connect(control_address)
        output.connect(output_address)
        outputs.append(output)
    try:
        return _serve(config, inputs, control, outputs, on_built)
    finally:
        # Let the last messages leave (a client that is gone never takes them).
        for socket in (inputs, control, *outputs):
            socket.close(linger=LINGER_MS)


def _serve(config: EngineConfig, inputs, control, outputs, on_built) -> int:
    encode = message_codec()[0].encode
    try:
        engine, model_name = build_core(config)
    except BaseException as exc:  # noqa: BLE001 - reported to the frontend, one line
        outputs[0].send(encode(startup_failure(exc)))
        return 1
    if on_built is not None:
        on_built(engine)
    outputs[0].send(encode(Ready(engine_info(engine, model_name))))
    try:
        CoreLoop(engine, inputs, control, outputs).run()
    except BaseException:  # noqa: BLE001 - already sent as EngineDead
        logger.debug("engine core stopped after an error", exc_info=True)
        return 1
    return 0


def _frontend_lost(message: str) -> None:
    logger.error("%s", message)
    os._exit(3)


def run_engine_core(
    config: EngineConfig,
    peers: list[Peer],
    parent_pid: int,
    lifeline: Any = None,
    env: dict[str, str] | None = None,
    keys: ChannelKeys | None = None,
) -> None:
    """Entry point of the engine-core process (`config` arrives pickled). `lifeline` is
    the write end of a pipe that this process holds, unused, until it ends: processes that
    are not its parent learn of its end when their read end reports end-of-file. `env` is
    set before anything touches the device (CUDA_VISIBLE_DEVICES of one data-parallel
    rank)."""
    os.environ.update(env or {})
    # The frontend owns the lifetime: Ctrl+C or SIGTERM reach it, it drains, then it tells
    # the core to stop. Without its parent (killed), the core leaves by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    leave_with_parent(parent_pid)
    context = zmq.Context()
    code = serve_engine(
        config, context, peers, lambda engine: settle_engine_process(engine.model.device), keys
    )
    # Let the last messages leave, then exit without tearing the interpreter down: the
    # device and the runtime's threads need no orderly teardown, and it could hang.
    context.term()
    os._exit(code)
