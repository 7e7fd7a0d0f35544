"""Model families keyed on config.json's `model_type`."""

from __future__ import annotations

from typing import Any

from vllm_rlt.models.hf_config import shown
from vllm_rlt.models.huginn import HuginnModel
from vllm_rlt.models.huginn_config import HuginnConfig
from vllm_rlt.models.nanbeige import NanbeigeConfig, NanbeigeModel
from vllm_rlt.models.ouro import OuroConfig, OuroModel

MODEL_REGISTRY: dict[str, tuple[type, type]] = {
    "ouro": (OuroConfig, OuroModel),
    "nanbeige": (NanbeigeConfig, NanbeigeModel),
    "huginn_raven": (HuginnConfig, HuginnModel),
}


def resolve_family(raw_config: dict[str, Any]) -> tuple[type, type]:
    """(config class, model class) for a parsed config.json, or a clear error."""
    model_type = raw_config.get("model_type")
    if not isinstance(model_type, str) or model_type not in MODEL_REGISTRY:
        raise ValueError(
            f"config.json: unknown model_type {shown(model_type)}; supported: "
            f"{', '.join(sorted(MODEL_REGISTRY))}"
        )
    return MODEL_REGISTRY[model_type]
