"""When a request stops on its token ids alone: EOS or a stop id once min_tokens are out, or
max_tokens reached. Stop strings need text, which the output processor makes."""

from __future__ import annotations

from vllm_rlt.core.request import Request


def token_stop(request: Request) -> str | None:
    """After the request's latest output token: "stop", "length" or None."""
    count = len(request.output_token_ids)
    params = request.params
    token = request.output_token_ids[-1]
    if count >= params.min_tokens and (
        token in request.eos_token_ids or token in request.stop_token_ids
    ):
        return "stop"
    if count >= params.max_tokens:
        return "length"
    return None
