"""The engine's one config: frozen, picklable (it crosses to the engine-core process and
the tensor-parallel ranks), checked when made with errors that name the field, and made
alike from the command line's flags and from `LLM`'s keyword arguments."""

from __future__ import annotations

import argparse
import dataclasses
import pickle

import pytest

from vllm_rlt.config import (
    SERVE,
    CacheConfig,
    ExitConfig,
    ParamError,
    SchedulerConfig,
    SpeculativeConfig,
)
from vllm_rlt.engine.engine_args import EngineArgs
from vllm_rlt.engine.llm import LLM
from vllm_rlt.engine_config import DeviceConfig, EngineConfig, ModelConfig, ParallelConfig
from vllm_rlt.entrypoints.args import add_engine_args, engine_args_from


def _flags(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return parser.parse_args(list(argv))


def _every_part() -> EngineConfig:
    return EngineConfig(
        model_config=ModelConfig(model="toy", dtype="float32", max_model_len=64),
        device_config=DeviceConfig(device="cuda:1", attention_backend="torch"),
        parallel_config=ParallelConfig(tensor_parallel_size=2, disaggregate=(1, 2)),
        cache_config=CacheConfig(layout="shared_decode", num_blocks=64),
        scheduler_config=SchedulerConfig(max_num_seqs=4, scheduling_policy="priority"),
        exit_config=ExitConfig(mode="trace", depths_by_request={"a": [4, 2, 3]}),
        speculative_config=SpeculativeConfig(num_speculative_tokens="auto"),
        usage_context=SERVE,
    )


def test_the_config_pickles_to_an_equal_one_and_is_frozen():
    config = _every_part()
    again = pickle.loads(pickle.dumps(config))
    assert again == config
    assert again.exit_config.depths_by_request["a"] == (4, 2, 3)
    assert again.parallel_config.engine_cores == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.usage_context = "offline"  # type: ignore[misc]
    for part in (config.model_config, config.device_config, config.parallel_config):
        with pytest.raises(dataclasses.FrozenInstanceError):
            part.__setattr__(dataclasses.fields(part)[0].name, None)


@pytest.mark.parametrize(
    ("make", "param", "message"),
    [
        (
            lambda: ModelConfig(max_model_len="64"),
            "max_model_len",
            r"max_model_len must be an integer in \[1, the model's context\], got '64'",
        ),
        (lambda: ModelConfig(quantization="int4"), "quantization", "one of fp8 or None"),
        (lambda: DeviceConfig(device="tpu"), "device", "device must be 'cpu' or 'cuda"),
        (
            lambda: ParallelConfig(tensor_parallel_size=0),
            "tensor_parallel_size",
            r"tensor_parallel_size must be in \[1, 64\], got 0",
        ),
        (
            lambda: ParallelConfig(data_parallel_size=65),
            "data_parallel_size",
            r"data_parallel_size must be in \[1, 64\], got 65",
        ),
        (lambda: ParallelConfig(disaggregate=(0, 1)), "disaggregate", r"in \[1, 64\], got 0"),
        (lambda: EngineConfig(cache_config={}), "cache_config", "must be a CacheConfig"),
        (lambda: EngineConfig(usage_context="batch"), "usage_context", "one of offline, serve"),
    ],
)
def test_a_bad_value_names_its_field_and_range(make, param, message):
    with pytest.raises(ParamError, match=message) as raised:
        make()
    assert raised.value.param == param


def test_flag_defaults_are_the_configs_defaults():
    assert engine_args_from(_flags()).create_engine_config() == EngineConfig()
    assert EngineArgs().create_engine_config() == EngineConfig()


def test_flags_and_llm_arguments_give_equal_configs():
    flags = _flags(
        "--model", "toy", "--dtype", "float32", "--max-model-len", "64", "--block-size", "8",
        "--max-num-seqs", "4", "--seed", "3", "--enforce-eager", "--prefill-chunk-size", "8",
        "--exit-mode", "ouro_delayed", "--speculative-tokens", "2",
    )  # fmt: skip
    from_flags = engine_args_from(flags).create_engine_config()
    llm = LLM(
        model="toy",
        dtype="float32",
        max_model_len=64,
        block_size=8,
        max_num_seqs=4,
        seed=3,
        enforce_eager=True,
        scheduler_config=SchedulerConfig(prefill_chunk_size=8),
        exit_config=ExitConfig(mode="ouro_delayed"),
        speculative_config=SpeculativeConfig(num_speculative_tokens=2),
    )
    assert llm.config == from_flags
    assert llm.config.cache_config.block_size == 8  # vLLM's name over the config's field
    assert llm.config.execution_config.cuda_graphs is False


def test_engine_args_take_their_own_fields_from_vllm_args_too():
    """vLLM code puts every name in one mapping: `max_model_len` there is the field; given
    both ways with different values it is an error naming it."""
    config = EngineArgs(vllm_args={"max_model_len": 96, "seed": 3}).create_engine_config()
    assert config.model_config.max_model_len == 96 and config.execution_config.seed == 3
    same = EngineArgs(max_model_len=96, vllm_args={"max_model_len": 96}).create_engine_config()
    assert same.model_config.max_model_len == 96
    with pytest.raises(ParamError, match="max_model_len is given twice") as error:
        EngineArgs(max_model_len=64, vllm_args={"max_model_len": 96}).create_engine_config()
    assert error.value.param == "max_model_len"
