"""A process of its own settles once built: one torch host thread when it drives a GPU
(unless OMP_NUM_THREADS is set), and its start-up heap frozen out of the collector."""

from __future__ import annotations

import gc

import pytest
import torch

from vllm_rlt.engine.process_setup import drive_with_one_host_thread, freeze_startup_heap


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_gpu_process_keeps_one_host_thread(threads, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    drive_with_one_host_thread(torch.device("cpu"))  # the CPU computes with its threads
    assert torch.get_num_threads() == 2
    drive_with_one_host_thread(torch.device("cuda", 0))  # a device name: CUDA is not touched
    assert torch.get_num_threads() == 1


def test_omp_num_threads_is_the_users_choice(threads, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    drive_with_one_host_thread(torch.device("cuda", 0))
    assert torch.get_num_threads() == 2


def test_the_start_up_heap_is_frozen():
    try:
        freeze_startup_heap()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
