"""What an RL trainer calls on a served engine between rollouts: pausing and resuming
generation (vLLM's `pause_generation` modes), and new weights from the trainer's group or
from disk with a version tag (SGLang's names): the frontend's side (`GenerationPause` and
`WeightCalls`, parts of AsyncLLM, whose public methods hand the calls to them); the core
loop's is engine/weight_sync.CoreRL."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from vllm_rlt.config import ParamError, require
from vllm_rlt.engine.held_commands import HeldCommands
from vllm_rlt.engine.process.messages import AbortAll, AbortRequest, AddRequest
from vllm_rlt.engine.weight_sync import GROUP_TIMEOUT, JOIN_STATUS

PAUSE_MODES = ("abort", "wait", "keep")
CALL_TIMEOUT_S = GROUP_TIMEOUT.total_seconds() + 60.0  # the core waits on the trainer
DRAIN_POLL_S = 0.005  # how often a pause looks whether the requests in flight ended
JOIN_POLL_S = 0.05  # how often a join of the trainer's group is asked how it goes


class Answered:
    """The answer of a call that is already done: used as it is (`bool(engine.is_paused())`)
    or awaited, as code written for vLLM's coroutine of the same name awaits it."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __await__(self):
        return self.value
        yield  # a generator that finishes at once with the value

    def __bool__(self) -> bool:
        return bool(self.value)

    def __repr__(self) -> str:
        return repr(self.value)


class GenerationPause:
    """A frontend's pause. While paused, new requests are held here (not refused) and go to
    the core, in order, on `resume`. "abort" aborts what is in flight and "wait" lets it
    finish (both return once the core holds nothing); "keep" freezes it in the core (no
    pass runs) until `resume`, where it carries on from where it stopped."""

    def __init__(self, owner, shared: bool) -> None:
        self.owner = owner  # the AsyncLLM
        self.shared = shared  # other API servers feed the same cores
        self.mode: str | None = None
        self.held = HeldCommands()
        self.aborts = 0  # pauses with mode "abort" so far: a beam search between steps ends

    @property
    def paused(self) -> bool:
        return self.mode is not None

    def hold(self, command: AddRequest | AbortRequest) -> bool:
        """Keep a command back while paused; False: send it now."""
        if self.mode is None:
            return False
        self.held.hold(command)
        return True

    def drop(self, request_id: str, index: int | None) -> bool:
        """Abort a request held back here (see HeldCommands.drop)."""
        return self.held.drop(request_id, index, self.owner._streams.get(request_id))

    def drop_all(self) -> None:
        """Abort every request held back here."""
        self.held.drop_all(self.owner._streams.get)

    async def pause(self, mode: str) -> None:
        require(
            mode in PAUSE_MODES, f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}", "mode"
        )
        require(
            not self.shared,
            "pause_generation needs a single API server (--api-server-count 1): the others "
            "feed the same engine cores",
            "mode",
        )
        owner = self.owner
        if owner.dead is not None:
            raise owner.dead
        in_flight = owner.streams_in_cores()
        if mode == "abort":
            self.aborts += 1
        if self.mode is not None:  # paused already: only "abort" has something left to do
            require(
                mode != "wait" or self.mode != "keep",
                "mode 'wait' cannot finish requests frozen by mode 'keep': resume_generation "
                "first, or pause with mode 'abort'",
                "mode",
            )
            if mode != "abort":
                return
        else:
            self.mode = mode
        if mode == "keep":
            try:
                await self._call("pause_keep")
            except BaseException:
                await self.resume()
                raise
            return
        if mode == "abort":  # what is in the core: those held back here wait for resume
            owner.client.send(AbortAll(owner.client.client))
        # a stream its reader left counts once the core has answered its abort
        while not all(stream.engine_done for stream in in_flight):
            if owner.dead is not None:
                raise owner.dead
            await asyncio.sleep(DRAIN_POLL_S)

    async def resume(self) -> None:
        """Unfreeze the core (after "keep") and send the requests held back, in order."""
        if self.mode is None:
            return
        if self.mode == "keep":
            await self._call("resume")
        self.mode = None
        for command in self.held.take():
            self.owner.send_held(command)

    async def _call(self, name: str) -> dict[str, Any]:
        answer = await asyncio.to_thread(self.owner.client.call, name, 30.0)
        if "error" in answer:
            raise RuntimeError(f"{name}: {answer['error']}")
        return answer


class WeightCalls:
    """A frontend's weight updates, sent to its single engine core, and the version tag
    of the latest update that gave one."""

    def __init__(self, client) -> None:
        self.client = client  # the frontend's client over its cores
        self.version: str | None = None
        self.left: BaseException | None = None  # why waiting for the join under way stopped

    def leave(self, why: BaseException) -> None:
        """Stop waiting for the join under way (a shutdown, or AsyncLLM.abort_all): its
        caller gets `why`; the core's join runs on to its own end. A later join waits."""
        self.left = why

    async def call(
        self, name: str, args: dict[str, Any], weight_version: str | None = None
    ) -> None:
        """Make the core's call `name` with `args` (JSON values); ParamError for a refusal
        the caller caused, RuntimeError for one inside the core."""
        require(
            self.client.size == 1,
            f"{name} needs a single engine core (data_parallel_size 1, no disaggregation)",
            "data_parallel_size",
        )
        if name != "init_weights_update_group":
            args["weight_version"] = weight_version
        try:
            payload = json.dumps(args)
        except (TypeError, ValueError) as exc:
            raise ParamError(f"{name}: arguments must be JSON values ({exc})", "names") from None
        if name == "init_weights_update_group":
            self.left = None  # the core refuses a second join while one is under way
        answer = await asyncio.to_thread(self.client.call, f"{name}:{payload}", CALL_TIMEOUT_S)
        while answer.get("joining"):  # the core joins on a thread; other calls go between
            if self.left is not None:
                raise self.left
            await asyncio.sleep(JOIN_POLL_S)
            answer = await asyncio.to_thread(self.client.call, JOIN_STATUS, 30.0)
        if "error" in answer:
            if answer.get("internal"):
                raise RuntimeError(str(answer["error"]))
            raise ParamError(str(answer["error"]), str(answer.get("param") or "") or None)
        self.version = answer.get("weight_version")  # type: ignore[assignment]
