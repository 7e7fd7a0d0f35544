"""Sampling defaults a checkpoint ships in its generation_config.json, as vLLM reads them.

A request (or `LLM.generate` without sampling params) that leaves a field unset gets the
checkpoint's value instead of the engine's: a model published for greedy decoding answers
greedily out of the box. HF's `do_sample: false` means greedy, so it sets temperature 0.
Each value must be one a request could send itself (SamplingParams' bounds): otherwise every
request leaving the field unset would be refused for a value its client never sent.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vllm_rlt.sampling_params import SamplingParams
from vllm_rlt.tokenizer.tokenizer import GENERATION_CONFIG_FILE, read_json_object

logger = logging.getLogger(__name__)

# the generation_config.json keys vLLM takes over, named as SamplingParams names them
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
MAX_MESSAGE_CHARS = 200  # a huge value still makes one short line
IGNORE_HINT = "--generation-config-ignore-invalid starts without such a field"


def _why_invalid(key: str, value: Any) -> str | None:
    """SamplingParams' own message for a request sending `value` as `key`, or None."""
    try:
        SamplingParams(**{key: value})
    except ValueError as exc:
        message = str(exc)
        if len(message) > MAX_MESSAGE_CHARS:
            message = message[: MAX_MESSAGE_CHARS - 3] + "..."
        return message
    return None


def read_sampling_defaults(path: Path) -> tuple[dict[str, Any], list[str]]:
    """(the SamplingParams fields a generation_config.json sets validly, one message naming
    the file, field and range per field it sets invalidly); a file that is not a JSON object
    is a ValueError naming it."""
    config = read_json_object(path)
    defaults: dict[str, Any] = {}
    problems: list[str] = []
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if value is None:
            continue
        if key == "top_k" and value == -1 and not isinstance(value, bool):
            value = 0  # vLLM's spelling of "no top-k"
        problem = _why_invalid(key, value)
        if problem is not None:
            problems.append(f"{path}: {problem}")
        else:
            defaults[key] = value if key == "top_k" else float(value)
    do_sample = config.get("do_sample")
    if do_sample is not None and not isinstance(do_sample, bool):
        problems.append(f"{path}: do_sample must be true or false, got {type(do_sample).__name__}")
    elif do_sample is False:
        defaults["temperature"] = 0.0
    return defaults, problems


def sampling_defaults(folder: Path, strict: bool = False) -> dict[str, Any]:
    """SamplingParams fields the checkpoint in `folder` sets (empty without the file). A
    field set to a value no request could send is, with `strict`, a ValueError naming the
    file, the field and its range; else it is left unset, with a warning."""
    defaults, problems = read_sampling_defaults(folder / GENERATION_CONFIG_FILE)
    if problems and strict:
        raise ValueError(f"{problems[0]} ({IGNORE_HINT})")
    for problem in problems:
        logger.warning("ignoring a sampling default: %s", problem)
    return defaults
