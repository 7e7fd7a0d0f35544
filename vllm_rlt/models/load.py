"""Resolve a model argument (None, a built-in name, or a folder) to a model and its tokenizer.

Built-in: "ouro-tasks" (the default), a tiny Ouro trained on checkable arithmetic and list
tasks (vllm_rlt/training), and "huginn-tasks", a tiny prelude / recurrent block / coda model
trained on the same tasks, both shipped inside the package; "toy", seeded random weights of a
smaller shape, for tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from vllm_rlt.config import ParamError
from vllm_rlt.models.fp8_checkpoint import is_fp8_checkpoint
from vllm_rlt.models.generation_defaults import sampling_defaults
from vllm_rlt.models.interface import LoopedModel
from vllm_rlt.models.loader import check_fits, load_model, read_config
from vllm_rlt.models.ouro import OuroConfig, OuroModel
from vllm_rlt.models.toy import TOY_NAME, toy_config_dict, toy_weights
from vllm_rlt.tokenizer import Tokenizer
from vllm_rlt.tokenizer.tokenizer import (
    GENERATION_CONFIG_FILE,
    generation_eos_ids,
    read_json_object,
)

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL_NAME = "ouro-tasks"
DEFAULT_MODEL_DIR = ASSETS_DIR / DEFAULT_MODEL_NAME
BUILT_IN_MODELS = (DEFAULT_MODEL_NAME, "huginn-tasks")

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,  # vLLM's aliases
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}") from exc
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {device!r}")
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def model_folder(model: str | Path | None) -> Path:
    """The checkpoint folder a (non-toy) model argument names; None is the default built-in
    model, and a built-in name its packaged folder."""
    if model is None:
        return DEFAULT_MODEL_DIR
    if str(model) in BUILT_IN_MODELS:
        return ASSETS_DIR / str(model)
    return Path(model)


def check_model_source(
    model: str | Path | None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = "auto",
    generation_config: str | None = "auto",
    generation_config_ignore_invalid: bool = False,
) -> None:
    """Fail fast (ValueError or FileNotFoundError), before anything loads, on a model that
    cannot: a missing folder; one without a config.json of a known family; a config.json
    or generation_config.json value of the wrong type or out of range (a token id outside
    the vocabulary, a sampling default no request could send unless
    `generation_config_ignore_invalid`); on the CPU, a model too large for its memory.
    Weights are checked when they load, and whether they fit a GPU there."""
    if str(model) != TOY_NAME:
        folder = model_folder(model)
        if not folder.is_dir():
            raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
        raw, config = read_config(folder)
        model_eos_token_ids(model, config.vocab_size)
        if str(device) == "cpu":  # a GPU may be on another host: its core checks there
            cpu = torch.device("cpu")
            check_fits(config, resolve_dtype(dtype, cpu), cpu, is_fp8_checkpoint(raw))
    if not generation_config_ignore_invalid:
        model_sampling_defaults(model, generation_config, strict=True)


def model_sampling_defaults(
    model: str | Path | None, generation_config: str | None = "auto", strict: bool = False
) -> dict[str, Any]:
    """The sampling defaults requests take where they leave a field unset, as vLLM's
    `generation_config` says: "auto", the model folder's generation_config.json (none for
    the toy); "vllm", none (the engine's own defaults); else a folder holding one. A value
    no request could send is a ValueError with `strict`, else left unset with a warning."""
    if generation_config is None:  # older vLLM's default: the engine's own
        generation_config = "vllm"
    if generation_config == "vllm" or (generation_config == "auto" and str(model) == TOY_NAME):
        return {}
    folder = model_folder(model) if generation_config == "auto" else Path(generation_config)
    if generation_config != "auto" and not (folder / "generation_config.json").is_file():
        raise ParamError(
            "generation_config must be auto, vllm or a folder with a generation_config.json, "
            f"got {generation_config!r}",
            "generation_config",
        )
    return sampling_defaults(folder, strict)


def model_eos_token_ids(model: str | Path | None, vocab_size: int) -> frozenset[int]:
    """The EOS ids the model's generation_config.json adds (vLLM stops on them whether or
    not a tokenizer is loaded); an id outside the model's vocabulary is a ValueError."""
    if str(model) == TOY_NAME:
        return frozenset()
    path = model_folder(model) / GENERATION_CONFIG_FILE
    ids = generation_eos_ids(read_json_object(path).get("eos_token_id"))
    outside = [token_id for token_id in ids if not 0 <= token_id < vocab_size]
    if outside:
        raise ValueError(
            f"{path}: eos_token_id {outside[0]} is outside the vocabulary [0, {vocab_size})"
        )
    return frozenset(ids)


def load_tokenizer(
    model: str | Path | None, tokenizer: str | Path | None = None, skip: bool = False
) -> Tokenizer | None:
    """The tokenizer of `tokenizer` (a folder) or else of the model; None for a folder
    without tokenizer.json, or with `skip` (vLLM's skip_tokenizer_init: token ids only)."""
    if skip:
        return None
    if tokenizer is None and str(model) == TOY_NAME:
        return Tokenizer.byte_level()
    folder = model_folder(model) if tokenizer is None else Path(tokenizer)
    if (folder / "tokenizer.json").is_file():
        return Tokenizer.from_pretrained(folder)
    if tokenizer is not None:
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} has no tokenizer.json")
    return None


def load_model_and_tokenizer(
    model: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    tokenizer: str | Path | None = None,
    skip_tokenizer_init: bool = False,
) -> tuple[LoopedModel, Tokenizer | None, str]:
    """(model, tokenizer or None, display name); None is the trained built-in model."""
    loaded_tokenizer = load_tokenizer(model, tokenizer, skip_tokenizer_init)
    if str(model) == TOY_NAME:
        config = OuroConfig.from_dict(toy_config_dict())
        return OuroModel(config, toy_weights(), dtype, device), loaded_tokenizer, TOY_NAME
    loaded = load_model(model_folder(model), dtype, device)
    return loaded, loaded_tokenizer, DEFAULT_MODEL_NAME if model is None else str(model)
