"""The server's settings check themselves: a bad value is an error naming its flag and
range, wherever the settings are made."""

from __future__ import annotations

import dataclasses
import re

import pytest

from vllm_rlt.config import ParamError
from vllm_rlt.engine.disagg.nixl_connector import NixlConnector
from vllm_rlt.engine_config import EngineConfig, ParallelConfig
from vllm_rlt.entrypoints.openai.settings import ServerSettings

BAD = [
    ({"max_queue": 0}, "--max-queue must be >= 1, got 0"),
    ({"max_body_bytes": -5}, "--max-body-bytes must be >= 1, got -5"),
    ({"max_sequences_per_request": 0}, "--max-sequences-per-request must be >= 1, got 0"),
    ({"max_logprobs_per_request": -1}, "--max-logprobs-per-request must be >= 1, got -1"),
    ({"max_header_bytes": 0}, "--max-header-bytes must be >= 1, got 0"),
    ({"max_connections": 0}, "--limit-concurrency must be >= 1, got 0"),
    ({"header_timeout": -1.0}, "--header-timeout must be >= 0 seconds, got -1.0"),
    ({"body_timeout": float("nan")}, "--body-timeout must be >= 0 seconds, got nan"),
    ({"keep_alive_timeout": -0.5}, "--timeout-keep-alive must be >= 0 seconds, got -0.5"),
    ({"request_timeout": 0.0}, "--request-timeout must be > 0 seconds, got 0.0"),
    ({"stall_timeout": float("nan")}, "--stall-timeout must be > 0 seconds, got nan"),
    ({"api_server_count": 0}, "--api-server-count must be in [1, 64], got 0"),
    ({"api_key": ""}, "--api-key must not be empty"),
    ({"api_key": "   "}, "--api-key must not be empty"),
    ({"api_key": " secret"}, "--api-key must not begin or end with whitespace"),
    ({"api_key": "secret\n"}, "--api-key must not begin or end with whitespace"),
    ({"api_key": "sec\x00ret"}, "--api-key must not hold control characters"),
    ({"allowed_origins": ("https://app.example/ui",)}, "--allowed-origins each must be"),
    ({"allowed_origins": ("app.example",)}, "--allowed-origins each must be"),
    ({"allowed_methods": ("GET", " ")}, "--allowed-methods must not hold an empty string"),
]


def test_an_api_key_error_never_shows_the_key():
    for key in ("", " hunter2", "hun\x7fter2"):
        with pytest.raises(ParamError) as caught:
            ServerSettings(api_key=key)
        assert "hunter2" not in str(caught.value) and "hun" not in str(caught.value)
    assert ServerSettings(api_key="a key with inner spaces").api_key == "a key with inner spaces"


@pytest.mark.parametrize(("fields", "message"), BAD)
def test_a_bad_setting_names_its_flag_and_range(fields, message):
    with pytest.raises(ParamError, match=message.replace("[", r"\[")) as caught:
        ServerSettings(**fields)
    flag = message.split()[0]
    assert caught.value.param == flag.removeprefix("--").replace("-", "_")


def test_settings_are_frozen_and_checked_again_when_replaced():
    settings = ServerSettings(max_queue=None, request_timeout=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.max_queue = 3  # type: ignore[misc]
    with pytest.raises(ParamError, match="--api-server-count"):
        dataclasses.replace(settings, api_server_count=100)


LAYOUTS = [
    ({"size": 0}, "--data-parallel-size must be in [1, 64], got 0"),
    ({"size": 2, "local": 3}, "--data-parallel-size-local must be in [0, 2], got 3"),
    ({"size": 2, "local": 0, "headless": True}, "--data-parallel-size-local must be in [1, 2]"),
    ({"size": 4, "local": 2, "headless": True, "start_rank": 3, "api_key": "k"}, "start-rank"),
    ({"size": 2, "local": 1, "api_server_count": 2}, "run with one API server"),
    ({"size": 2, "local": 1}, "cores on other hosts need --api-key"),
    ({"size": 2, "local": 1, "api_key": "k", "rpc_port": 80}, "data_parallel_rpc_port"),
]


@pytest.mark.parametrize(("fields", "message"), LAYOUTS)
def test_a_bad_data_parallel_layout_is_refused(fields, message):
    from vllm_rlt.entrypoints.openai.settings import DataParallelLayout

    with pytest.raises(ParamError, match=message.replace("[", r"\[")):
        DataParallelLayout(**fields)


def test_a_layout_with_remote_cores_describes_them():
    from vllm_rlt.entrypoints.openai.settings import DataParallelLayout

    assert DataParallelLayout(size=2).remote_cores() is None
    layout = DataParallelLayout(size=3, local=1, api_key="secret")
    assert layout.remote and layout.local_cores == 1
    cores = layout.remote_cores()
    assert (cores.local_size, cores.address, cores.rpc_port) == (1, "127.0.0.1", 13345)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("2", "--disaggregate must be P:D (prefill and decode cores), got '2'"),
        ("1:-1", "--disaggregate must be P:D (prefill and decode cores), got '1:-1'"),
        ("0:1", "--disaggregate needs P and D in [1, 64], got '0:1'"),
        ("1:99999999999999999999", "--disaggregate needs P and D in [1, 64]"),
    ],
)
def test_disaggregate_takes_prefill_and_decode_core_counts(value, message):
    from vllm_rlt.entrypoints.openai.settings import disaggregate_sizes

    assert disaggregate_sizes(" 2 : 3 ") == (2, 3)
    with pytest.raises(ParamError, match=re.escape(message)):
        disaggregate_sizes(value)


def _serving(**parallel) -> EngineConfig:
    return EngineConfig(parallel_config=ParallelConfig(**parallel))


@pytest.mark.parametrize(
    ("fields", "flag"),
    [
        ({"api_server_count": 2}, "api-server-count"),
        ({"enable_sleep_mode": True}, "enable-sleep-mode"),
    ],
)
def test_disaggregate_runs_alone(fields, flag):
    from vllm_rlt.entrypoints.openai.settings import DataParallelLayout

    with pytest.raises(ParamError, match=f"cannot be combined with --{flag}"):
        ServerSettings(engine_config=_serving(disaggregate=(1, 1)), **fields)
    with pytest.raises(ParamError, match="cannot be combined with data_parallel_size 2"):
        ParallelConfig(disaggregate=(1, 1), data_parallel_size=2)
    with pytest.raises(ParamError, match="cannot be combined with --headless"):
        DataParallelLayout(headless=True, disaggregate=True)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kv_connector": "torch"}, "applies to --disaggregate only"),
        ({"kv_connector": "nccl", "disaggregate": (1, 1)}, "must be one of auto, torch, nixl"),
    ],
)
def test_the_kv_connector_is_checked_at_start_up(fields, message):
    with pytest.raises(ParamError, match=message) as raised:
        ParallelConfig(**fields)
    assert raised.value.param == "kv_connector"
    assert ParallelConfig(kv_connector="torch", disaggregate=(1, 1)).kv_connector == "torch"


def test_the_nixl_connector_needs_its_package_at_start_up(monkeypatch):
    monkeypatch.setattr(
        NixlConnector, "missing", staticmethod(lambda: "the nixl package is not installed")
    )
    nixl = _serving(kv_connector="nixl", disaggregate=(1, 1))
    with pytest.raises(ParamError, match="nixl: the nixl package is not installed") as raised:
        ServerSettings(engine_config=nixl)
    assert raised.value.param == "kv_connector"
    monkeypatch.setattr(NixlConnector, "missing", staticmethod(lambda: None))
    assert ServerSettings(engine_config=nixl).engine_config == nixl


@pytest.mark.parametrize(
    ("environment", "key"),
    [
        ({"VLLM_RLT_API_KEY": "ours", "VLLM_API_KEY": "vllms"}, "ours"),
        ({"VLLM_API_KEY": "vllms"}, "vllms"),  # a vLLM deployment's key keeps guarding
        ({"VLLM_RLT_API_KEY": "", "VLLM_API_KEY": ""}, None),  # set but empty: unset
        ({}, None),
    ],
)
def test_the_api_key_comes_from_our_variable_then_vllms(monkeypatch, environment, key):
    from vllm_rlt.entrypoints.cli import build_parser

    for name in ("VLLM_RLT_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    assert build_parser().parse_args(["serve", "--model", "toy"]).api_key == key
