"""Hugging Face hub IDs as model arguments: `ByteDance/Ouro-1.4B` becomes a local folder in
the hub's cache (downloaded once, only the files a checkpoint needs, with a progress bar),
as vLLM resolves them. `HF_HOME`, `HF_HUB_OFFLINE` and `download_dir` are honoured."""

from __future__ import annotations

import os
import re
from pathlib import Path

from vllm_rlt.config import ParamError

HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What a checkpoint folder needs: its config, weights, tokenizer, chat template and
# generation defaults (no other formats, no READMEs or images).
CHECKPOINT_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "*.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "*.jinja",
]
TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.json",
    "generation_config.json",
    "*.jinja",
]


def is_hub_id(model: str) -> bool:
    """A string that names no local path and has the hub's `owner/name` form."""
    return bool(HUB_ID.fullmatch(model)) and not Path(model).exists()


def offline() -> bool:
    """HF_HUB_OFFLINE as the hub's client reads it, looked up at the call."""
    return os.environ.get("HF_HUB_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}


def resolve_model(
    model: str | None,
    revision: str | None = None,
    download_dir: str | None = None,
    files: list[str] = CHECKPOINT_FILES,
) -> str | None:
    """The local folder of a hub ID (its `files` fetched into the cache unless they are
    there already); any other model argument unchanged. FileNotFoundError says why a hub ID
    cannot be had."""
    if model is None or not is_hub_id(str(model)):
        if revision is not None:
            raise ParamError(
                f"revision applies to Hugging Face hub IDs (owner/name); {model!r} is not one",
                "revision",
            )
        return model
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(
            str(model),
            revision=revision,
            cache_dir=download_dir,
            allow_patterns=files,
            local_files_only=offline(),
        )
    except LocalEntryNotFoundError as exc:
        where = download_dir or "the hub cache (HF_HOME)"
        reason = "HF_HUB_OFFLINE is set" if offline() else "the hub cannot be reached"
        raise FileNotFoundError(
            f"model {model!r} is neither a local folder nor in {where}, and {reason}"
        ) from exc
    except HFValidationError as exc:
        raise ParamError(f"model {model!r}: {exc}", "model") from exc
    except OSError as exc:  # the hub answered: no such repository or revision, no access
        raise FileNotFoundError(f"model {model!r} could not be fetched: {exc}") from exc
