"""A child process of the server (engine core, API server, tensor-parallel rank) ends
itself as soon as its parent is gone, so that killing the parent never leaves a process
holding the device or the port."""

from __future__ import annotations

import os
import threading
import time

PARENT_POLL_S = 0.5


def leave_with_parent(parent_pid: int) -> None:
    """Start a daemon thread that ends this process at once when `parent_pid` is no longer
    its parent."""
    threading.Thread(
        target=_exit_with_parent, args=(parent_pid,), name="vllm-rlt-parent-watch", daemon=True
    ).start()


def _exit_with_parent(parent_pid: int) -> None:
    while True:
        if os.getppid() != parent_pid:
            os._exit(0)
        time.sleep(PARENT_POLL_S)
