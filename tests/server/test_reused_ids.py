"""A request id reused once its reader left (engine/held_commands.py): the new request
waits in the frontend until a core has answered the old one's abort, so the deltas of one id
never come from two requests at once. With several cores (data parallel, or prefill and
decode cores) the two could otherwise run on different cores, and each one's deltas reach
the other's stream. Here stand-in cores let the test choose when each delta arrives."""

from __future__ import annotations

import asyncio

import pytest

from vllm_rlt import SamplingParams
from vllm_rlt.engine.async_llm import AsyncLLM
from vllm_rlt.engine.core_outputs import CompletionDelta, EngineStats, RequestDelta
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.engine.process.messages import AbortRequest, AddRequest, EngineOutputs
from vllm_rlt.sampling_params import RequestOutputKind

STATS = EngineStats(
    num_running=0, num_waiting=0, num_free_blocks=1, num_blocks=1, num_passes=0, num_rows=0
)


class StandInCores:
    """Plays the engine cores: records what the frontend sends and which core runs each
    id, and delivers the deltas the test gives, when it gives them."""

    def __init__(self, real) -> None:
        self.client = real.client
        self.info = real.info
        self.size = 2
        self.sent: list = []
        self.runs_on: dict[str, int] = {}  # request id -> core
        self.pending: set[str] = set()  # ids the client keeps records of (a copy unreported)
        self.on_outputs = None

    def start_reading(self, on_outputs) -> None:
        self.on_outputs = on_outputs

    def send(self, command) -> None:
        if isinstance(command, AddRequest) and command.params.max_tokens >= 2**63:
            raise OverflowError("integer out of range")  # as msgspec's encoder says
        self.sent.append(command)
        if isinstance(command, AddRequest):  # the second core takes each new request
            self.runs_on[command.request_id] = 1

    def adds(self, request_id: str) -> int:
        return sum(isinstance(c, AddRequest) and c.request_id == request_id for c in self.sent)

    def holds(self, request_id: str) -> bool:
        return request_id in self.pending

    def forget_core(self, rank: int) -> list[str]:
        gone = [request_id for request_id, core in self.runs_on.items() if core == rank]
        for request_id in gone:
            del self.runs_on[request_id]
        return gone

    def deliver(self, request_id: str, tokens: list[int], finish: str | None) -> None:
        completion = CompletionDelta(0, 0, tokens, [1] * len(tokens), None, None, finish)
        delta = RequestDelta(request_id, [completion], finish is not None)
        self.on_outputs(EngineOutputs([delta], STATS))  # type: ignore[misc]

    def step(self) -> None:
        """An engine step with no request's delta (a copy reported, say)."""
        self.on_outputs(EngineOutputs([], STATS))  # type: ignore[misc]


@pytest.fixture(scope="module")
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture
def engine(loop):
    """A frontend on stand-in cores (the real one stays idle until shut down)."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model="toy"), in_process=True)
    real, engine.client = engine.client, StandInCores(engine.client)
    yield engine
    real.shutdown()


def params(n: int = 1) -> SamplingParams:
    return SamplingParams(
        max_tokens=4, n=n, temperature=1.0, seed=0, output_kind=RequestOutputKind.DELTA
    )


async def left_after_a_token(engine: AsyncLLM) -> None:
    """Request "x" streams a token, then its reader leaves (its abort is sent)."""
    stream = engine.add_request("x", [5, 6, 7], params())
    engine.client.deliver("x", [40], None)
    assert (await asyncio.wait_for(stream.__anext__(), 5)).outputs[0].token_ids == [40]
    stream.close()
    assert engine.client.sent[-1] == AbortRequest("x", None)


async def read_all(stream) -> tuple[list[int], str | None]:
    """The stream's tokens and finish reason (a stream that never ends fails the test)."""
    tokens, finish = [], None

    async def read() -> None:
        nonlocal finish
        async for output in stream:
            tokens.extend(output.outputs[0].token_ids)
            finish = output.outputs[0].finish_reason

    try:
        await asyncio.wait_for(read(), 5)
    finally:
        stream.close()
    return tokens, finish


def test_the_reused_id_is_sent_once_the_core_answers_the_left_ones_abort(engine, loop):
    async def scenario():
        cores = engine.client
        await left_after_a_token(engine)
        again = engine.add_request("x", [8, 9], params())
        assert cores.adds("x") == 1  # not sent: the first "x" may still run on a core
        cores.deliver("x", [41], "abort")  # the core's answer to the abort
        assert cores.adds("x") == 2
        cores.deliver("x", [42, 43], None)
        cores.deliver("x", [44, 45], "length")
        assert await read_all(again) == ([42, 43, 44, 45], "length")
        assert engine.streams_in_cores() == []

    loop.run_until_complete(scenario())


def test_a_waiting_request_aborted_or_left_is_never_sent(engine, loop):
    async def scenario():
        cores = engine.client
        await left_after_a_token(engine)
        waiting = engine.add_request("x", [8, 9], params(n=2))
        engine.abort("x", index=1)  # kept to follow the request
        engine.abort("x")  # the whole request: it ends here, never sent
        assert await read_all(waiting) == ([], "abort")
        left = engine.add_request("x", [8, 9], params())
        left.close()  # its reader leaves while it waits: nothing to abort in a core
        cores.deliver("x", [], "abort")
        assert cores.adds("x") == 1 and cores.sent[-1] == AbortRequest("x", None)
        assert engine.streams_in_cores() == [] and not engine.has_work

    loop.run_until_complete(scenario())


def test_a_completion_abort_follows_the_waiting_request(engine, loop):
    async def scenario():
        cores = engine.client
        await left_after_a_token(engine)
        engine.add_request("x", [8, 9], params(n=2))
        engine.abort("x", index=1)
        cores.deliver("x", [], "abort")
        assert cores.sent[-2:] == [cores.sent[-2], AbortRequest("x", 1)]
        assert isinstance(cores.sent[-2], AddRequest) and cores.sent[-2].params.n == 2
        engine.abort_all()

    loop.run_until_complete(scenario())


def test_a_lost_core_fails_the_left_request_and_sends_the_waiting_one_on(engine, loop):
    async def scenario():
        cores = engine.client
        await left_after_a_token(engine)
        again = engine.add_request("x", [8, 9], params())
        engine._on_core_lost(1, "killed")  # the core that held the left "x"
        await asyncio.sleep(0)
        assert cores.adds("x") == 2  # to a core still running; its stream carries on
        cores.deliver("x", [42], "length")
        assert await read_all(again) == ([42], "length")

    loop.run_until_complete(scenario())


def test_a_pause_waits_for_the_left_request_and_holds_the_waiting_one(engine, loop):
    async def scenario():
        cores = engine.client
        await left_after_a_token(engine)
        again = engine.add_request("x", [8, 9], params())
        pausing = asyncio.ensure_future(engine.pause_generation(mode="wait"))
        await asyncio.sleep(0.05)
        assert not pausing.done()  # the left "x" may still hold the core
        cores.deliver("x", [], "abort")
        await asyncio.wait_for(pausing, 5)
        assert cores.adds("x") == 1  # new requests wait for the resume
        await engine.resume_generation()
        assert cores.adds("x") == 2
        cores.deliver("x", [42], "length")
        assert await read_all(again) == ([42], "length")

    loop.run_until_complete(scenario())


def test_the_reused_id_also_waits_for_the_clients_records_of_the_old_one(engine, loop):
    """Under disaggregation the client keeps, by id, the blocks lent for the old request's
    copy until the decode core reports it, which may come after the abort's answer."""

    async def scenario():
        cores = engine.client
        await left_after_a_token(engine)
        cores.pending.add("x")  # the old request's copy is not reported yet
        again = engine.add_request("x", [8, 9], params())
        cores.deliver("x", [], "abort")
        assert cores.adds("x") == 1
        cores.pending.discard("x")
        cores.step()  # the report comes in a later step
        assert cores.adds("x") == 2
        cores.deliver("x", [42], "length")
        assert await read_all(again) == ([42], "length")

    loop.run_until_complete(scenario())


def test_a_waiting_request_aborted_before_a_core_is_lost_ends_as_aborted(engine, loop):
    async def scenario():
        await left_after_a_token(engine)
        waiting = engine.add_request("x", [8, 9], params())
        engine.abort("x")
        engine._on_core_lost(1, "killed")
        await asyncio.sleep(0)
        assert await read_all(waiting) == ([], "abort")  # not the lost core's error

    loop.run_until_complete(scenario())


def test_a_held_request_the_wire_cannot_carry_fails_alone(engine, loop):
    """A request edited after its checks waits, then cannot be encoded when it is sent: its
    own stream fails with the reason, and the step's other deltas still arrive."""

    async def scenario():
        cores = engine.client
        await left_after_a_token(engine)
        edited = params()
        waiting = engine.add_request("x", [8, 9], edited)
        edited.max_tokens = 2**70
        other = engine.add_request("y", [8, 9], params())
        completion = CompletionDelta(0, 0, [42], [1], None, None, "length")
        finished = [
            RequestDelta("x", [CompletionDelta(0, 0, [], [], None, None, "abort")], True),
            RequestDelta("y", [completion], True),
        ]
        cores.on_outputs(EngineOutputs(finished, STATS))
        with pytest.raises(ValueError, match="could not be sent to the engine"):
            await read_all(waiting)
        assert await read_all(other) == ([42], "length")
        assert not engine.has_work

    loop.run_until_complete(scenario())
