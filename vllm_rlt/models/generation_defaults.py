"""Sampling defaults a checkpoint ships in its generation_config.json, as vLLM reads them.

A request (or `LLM.generate` without sampling params) that leaves a field unset gets the
checkpoint's value instead of the engine's: a model published for greedy decoding answers
greedily out of the box. HF's `do_sample: false` means greedy, so it sets temperature 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from vllm_rlt.tokenizer.tokenizer import GENERATION_CONFIG_FILE, read_json_object

# the generation_config.json keys vLLM takes over, named as SamplingParams names them
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(folder: Path) -> dict[str, Any]:
    """SamplingParams fields the checkpoint in `folder` sets (empty without the file)."""
    config = read_json_object(folder / GENERATION_CONFIG_FILE)
    defaults: dict[str, Any] = {}
    for key in SAMPLING_KEYS:
        value = config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            defaults[key] = int(value) if key == "top_k" else float(value)
    if config.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults
