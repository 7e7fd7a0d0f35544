"""Hugging Face checkpoint folders: config.json plus safetensors, checked strictly."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from vllm_rlt.layers.fp8 import is_float8
from vllm_rlt.models import fp8_checkpoint
from vllm_rlt.models.interface import LoopedModel
from vllm_rlt.models.registry import resolve_family

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Non-persistent buffers some exporters still write; they carry no weights.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "freqs_cis")  # RoPE tables, recomputed


def _read_json_object(path: Path) -> dict[str, Any]:
    """A JSON object file's contents; ValueError naming the file when it holds none."""
    try:
        raw = json.loads(path.read_text())
    except RecursionError:
        raise ValueError(f"{path}: invalid JSON: nested too deeply") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of too many digits
        raise ValueError(f"{path}: invalid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return raw


def read_config(folder: Path) -> tuple[dict[str, Any], Any]:
    """Parse config.json into (raw dict, family config object)."""
    path = folder / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{folder}: no config.json (not a Hugging Face model folder)")
    raw = _read_json_object(path)
    config_class, _ = resolve_family(raw)
    # the weights' format, not the model's shape: read by load_model
    shape_keys = {key: value for key, value in raw.items() if key != "quantization_config"}
    return raw, config_class.from_dict(shape_keys)


def _weight_files(folder: Path) -> list[Path]:
    if (folder / INDEX_FILE).is_file():
        index = _read_json_object(folder / INDEX_FILE)
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{folder / INDEX_FILE}: missing or empty 'weight_map'")
        files = sorted({folder / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise FileNotFoundError(f"{folder / INDEX_FILE}: shard {file.name} is missing")
        return files
    if (folder / SINGLE_FILE).is_file():
        return [folder / SINGLE_FILE]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ValueError(
            f"{folder}: only pickle weights found; vllm-rlt loads safetensors only "
            f"({SINGLE_FILE} or {INDEX_FILE})"
        )
    raise FileNotFoundError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")


def read_weights(
    folder: Path, expected: dict[str, tuple[int, ...] | None], optional: set[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Load every tensor and check names and shapes against `expected` exactly (a shape of
    None is checked by the caller); `optional` names may be there too (checked by the
    caller)."""
    weights: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name in weights:
                    raise ValueError(f"{file.name}: tensor {name} appears in more than one shard")
                weights[name] = handle.get_tensor(name)
    missing = sorted(set(expected) - set(weights))
    if missing:
        raise ValueError(f"{folder}: checkpoint is missing tensors: {', '.join(missing[:8])}")
    unexpected = sorted(set(weights) - set(expected) - optional)
    if unexpected:
        raise ValueError(f"{folder}: unexpected tensors in checkpoint: {', '.join(unexpected[:8])}")
    for name, shape in expected.items():
        if shape is not None and tuple(weights[name].shape) != shape:
            raise ValueError(
                f"{folder}: tensor {name} has shape {tuple(weights[name].shape)}, expected {shape}"
            )
    return weights


def model_bytes(config: Any, dtype: torch.dtype, fp8: bool) -> int:
    """What the built model holds at least: every weight in `dtype` (an FP8 checkpoint's
    layer projections in one byte) and the rotary cos and sin tables. Counted from one
    layer's shapes, so a config of absurd depth costs nothing to size."""
    per_layer = "num_hidden_layers" in {f.name for f in dataclasses.fields(config)}
    if per_layer:  # a Llama-style stack, named model.layers.N.
        shapes = dataclasses.replace(config, num_hidden_layers=1).checkpoint_shapes()
    else:  # a family whose layer counts are bounded at parse (Huginn)
        shapes = config.checkpoint_shapes()
    total = 0
    for name, shape in shapes.items():
        element = 1 if fp8 and name.endswith(fp8_checkpoint.PROJECTION_WEIGHTS) else dtype.itemsize
        repeats = (
            config.num_hidden_layers if per_layer and name.startswith("model.layers.0.") else 1
        )
        total += math.prod(shape) * element * repeats
    return total + 2 * config.max_position_embeddings * config.head_dim * dtype.itemsize


def device_memory(device: torch.device) -> int:
    """Bytes the device can hold: free memory on a GPU, physical memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_fits(config: Any, dtype: torch.dtype, device: torch.device, fp8: bool) -> None:
    """A one-line ValueError, before anything is read or allocated, for a config.json whose
    shapes need more memory than the device has."""
    needed, room = model_bytes(config, dtype, fp8), device_memory(device)
    if needed > room:
        raise ValueError(
            f"config.json: a model of this shape (vocab_size={config.vocab_size}, "
            f"hidden_size={config.hidden_size}, intermediate_size={config.intermediate_size}, "
            f"num_hidden_layers={config.num_hidden_layers}, max_position_embeddings="
            f"{config.max_position_embeddings}) needs at least {needed / 2**30:.1f} GiB in "
            f"{str(dtype).removeprefix('torch.')}; {device} has {room / 2**30:.1f} GiB"
        )


def load_model(folder: str | Path, dtype: torch.dtype, device: torch.device | str) -> LoopedModel:
    """Build the registered model family from an HF folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"model folder {str(folder)!r} does not exist")
    raw, config = read_config(folder)
    _, model_class = resolve_family(raw)
    fp8 = fp8_checkpoint.is_fp8_checkpoint(raw)
    check_fits(config, dtype, torch.device(device), fp8)
    shapes = config.checkpoint_shapes()
    # tensors a family's checkpoints may carry and its model ignores (Huginn's second copy
    # of a tied head)
    optional = getattr(config, "optional_tensors", frozenset)()
    if not fp8:
        weights = read_weights(folder, shapes, optional)
        float8 = sorted(n for n, t in weights.items() if is_float8(t))
        if float8:
            raise ValueError(
                f"{folder}: tensors {float8[:4]} are float8, but config.json has no "
                "quantization_config to give their scales"
            )
        return model_class(config, weights, dtype, device)
    layers = config.num_hidden_layers
    weights = read_weights(
        folder,
        {**shapes, **fp8_checkpoint.scale_names(shapes)},
        fp8_checkpoint.optional_names(shapes, layers),
    )
    fp8_checkpoint.pop_activation_scales(weights)
    kv_scales = fp8_checkpoint.pop_kv_scales(weights, layers, config.num_key_value_heads)
    scales = fp8_checkpoint.split_scales(weights, shapes)
    model = model_class(config, weights, dtype, device)
    model.install_fp8_scales(scales, kv_scales)
    return model
