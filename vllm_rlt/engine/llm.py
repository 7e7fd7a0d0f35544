"""LLM: the offline API — generate and chat over a list of prompts."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import msgspec
import torch
from tqdm import tqdm

from vllm_rlt.beam_search import BeamSearchOutput, BeamSearchParams
from vllm_rlt.config import (
    CacheConfig,
    ExecutionConfig,
    ExitConfig,
    SchedulerConfig,
    SpeculativeConfig,
    require,
    require_int,
)
from vllm_rlt.engine.beam_search import beam_limits, beam_search
from vllm_rlt.engine.builder import build_engine
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.engine.llm_engine import LLMEngine
from vllm_rlt.engine.weight_sync import DEFAULT_GROUP_NAME
from vllm_rlt.engine_config import EngineConfig
from vllm_rlt.inputs import prompt_parts
from vllm_rlt.models.load import model_sampling_defaults
from vllm_rlt.outputs import RequestOutput
from vllm_rlt.sampling_params import RequestOutputKind, SamplingParams
from vllm_rlt.tokenizer.hf_compat import user_tokenizer


class LLM:
    """Load a looped model and generate from it offline.

    `model=None` (or "ouro-tasks") is the built-in tiny Ouro trained on checkable tasks, e.g.
    "347+589=" -> "936"; "toy" is a random-weight toy for tests; otherwise a Hugging Face
    checkpoint folder, or a hub ID (`owner/name`, fetched into the hub's cache at `revision`,
    under `download_dir` if given; HF_HOME and HF_HUB_OFFLINE are honoured).

    `tensor_parallel_size` N > 1 splits the model over N processes (this one is rank 0;
    on CUDA rank r runs on cuda:r), each with 1/N of every layer's heads and MLP features.

    Scheduler fields left unset are sized to the device for `usage_context`: "offline" (a
    batch handed to `generate`) or "serve" (requests arriving over time, as the server runs
    it).

    vLLM's names work as in vLLM: `tokenizer` (a folder with tokenizer.json),
    `skip_tokenizer_init` (no tokenizer: token-id prompts, outputs without text),
    `max_model_len` (caps prompt + output below the model's context), `generation_config`
    ("auto": the model's generation_config.json supplies unset sampling fields; "vllm":
    the engine's defaults; or a folder), `seed`, `enforce_eager`, `gpu_memory_utilization`,
    `kv_cache_memory_bytes`, `enable_prefix_caching`, `block_size`, `kv_cache_dtype`
    ("auto", "fp8", "fp8_e4m3", "fp8_e5m2"), `max_num_seqs`,
    `max_num_batched_tokens`, `scheduling_policy`, `enable_sleep_mode` (then `sleep` and
    `wake_up` give the device memory back and take it again), `quantization` ("fp8": the
    layer projections in float8 with a scale per output channel, quantized at load);
    `trust_remote_code` is
    accepted and changes nothing, since this engine never runs code shipped with a
    checkpoint. They take
    precedence over the same fields of the config objects. Any other vLLM argument is a
    ValueError naming it.

    A sampling default in that generation_config.json that no request could send (a
    temperature of -1, NaN) is a ValueError naming the file and the field; with
    `generation_config_ignore_invalid` the field is left unset instead, with a warning.

    An argument left None takes the default of its field of the engine's configuration
    (`self.config`, an `EngineConfig`: vllm_rlt/engine_config.py).
    """

    def __init__(
        self,
        model: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        cache_config: CacheConfig | None = None,
        scheduler_config: SchedulerConfig | None = None,
        exit_config: ExitConfig | None = None,
        execution_config: ExecutionConfig | None = None,
        attention_backend: str | None = None,
        speculative_config: SpeculativeConfig | None = None,
        tensor_parallel_size: int | None = None,
        usage_context: str | None = None,
        *,
        tokenizer: str | None = None,
        revision: str | None = None,
        download_dir: str | None = None,
        skip_tokenizer_init: bool | None = None,
        max_model_len: int | None = None,
        generation_config: str | None = None,
        generation_config_ignore_invalid: bool | None = None,
        enable_sleep_mode: bool = False,
        quantization: str | None = None,
        **vllm_args: Any,
    ) -> None:
        engine_args = EngineArgs(
            model=model,
            revision=revision,
            download_dir=download_dir,
            tokenizer=tokenizer,
            skip_tokenizer_init=skip_tokenizer_init,
            dtype=dtype,
            quantization=quantization,
            max_model_len=max_model_len,
            generation_config=generation_config,
            generation_config_ignore_invalid=generation_config_ignore_invalid,
            device=device,
            attention_backend=attention_backend,
            tensor_parallel_size=tensor_parallel_size,
            usage_context=usage_context,
            cache_config=cache_config,
            scheduler_config=scheduler_config,
            exit_config=exit_config,
            execution_config=execution_config,
            speculative_config=speculative_config,
            vllm_args=vllm_args,
        )
        asked = None if model is None else os.fspath(model)  # a path object as its text
        self._start(engine_args.create_engine_config(), asked, enable_sleep_mode)

    @classmethod
    def from_engine_config(cls, config: EngineConfig, enable_sleep_mode: bool = False) -> LLM:
        """The engine of a config made already (the command line's, entrypoints/args.py)."""
        llm = cls.__new__(cls)
        llm._start(config, config.model_config.model, enable_sleep_mode)
        return llm

    def _start(self, config: EngineConfig, asked: str | None, enable_sleep_mode: bool) -> None:
        """Build the engine of `config`; `asked` is the model as the caller named it (a hub
        ID keeps that name)."""
        model_config = config.model_config
        sampling_defaults = model_sampling_defaults(
            model_config.model,
            model_config.generation_config,
            strict=not model_config.generation_config_ignore_invalid,
        )
        built = build_engine(config)
        self.config = config
        self.engine = built.engine
        self.tokenizer = built.tokenizer
        self._user_tokenizer: Any = None  # get_tokenizer's, made on first use
        self.llm_engine = LLMEngine(built.engine, built.tokenizer, sampling_defaults)
        self.model_name = asked if model_config.model != asked else built.model_name
        self.enable_sleep_mode = enable_sleep_mode
        self.tensor_parallel = built.tensor_parallel
        self._counter = 0

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """vLLM's hook for RL trainers: new weights as (checkpoint name, tensor) pairs, copied
        into the running model in place; the next `generate` uses them. A wrong name or
        shape is a ValueError naming it, with nothing changed; the prefix cache is reset."""
        self.engine.load_weights(weights)

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = DEFAULT_GROUP_NAME,
        backend: str | None = None,
    ) -> None:
        """SGLang's call: join the trainer's torch.distributed group as rank `rank_offset`
        (the trainer, rank 0, serves its store); `backend` "gloo" or "nccl" (None: NCCL on
        CUDA, gloo on the CPU). Blocks until every rank joined (engine/weight_sync.py)."""
        self.engine.weight_sync.init_group(
            master_address, master_port, rank_offset, world_size, group_name, backend
        )

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        weight_version: str | None = None,
    ) -> None:
        """Take the tensors the trainer broadcasts over that group, in this order, into the
        model in place; later outputs carry `weight_version`. A wrong name, dtype or shape
        is a ValueError with nothing changed (the tensors are still received)."""
        self.engine.weight_sync.update_from_distributed(names, dtypes, shapes, weight_version)

    def update_weights_from_disk(self, model_path: str, weight_version: str | None = None) -> None:
        """Copy a checkpoint folder's weights (same names and shapes) into the model."""
        self.engine.weight_sync.update_from_disk(model_path, weight_version)

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (needs `enable_sleep_mode=True`): level 1 frees the KV cache
        and moves the weights to host memory; level 2 frees both, and `load_weights` must
        bring new ones after `wake_up`. The engine must be idle; while it sleeps, this is a
        no-op (as `wake_up` is when it is awake)."""
        require(self.enable_sleep_mode, "sleep needs LLM(..., enable_sleep_mode=True)", "level")
        self.engine.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Take the device memory back after `sleep`: everything, or as vLLM's RL users do
        in two steps, `tags=["weights"]` (then `load_weights`) and `tags=["kv_cache"]`.
        Requests are refused until both are back; the prefix cache starts empty."""
        self.engine.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine.is_sleeping

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt blocks (as after new weights); False while requests run."""
        return self.engine.reset_prefix_cache()

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use without sampling params: the engine's defaults,
        overridden by the model's generation_config.json (as vLLM does)."""
        return self.llm_engine.processor.default_params()

    def get_tokenizer(self) -> Any:
        """The model's tokenizer as vLLM gives it: transformers' `PreTrainedTokenizerFast`
        where transformers is installed, else the subset of it that vLLM scripts use
        (tokenizer/hf_compat.py); both encode and decode as the engine does (ValueError for
        a folder without tokenizer.json)."""
        require(self.tokenizer is not None, "this model folder has no tokenizer.json")
        if self._user_tokenizer is None:
            self._user_tokenizer = user_tokenizer(self.tokenizer)  # type: ignore[arg-type]
        return self._user_tokenizer

    def stats(self) -> dict[str, Any]:
        """The engine's counters since it was built (`EngineStats`: requests running and
        waiting, passes and rows, preemptions, KV blocks, prefix-cache lookups, drafts), the
        blocks in the prefix cache, and the prefix-cache hit and draft acceptance rates."""
        stats = msgspec.structs.asdict(self.engine.stats())
        queries, drafted = stats["prefix_cache_queries"], stats["spec_num_draft_tokens"]
        return {
            **stats,
            "num_cached_blocks": self.engine.kv.num_cached_blocks,
            "prefix_cache_hit_rate": stats["prefix_cache_hits"] / queries if queries else 0.0,
            "spec_acceptance_rate": stats["spec_num_accepted_tokens"] / drafted if drafted else 0.0,
        }

    def generate(
        self,
        prompts: Any,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        request_ids: Sequence[str] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order.

        `use_tqdm` shows a progress bar on stderr when there is more than one prompt (a single
        prompt, even with n > 1, gets none). A callable instead of True makes that bar: it is
        called with `total` and `disable`, e.g. `functools.partial(tqdm, desc="depth 1")`.
        """
        items = self._normalize_prompts(prompts)
        params = self._normalize_params(sampling_params, len(items))
        if request_ids is None:
            request_ids = [str(self._counter + i) for i in range(len(items))]
            self._counter += len(items)
        require(
            len(request_ids) == len(items),
            f"request_ids has {len(request_ids)} entries for {len(items)} prompts",
        )
        encoded = [
            (text, self._encode(text, ids, getattr(param, "truncate_prompt_tokens", None)))
            for (text, ids), param in zip(items, params, strict=True)
        ]
        added: list[str] = []
        try:
            for request_id, (text, ids), param in zip(request_ids, encoded, params, strict=True):
                final = dataclasses.replace(param, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(str(request_id), ids, final, prompt=text)
                added.append(str(request_id))
        except Exception:
            for request_id in added:
                self.llm_engine.abort_request(request_id)
            raise
        return self._run(added, use_tqdm)

    def beam_search(
        self,
        prompts: Any,
        params: BeamSearchParams,
        lora_request: Any = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (engine/beam_search.py): for each prompt (the forms `generate`
        takes), the best `params.beam_width` sequences, best first; each holds the prompt's
        and the new ids in `tokens` and the whole text in `text`. A bar over the tokens shows
        with `use_tqdm`; `concurrency_limit` prompts are searched at a time."""
        require(lora_request is None, "lora_request is not supported (no LoRA)", "lora_request")
        require(
            isinstance(params, BeamSearchParams),
            f"params must be a BeamSearchParams, got {type(params).__name__}",
            "params",
        )
        if concurrency_limit is not None:
            require_int(concurrency_limit, "concurrency_limit", 1)
        prompts = [self._encode(text, ids, None) for text, ids in self._normalize_prompts(prompts)]
        step = partial(self.generate, use_tqdm=False)
        limits = beam_limits(self.llm_engine.processor)
        return beam_search(prompts, params, step, limits, bool(use_tqdm), concurrency_limit)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] = True,
        lora_request: Any = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template (or `chat_template`),
        then generate. As in vLLM, `tools` and `chat_template_kwargs` reach the template as
        variables, the latter overriding the arguments of the same names;
        `continue_final_message` leaves the last message open for the model to go on with.
        Message content is rendered as a string (text parts joined by newlines: vLLM's
        "string" format); `lora_request` and `mm_processor_kwargs` are not supported."""
        require(lora_request is None, "lora_request is not supported (no LoRA)", "lora_request")
        require(
            mm_processor_kwargs is None,
            "mm_processor_kwargs is not supported: the models are text-only",
            "mm_processor_kwargs",
        )
        require(
            chat_template_content_format in ("auto", "string"),
            "chat_template_content_format must be 'auto' or 'string' (content is rendered as "
            f"a string), got {chat_template_content_format!r}",
            "chat_template_content_format",
        )
        require(
            chat_template_kwargs is None or isinstance(chat_template_kwargs, dict),
            "chat_template_kwargs must be a dict of template variables",
            "chat_template_kwargs",
        )
        options = {
            "chat_template": chat_template,
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "tools": tools,
            **(chat_template_kwargs or {}),
        }
        require(self.tokenizer is not None, "chat needs a tokenizer; this model folder has none")
        require(isinstance(messages, list) and messages, "messages must be a non-empty list")
        conversations = messages if isinstance(messages[0], list) else [messages]
        prompts = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(conversation, **options)  # type: ignore[union-attr]
            # The template already places any BOS, so no special tokens are added again.
            ids = self.tokenizer.encode(text, add_special_tokens=False)  # type: ignore[union-attr]
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(
        self, request_ids: list[str], use_tqdm: bool | Callable[..., tqdm]
    ) -> list[RequestOutput]:
        results: dict[str, RequestOutput] = {}
        wanted = set(request_ids)
        show = bool(use_tqdm) and len(request_ids) > 1
        if callable(use_tqdm):  # the caller's own bar: its description, its stream
            bar = use_tqdm(total=len(request_ids), disable=not show)
        else:
            bar = tqdm(total=len(request_ids), disable=not show, desc="Generating", file=sys.stderr)
        with bar:
            try:
                while len(results) < len(request_ids):
                    for output in self.llm_engine.step():
                        if output.error is not None:
                            raise RuntimeError(
                                f"request {output.request_id!r} failed: {output.error}"
                            )
                        if output.finished and output.request_id in wanted:
                            output.weight_version = self.engine.weight_sync.version
                            results[output.request_id] = output
                            bar.update(1)
            except BaseException:  # leave the engine idle and every block free
                for request_id in wanted - results.keys():
                    self.llm_engine.abort_request(request_id)
                raise
        return [results[request_id] for request_id in request_ids]

    def _encode(self, text: str | None, ids: list[int] | None, keep: int | None) -> list[int]:
        if ids is not None:
            return ids
        return self.llm_engine.processor.encode(text, truncate_prompt_tokens=keep)  # type: ignore[arg-type]

    @staticmethod
    def _normalize_prompts(prompts: Any) -> list[tuple[str | None, list[int] | None]]:
        """Accept a string, strings, token ids, lists of token ids, or prompt_token_ids dicts."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        require(
            isinstance(prompts, (list, tuple)) and len(prompts) > 0,
            "prompts must be a string, a list of strings, token ids, or "
            "{'prompt_token_ids': [...]} items",
        )
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompts):
            return [(None, list(prompts))]
        return [prompt_parts(prompt, index) for index, prompt in enumerate(prompts)]

    def _normalize_params(
        self, params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if params is None:
            params = self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            return [params] * count
        require(
            isinstance(params, Sequence) and not isinstance(params, (str, bytes)),
            "sampling_params must be a SamplingParams or a list of them, one per prompt, got "
            f"{type(params).__name__}",
            "sampling_params",
        )
        params = list(params)
        require(
            len(params) == count,
            f"sampling_params has {len(params)} entries for {count} prompts",
            "sampling_params",
        )
        for index, one in enumerate(params):
            require(
                isinstance(one, SamplingParams),
                f"sampling_params must hold SamplingParams only; entry {index} is a "
                f"{type(one).__name__}",
                "sampling_params",
            )
        return params
