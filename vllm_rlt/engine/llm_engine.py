"""LLMEngine: the engine core in this process, behind the frontend's output processor.

`LLM` runs it, one step at a time: the core's token deltas go through each request's
`RequestState` (text, stop strings, n completions, output form), as they do in `AsyncLLM`
for a core in another process; a stop string found here aborts its completion in the core.
"""

from __future__ import annotations

import time
from typing import Any

from vllm_rlt.engine.core_outputs import RequestDelta
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.input_processor import InputProcessor
from vllm_rlt.engine.output_processor import RequestState
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer import Tokenizer


class LLMEngine:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: Tokenizer | None,
        sampling_defaults: dict[str, Any] | None = None,
    ) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.processor = InputProcessor(
            tokenizer, core.checker, sampling_defaults or {}, core.eos_token_ids
        )
        self.states: dict[str, RequestState] = {}

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        """Validate and queue a request (ValueError names the bad field; nothing changes)."""
        request_id = str(request_id)
        prompt_token_ids, params = self.processor.prepare(prompt_token_ids, params)
        self.core.add_request(request_id, prompt_token_ids, params)  # checks on arrival
        self.states[request_id] = RequestState(
            request_id, prompt, list(prompt_token_ids), params, self.tokenizer, time.monotonic()
        )

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request at any time (its blocks and slot are freed at once); its output as
        it stands, or None for an id that is not running."""
        request_id = str(request_id)
        delta = self.core.abort_request(request_id)
        state = self.states.get(request_id)
        if state is None:
            return None
        if delta is None:  # the core let it go already (a step that was interrupted)
            del self.states[request_id]
            return None
        return self._absorb(state, delta, time.monotonic())

    @property
    def has_unfinished(self) -> bool:
        return bool(self.states) or self.core.has_unfinished

    def step(self) -> list[RequestOutput]:
        """Run one pass; the outputs of the requests that progressed, each in its output
        kind (a FINAL_ONLY request shows up once, when it ends)."""
        deltas = self.core.step()
        now = time.monotonic()  # when the pass's tokens are out
        outputs = []
        for delta in deltas:
            state = self.states.get(delta.request_id)
            if state is None:
                continue
            output = self._absorb(state, delta, now)
            if output is not None:
                outputs.append(output)
        return outputs

    def _absorb(self, state: RequestState, delta: RequestDelta, now: float) -> RequestOutput | None:
        """Take in one delta; a failure here fails this request alone (its output carries
        the error, and the core lets it go)."""
        try:
            for index in state.absorb(delta, now):  # ended by a stop string
                ended = self.core.abort_request(state.request_id, index)
                if ended is not None:
                    state.absorb(ended, now)
            output = state.output()
        except Exception as exc:  # noqa: BLE001 - fails this request only
            state.fail(exc, now)
            self.core.abort_request(state.request_id)
            output = state.output()
        if state.finished:  # and so the core holds nothing of it
            del self.states[state.request_id]
        return output
