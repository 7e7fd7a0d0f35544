"""`vllm-rlt generate`'s sampling flags and the `SamplingParams` they make."""

from __future__ import annotations

import argparse

from vllm_rlt.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    group.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop before this")
    group.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    group.add_argument("--top-k", type=int, default=0, help="0 = every token")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus mass")
    group.add_argument("--min-p", type=float, default=0.0, help="relative to the top token")
    group.add_argument(
        "--sampling-seed", type=int, default=None, help="per-request seed (default: random)"
    )
    group.add_argument(
        "--priority",
        type=int,
        default=0,
        help="every prompt's priority (lower runs first; needs --scheduling-policy priority)",
    )
    group.add_argument(
        "--stop", action="append", default=None, help="stop string (repeatable; default: none)"
    )
    group.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        help="keep the stop string that ended the text",
    )
    group.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    group.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide positive logits (multiply negative ones) of prompt and output tokens",
    )
    group.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtract per output occurrence"
    )
    group.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtract once a token was output"
    )
    group.add_argument(
        "--allowed-token-ids",
        type=int,
        nargs="+",
        default=None,
        metavar="ID",
        help="sample only these token ids (default: any)",
    )
    group.add_argument(
        "--bad-words",
        nargs="+",
        default=None,
        metavar="WORD",
        help="words never to generate (default: none)",
    )
    group.add_argument(
        "--logprobs",
        type=int,
        default=None,
        help="each generated token's logprob and this many top alternatives (with --json; "
        "default: none)",
    )
    group.add_argument(
        "--prompt-logprobs",
        type=int,
        default=None,
        help="each prompt token's logprob (from the final loop) and this many top "
        "alternatives (with --json; default: none)",
    )
    group.add_argument(
        "--min-loops", type=int, default=None, help="fewest loops a token runs (default: 1)"
    )
    group.add_argument(
        "--max-loops",
        type=int,
        default=None,
        help="most loops a token runs (default: the model's depth)",
    )
    group.add_argument(
        "--exit-threshold",
        type=float,
        default=None,
        help="exit once the exit CDF reaches it; 1 = fixed depth (default: the model's)",
    )


def sampling_params_from(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens,
        min_tokens=ns.min_tokens,
        temperature=ns.temperature,
        top_k=ns.top_k,
        top_p=ns.top_p,
        min_p=ns.min_p,
        seed=ns.sampling_seed,
        stop=ns.stop,
        include_stop_str_in_output=ns.include_stop_str_in_output,
        ignore_eos=ns.ignore_eos,
        logprobs=ns.logprobs,
        prompt_logprobs=ns.prompt_logprobs,
        repetition_penalty=ns.repetition_penalty,
        frequency_penalty=ns.frequency_penalty,
        presence_penalty=ns.presence_penalty,
        allowed_token_ids=ns.allowed_token_ids,
        bad_words=ns.bad_words,
        min_loops=ns.min_loops,
        max_loops=ns.max_loops,
        exit_threshold=ns.exit_threshold,
        priority=ns.priority,
    )
