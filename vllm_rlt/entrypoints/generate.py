"""`vllm-rlt generate`: prompts from flags or stdin, one line (or JSON object) per prompt."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from vllm_rlt.entrypoints.args import engine_config_or_exit
from vllm_rlt.entrypoints.sampling_args import sampling_params_from


def warn_untrained_prompts(model: str | None, prompts: list[str]) -> None:
    """The built-in models only know their training tasks: say so when a prompt is not one."""
    from vllm_rlt.models.load import BUILT_IN_MODELS, DEFAULT_MODEL_NAME
    from vllm_rlt.training.data import PROMPT_FORMATS, task_of

    if model is not None and model not in BUILT_IN_MODELS:
        return
    outside = [prompt for prompt in prompts if task_of(prompt) is None]
    if outside:
        formats = "; ".join(text for _, text in PROMPT_FORMATS.values())
        example = _shortened(outside[0])
        print(
            f"warning: {len(outside)} prompt(s), such as {example}, are not of a kind "
            f"{model or DEFAULT_MODEL_NAME} was trained on ({formats}); expect wrong answers",
            file=sys.stderr,
        )


def _shortened(prompt: str, limit: int = 60) -> str:
    """A prompt quoted for a message, cut after `limit` characters."""
    return repr(prompt) if len(prompt) <= limit else f"{prompt[:limit]!r}... ({len(prompt)} chars)"


def run_generate(parser: argparse.ArgumentParser, ns: argparse.Namespace) -> int:
    from vllm_rlt.engine.request_checks import check_priority

    try:
        params = sampling_params_from(ns)
        check_priority(params.priority, ns.scheduling_policy)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        prompts = ns.prompt or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    except UnicodeDecodeError as exc:
        parser.error(f"stdin is not valid UTF-8 text: {exc.reason} at byte {exc.start}")
    if not prompts:
        parser.error("no prompt: pass --prompt TEXT or pipe prompts on stdin, one per line")
    for number, prompt in enumerate(prompts, 1):
        try:  # bytes that are not UTF-8 reach Python's argv and stdin as lone surrogates
            prompt.encode("utf-8")
        except UnicodeEncodeError as exc:
            source = "--prompt" if ns.prompt else "stdin"
            parser.error(
                f"{source}: prompt {number} is not valid UTF-8 text (at character {exc.start})"
            )
    # after the cheap checks: a hub ID may download gigabytes here
    engine_config = engine_config_or_exit(parser, ns)
    from vllm_rlt.engine.llm import LLM

    try:
        llm = LLM.from_engine_config(engine_config)
        params = sampling_params_from(ns, llm.llm_engine.processor.sampling_defaults)
        params.resolved_loops(llm.engine.num_loops)
        warn_untrained_prompts(ns.model, prompts)
        outputs = llm.generate(prompts, params, use_tqdm=not ns.no_progress and not ns.json)
    except (ValueError, FileNotFoundError) as exc:
        parser.error(str(exc))
    for prompt, output in zip(prompts, outputs, strict=True):
        completion = output.outputs[0]
        if ns.json:
            record = {
                "prompt": prompt,
                "text": completion.text,
                "token_ids": completion.token_ids,
                "exit_depths": completion.exit_depths,
                "finish_reason": completion.finish_reason,
            }
            if params.logprobs is not None:
                record["logprobs"] = _as_json(completion.logprobs)
            if params.prompt_logprobs is not None:
                record["prompt_token_ids"] = output.prompt_token_ids
                record["prompt_logprobs"] = _as_json(output.prompt_logprobs)
            print(json.dumps(record, ensure_ascii=False))
        else:
            print(f"{prompt}{completion.text}")
    if ns.speculative_tokens is not None:
        report_speculation(llm.stats(), ns.json)
    return 0


def _as_json(entries: list | None) -> list | None:
    """Logprob entries as JSON: per position None or {token id: Logprob's fields}."""
    if entries is None:
        return None
    return [
        None if entry is None else {t: dataclasses.asdict(v) for t, v in entry.items()}
        for entry in entries
    ]


def report_speculation(stats: dict[str, Any], as_json: bool) -> None:
    """Speculation's worth is its acceptance: a final JSON line with --json (so the records
    above stay one per prompt), else one line on stderr beside the text."""
    drafted, accepted = stats["spec_num_draft_tokens"], stats["spec_num_accepted_tokens"]
    figures = {
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance_rate": stats["spec_acceptance_rate"],
        "accepted_per_position": stats["spec_accepted_per_position"],
    }
    if as_json:
        print(json.dumps({"speculation": figures}))
    else:
        print(
            f"speculation: {accepted} of {drafted} draft tokens accepted "
            f"({figures['acceptance_rate']:.1%}); accepted by distance ahead: "
            f"{figures['accepted_per_position']}",
            file=sys.stderr,
        )
