"""The server's beam search stream against a scripted engine: an aborting pause that lands
between two steps ends the search (no step starts after it; before, the next step waited
in the paused engine and the search ran on after resume), and an aborted step ends it
with the beams of the last whole step, their finish reason abort."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from vllm_rlt.beam_search import BeamSearchParams
from vllm_rlt.engine.async_llm import QueueFullError
from vllm_rlt.engine.beam_stream import BeamStream
from vllm_rlt.engine.request_checks import RequestLimits
from vllm_rlt.logprobs import Logprob
from vllm_rlt.outputs import CompletionOutput, RequestOutput
from vllm_rlt.sampling_params import SamplingParams

LIMITS = RequestLimits(vocab_size=50, max_model_len=64, num_blocks=16, block_size=16, num_loops=4)


class ScriptedEngine:
    """Each step answers tokens 10 and 11 for every beam; after `pause_after` steps an
    aborting pause is counted (as GenerationPause.pause does), or, with `abort_step`, that
    step's requests come back aborted."""

    def __init__(
        self, pause_after: int | None = None, abort_step: int | None = None, full: int = 0
    ) -> None:
        checker = SimpleNamespace(limits=LIMITS)
        self.processor = SimpleNamespace(
            tokenizer=None, eos_token_ids=frozenset({0}), checker=checker
        )
        self.pause = SimpleNamespace(aborts=0)
        self.weight_version = None
        self.pause_after, self.abort_step = pause_after, abort_step
        self.steps: list[int] = []
        self.full = full  # the queue is full for this many attempts at step 0 and at step 2
        self.refused: list[int] = []
        self.ids: set[str] = set()

    def add_request(self, request_id: str, ids: list[int], params: SamplingParams):
        assert request_id not in self.ids, "an aborted request's id may still be in use"
        self.ids.add(request_id)
        step = int(request_id.split("-beam")[1].split("-")[0])
        second = step == 2 and request_id.endswith("-1")  # one stream of the step is open
        if (step == 0 or second) and self.refused.count(step) < self.full:
            self.refused.append(step)
            raise QueueFullError("the waiting queue is full")
        if not self.steps or self.steps[-1] != step:
            self.steps.append(step)
        aborted = step == self.abort_step
        ranked = {10: Logprob(-0.1, 1), 11: Logprob(-0.2, 2)}
        made = CompletionOutput(
            0, "", [] if aborted else [10], [] if aborted else [4], None if aborted else [ranked],
            "abort" if aborted else "length",
        )  # fmt: skip
        engine = self

        class Stream:
            def __aiter__(self):
                return self._one()

            async def _one(self):
                yield RequestOutput(request_id, None, ids, [made], True)
                if engine.pause_after == step + 1:
                    engine.pause.aborts += 1

            def close(self) -> None:
                pass

        return Stream()


def _search(engine: ScriptedEngine) -> RequestOutput:
    stream = BeamStream(engine, "r", None, [1, 2], BeamSearchParams(2, 5), SamplingParams())

    async def run():
        return [output async for output in stream]

    outputs = asyncio.run(run())
    assert len(outputs) == 1
    return outputs[0]


def test_an_aborting_pause_between_steps_ends_the_search():
    engine = ScriptedEngine(pause_after=2)
    output = _search(engine)
    assert engine.steps == [0, 1]  # no step after the pause
    assert [c.finish_reason for c in output.outputs] == ["abort", "abort"]
    assert all(len(c.token_ids) == 2 for c in output.outputs)


def test_an_aborted_step_ends_the_search_with_the_last_whole_step():
    engine = ScriptedEngine(abort_step=3)
    output = _search(engine)
    assert engine.steps == [0, 1, 2, 3]
    assert {c.finish_reason for c in output.outputs} == {"abort"}
    assert all(len(c.token_ids) == 3 for c in output.outputs)


def test_an_undisturbed_search_runs_to_max_tokens():
    engine = ScriptedEngine()
    output = _search(engine)
    assert engine.steps == [0, 1, 2, 3, 4]
    assert [len(c.token_ids) for c in output.outputs] == [5, 5]
    assert {c.finish_reason for c in output.outputs} == {"length"}


def test_a_full_queue_is_waited_out_at_every_step():
    engine = ScriptedEngine(full=3)
    output = _search(engine)
    assert engine.refused == [0, 0, 0, 2, 2, 2]
    assert engine.steps == [0, 1, 2, 3, 4]
    assert {c.finish_reason for c in output.outputs} == {"length"}


def test_a_search_stopped_while_it_waits_for_room_ends_as_aborted():
    engine = ScriptedEngine(full=10**6)
    stream = BeamStream(engine, "r", None, [1, 2], BeamSearchParams(2, 5), SamplingParams())

    async def run():
        reader = asyncio.ensure_future(anext(aiter(stream)))
        await asyncio.sleep(0.05)  # it waits for room at step 0
        stream.close()
        return await reader

    output = asyncio.run(run())
    assert [c.finish_reason for c in output.outputs] == ["abort"]
