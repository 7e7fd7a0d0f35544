"""Fixtures the Huginn test files share: one tiny checkpoint and its oracle per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.reference.huginn_checkpoint import TINY_HUGINN_SEED, write_tiny_huginn
from tests.reference.huginn_oracle import HuginnModel


@pytest.fixture(scope="session")
def huginn_folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("huginn")
    write_tiny_huginn(path, seed=TINY_HUGINN_SEED)
    return path


@pytest.fixture(scope="session")
def huginn_oracle(huginn_folder) -> HuginnModel:
    return HuginnModel.from_folder(huginn_folder)
