"""`vllm-rlt generate`'s sampling flags and the `SamplingParams` they make: a flag per
bounded sampling field (FIELD_BOUNDS), plus the list and on/off fields. A flag left out
stays unset, so the model's generation_config.json fills it, as the server does."""

from __future__ import annotations

import argparse
from typing import Any

from vllm_rlt.models.generation_defaults import SAMPLING_KEYS
from vllm_rlt.sampling_params import FIELD_BOUNDS, SamplingParams

# the generate command's own defaults, where they differ from SamplingParams'
GENERATE_DEFAULTS = {"max_tokens": 32}


def _dest(name: str) -> str:
    """The namespace attribute of a bounded field's flag."""
    flag = FIELD_BOUNDS[name].flag
    return name if flag is None else flag.removeprefix("--").replace("-", "_")


def _bounded_flags(group: argparse._ArgumentGroup) -> None:
    for name, bound in FIELD_BOUNDS.items():
        if not bound.cli:
            continue
        text = bound.help
        if name in SAMPLING_KEYS:
            text += f" (default: the model's generation_config.json, else {bound.default})"
        elif "default:" not in text and name not in GENERATE_DEFAULTS:
            text += f" (default: {bound.default})"
        group.add_argument(
            bound.flag or f"--{name.replace('_', '-')}",
            dest=_dest(name),
            type=bound.kind,
            default=GENERATE_DEFAULTS.get(name),
            help=text,
        )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    _bounded_flags(group)
    group.add_argument(
        "--stop", action="append", default=None, help="stop string (repeatable; default: none)"
    )
    group.add_argument(
        "--include-stop-str-in-output",
        action="store_true",
        default=None,
        help="keep the stop string that ended the text (default: off)",
    )
    group.add_argument(
        "--ignore-eos", action="store_true", default=None, help="do not stop at EOS (default: off)"
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


_LISTS_AND_SWITCHES = (
    "stop",
    "include_stop_str_in_output",
    "ignore_eos",
    "allowed_token_ids",
    "bad_words",
)


def sampling_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """The SamplingParams fields the command line sets, by field name."""
    given = {name: getattr(ns, _dest(name)) for name, b in FIELD_BOUNDS.items() if b.cli}
    given |= {name: getattr(ns, name) for name in _LISTS_AND_SWITCHES}
    return {name: value for name, value in given.items() if value is not None}


def sampling_params_from(
    ns: argparse.Namespace, defaults: dict[str, Any] | None = None
) -> SamplingParams:
    """The flags' SamplingParams; `defaults` (the model's generation defaults) fill the
    fields no flag sets."""
    return SamplingParams(**((defaults or {}) | sampling_flags(ns)))
