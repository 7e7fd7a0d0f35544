"""An RL trainer's calls on a served engine (engine/rl_calls.py): pause and resume in each
mode with requests in flight, nothing lost and nothing duplicated; abort by the id a caller
gave, n > 1 included; and new weights with a version tag while generation is paused."""

from __future__ import annotations

import asyncio

import pytest

from tests.unit.test_weight_sync import toy_folder
from vllm_rlt import SamplingParams
from vllm_rlt.engine.async_llm import AsyncLLM
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.sampling_params import RequestOutputKind

MAX_TOKENS = 24
PROMPTS = {f"r{i}": [5 + i, 6, 7, 8, 9] for i in range(3)}


def greedy(max_tokens: int = MAX_TOKENS, n: int = 1) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if n == 1 else 1.0,
        n=n,
        seed=0 if n > 1 else None,
        ignore_eos=True,
        output_kind=RequestOutputKind.DELTA,
    )


class Run:
    """One request's stream read to its end: every delta's tokens per completion, and
    whether its first output has come."""

    def __init__(self, engine: AsyncLLM, request_id: str, prompt: list[int], params) -> None:
        self.tokens: dict[int, list[int]] = {}
        self.finish: dict[int, str | None] = {}
        self.versions: set[str | None] = set()
        self.started = asyncio.Event()
        stream = engine.add_request(request_id, prompt, params)  # queued (or held) now
        self.task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream) -> None:
        try:
            async for output in stream:
                self.versions.add(output.weight_version)
                for completion in output.outputs:
                    self.tokens.setdefault(completion.index, []).extend(completion.token_ids)
                    self.finish[completion.index] = completion.finish_reason
                self.started.set()
        finally:
            stream.close()

    async def done(self) -> Run:
        await self.task
        return self


def passes(engine: AsyncLLM) -> int:
    """The core's passes so far, read through its control socket (answered by its loop
    between passes, so two equal answers mean no pass ran in between)."""
    return engine.engine_stats().num_passes


@pytest.fixture(scope="module")
def loop():
    """One event loop for the module: an AsyncLLM serves the loop of its first request."""
    loop = asyncio.new_event_loop()
    yield loop
    loop.run_until_complete(asyncio.sleep(0))  # the engine's reader, cancelled at shutdown
    loop.close()


@pytest.fixture(scope="module")
def engine(loop):
    engine = AsyncLLM.from_engine_args(EngineArgs(model="toy"), in_process=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def expected(engine, loop) -> dict[str, list[int]]:
    async def alone():
        return {
            rid: (await Run(engine, f"alone-{rid}", prompt, greedy()).done()).tokens[0]
            for rid, prompt in PROMPTS.items()
        }

    return loop.run_until_complete(alone())


def test_pause_keep_freezes_requests_and_resume_carries_them_on(engine, expected, loop):
    async def scenario():
        runs = {rid: Run(engine, rid, prompt, greedy()) for rid, prompt in PROMPTS.items()}
        await asyncio.gather(*(run.started.wait() for run in runs.values()))
        await engine.pause_generation(mode="keep")
        assert engine.is_paused() and engine.client.core_engine.has_unfinished
        frozen = passes(engine)
        late = Run(engine, "late", PROMPTS["r0"], greedy())  # waits, is not refused
        assert passes(engine) == frozen and not late.started.is_set()
        assert not any(run.task.done() for run in runs.values())
        await engine.resume_generation()
        for rid, run in {**runs, "late": late}.items():
            await run.done()
            assert run.tokens[0] == expected[rid if rid != "late" else "r0"]
            assert run.finish[0] == "length"

    loop.run_until_complete(scenario())
    assert not engine.is_paused() and engine.client.core_engine.all_blocks_free()


def test_pause_wait_lets_requests_finish_and_holds_new_ones(engine, expected, loop):
    async def scenario():
        runs = {rid: Run(engine, rid, prompt, greedy()) for rid, prompt in PROMPTS.items()}
        await asyncio.gather(*(run.started.wait() for run in runs.values()))
        await engine.pause_generation(mode="wait")
        assert not engine.client.core_engine.has_unfinished  # finished before it returned
        late = Run(engine, "late", PROMPTS["r1"], greedy())
        with pytest.raises(ValueError, match="mode must be one of") as caught:
            await engine.pause_generation(mode="later")
        assert caught.value.param == "mode"
        assert not late.started.is_set() and not engine.client.core_engine.has_unfinished
        await engine.resume_generation()
        await late.done()
        for rid, run in runs.items():
            await run.done()
            assert run.tokens[0] == expected[rid] and run.finish[0] == "length"
        assert late.tokens[0] == expected["r1"]

    loop.run_until_complete(scenario())


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_a_pause_returns_when_a_reader_leaves_during_its_drain(engine, loop, mode):
    """A request whose reader leaves while a pause drains is released (its abort sent) and
    hears no more from the engine: the pause counts it done instead of waiting forever."""

    async def scenario():
        run = Run(engine, "leaving", PROMPTS["r0"], greedy(max_tokens=400))
        await run.started.wait()
        pausing = asyncio.ensure_future(engine.pause_generation(mode=mode))
        await asyncio.sleep(0)
        run.task.cancel()
        await asyncio.wait_for(pausing, 30)
        await engine.resume_generation()

    loop.run_until_complete(scenario())
    assert not engine.client.core_engine.has_unfinished
    assert engine.client.core_engine.all_blocks_free()


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_a_pause_waits_for_a_reader_that_left_just_before_it(engine, loop, mode):
    """A stream released before the pause began still holds the core until its abort is
    answered: the pause waits for that answer too, so the core is empty when it returns."""

    async def scenario():
        run = Run(engine, "left-before", PROMPTS["r0"], greedy(max_tokens=400))
        await run.started.wait()
        run.task.cancel()
        await asyncio.gather(run.task, return_exceptions=True)
        try:
            await asyncio.wait_for(engine.pause_generation(mode=mode), 30)
            assert not engine.client.core_engine.has_unfinished
            assert engine.client.core_engine.all_blocks_free()
        finally:  # a failure leaves the shared engine running for the next test
            await engine.resume_generation()

    loop.run_until_complete(scenario())


def test_an_id_reused_once_its_reader_left_gets_its_own_outputs(engine, expected, loop):
    """The core answers the left request's abort after the new one is sent: that answer
    must not end the new request, which carries on to its own end."""

    async def scenario():
        left = Run(engine, "reused", PROMPTS["r0"], greedy(max_tokens=400))
        await left.started.wait()
        left.task.cancel()
        await asyncio.gather(left.task, return_exceptions=True)
        again = await Run(engine, "reused", PROMPTS["r1"], greedy()).done()
        assert again.finish[0] == "length" and again.tokens[0] == expected["r1"]

    loop.run_until_complete(scenario())
    assert engine.client.core_engine.all_blocks_free()


def test_pause_abort_ends_requests_and_abort_by_id_ends_every_completion(engine, expected, loop):
    async def scenario():
        runs = {rid: Run(engine, rid, prompt, greedy()) for rid, prompt in PROMPTS.items()}
        group = Run(engine, "group", PROMPTS["r2"], greedy(n=3))
        await asyncio.gather(*(run.started.wait() for run in [*runs.values(), group]))
        engine.abort("group")  # the id the caller gave: all three completions
        await group.done()
        assert set(group.finish.values()) == {"abort"} and len(group.finish) == 3
        await engine.pause_generation()  # mode "abort" by default, as in vLLM
        assert not engine.client.core_engine.has_unfinished
        held = Run(engine, "held", PROMPTS["r0"], greedy(n=2))
        late = Run(engine, "late", PROMPTS["r0"], greedy())
        engine.abort("held")  # never reached the core: ends at once
        await held.done()
        assert held.finish == {0: "abort", 1: "abort"} and held.tokens == {0: [], 1: []}
        await engine.resume_generation()
        await late.done()
        for rid, run in runs.items():
            tokens = (await run.done()).tokens[0]
            assert run.finish[0] == "abort" and tokens == expected[rid][: len(tokens)]
            assert 0 < len(tokens) < MAX_TOKENS
        assert late.tokens[0] == expected["r0"]

    loop.run_until_complete(scenario())
    assert engine.client.core_engine.all_blocks_free()


def test_abort_and_is_paused_answer_at_once_or_awaited_as_in_vllm(engine, loop):
    """vLLM's AsyncLLM.abort and is_paused are coroutines: awaiting ours works too, and
    abort takes several ids at once."""

    async def scenario():
        runs = [Run(engine, rid, PROMPTS["r1"], greedy(max_tokens=400)) for rid in "ab"]
        await asyncio.gather(*(run.started.wait() for run in runs))
        assert await engine.is_paused() is False and not engine.is_paused()
        await engine.abort(["a", "b"])
        for run in runs:
            await run.done()
            assert run.finish[0] == "abort"
        with pytest.raises(ValueError) as caught:
            engine.abort(["c", 7])  # nothing aborted when one id is bad
        assert caught.value.param == "request_id"

    loop.run_until_complete(scenario())
    assert engine.client.core_engine.all_blocks_free()


SCRIPT_WITHOUT_SHUTDOWN = """
import asyncio
from vllm_rlt.engine.async_llm import AsyncLLM
from vllm_rlt.engine.engine_args import EngineArgs

async def main():
    AsyncLLM.from_engine_args(EngineArgs(model="toy"))
    if RAISE:
        raise RuntimeError("the script failed")

if __name__ == "__main__":
    asyncio.run(main())
"""


@pytest.mark.parametrize("raises", [False, True], ids=["returns", "raises"])
def test_a_script_that_never_shuts_the_engine_down_still_exits(tmp_path, raises):
    """The engine core is a child process, which the interpreter's exit joins: without a
    stop at exit, a script that returned (or failed) without shutdown() waited forever."""
    import subprocess
    import sys

    script = tmp_path / "script.py"
    script.write_text(SCRIPT_WITHOUT_SHUTDOWN.replace("RAISE", str(raises)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, timeout=120)
    assert done.returncode == (1 if raises else 0), done.stderr.decode()[-2000:]


def test_weights_update_while_paused_and_outputs_carry_the_version(tmp_path):
    """An update needs an idle or paused engine; after it, every output carries its tag."""
    first, second = toy_folder(tmp_path / "first", 1), toy_folder(tmp_path / "second", 2)

    async def tokens(engine, request_id) -> Run:
        return await Run(engine, request_id, PROMPTS["r0"], greedy()).done()

    async def scenario():
        want = (await tokens(other, "want")).tokens[0]
        before = await tokens(engine, "before")
        assert before.versions == {None} and before.tokens[0] != want
        running = Run(engine, "running", PROMPTS["r1"], greedy(max_tokens=200))
        await running.started.wait()
        with pytest.raises(ValueError, match="needs an idle engine"):
            await engine.update_weights_from_disk(second, weight_version="v2")
        await engine.pause_generation(mode="keep")  # frozen requests go on with new weights
        await engine.update_weights_from_disk(second, weight_version="v2")
        with pytest.raises(ValueError, match="holds no .safetensors") as caught:
            await engine.update_weights_from_disk(str(tmp_path))
        assert caught.value.param == "model_path"
        garbage = tmp_path / "garbage"
        garbage.mkdir()
        (garbage / "model.safetensors").write_text("not a checkpoint\n")
        with pytest.raises(ValueError, match="is not a readable safetensors file") as caught:
            await engine.update_weights_from_disk(str(garbage))  # a 400 when served, not a 500
        assert caught.value.param == "model_path"
        await engine.resume_generation()
        await running.done()
        assert "v2" in running.versions and running.finish[0] == "length"
        after = await tokens(engine, "after")
        assert after.tokens[0] == want and after.versions == {"v2"}

    engine = AsyncLLM.from_engine_args(EngineArgs(model=first), in_process=True)
    other = AsyncLLM.from_engine_args(EngineArgs(model=second), in_process=True)
    try:
        asyncio.run(scenario())
    finally:
        engine.shutdown()
        other.shutdown()
