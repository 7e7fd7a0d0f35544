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


def stop_token(request: Request) -> int | None:
    """vLLM's stop_reason for a request `token_stop` ended with "stop": the stop id that
    ended it, or None for EOS (checked first, as vLLM does)."""
    token = request.output_token_ids[-1] if request.output_token_ids else None
    if token is None or token in request.eos_token_ids or token not in request.stop_token_ids:
        return None
    return token
