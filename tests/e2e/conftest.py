"""Fixtures the end-to-end files share: the toy's LLM per module, checked after each test,
and one tiny Huginn checkpoint and its oracle per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reference.huginn_checkpoint import TINY_HUGINN_SEED, write_tiny_huginn
from tests.reference.huginn_oracle import HuginnModel
from vllm_rlt import LLM


@pytest.fixture(scope="module")
def shared_llm() -> LLM:
    return LLM(model="toy")


@pytest.fixture
def llm(shared_llm):
    """The module's LLM, checked after each test for leftover requests, blocks and slots."""
    yield shared_llm
    assert not shared_llm.engine.has_unfinished
    assert shared_llm.engine.all_blocks_free()


@pytest.fixture(scope="session")
def huginn_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("huginn")
    write_tiny_huginn(path, seed=TINY_HUGINN_SEED)
    return path


@pytest.fixture(scope="session")
def huginn_oracle(huginn_folder) -> HuginnModel:
    return HuginnModel.from_folder(huginn_folder)
