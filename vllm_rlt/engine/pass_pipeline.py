"""Launch and collect the engine's passes, with one pass in flight under asynchronous
scheduling: the host plans and launches pass k+1 before it reads pass k's tokens."""

from __future__ import annotations

import logging

from vllm_rlt.core.contract import ModelRunnerOutput, SchedulerOutput
from vllm_rlt.core.request import Request
from vllm_rlt.core.scheduler import Scheduler
from vllm_rlt.worker.model_runner import ModelRunner, PendingPass, is_device_fault

logger = logging.getLogger(__name__)

Failed = list[tuple[Request, BaseException]]


class PassPipeline:
    """A pass that fails on the host (building its inputs, reading its results) fails the
    requests with rows in it, and the engine goes on: their slots are written anew when
    reused, and their blocks are freed after the passes already queued. A device fault
    leaves the device unusable, so it stops the engine."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, async_scheduling: bool) -> None:
        self.runner, self.scheduler = runner, scheduler
        self.async_scheduling = async_scheduling
        self.in_flight: tuple[SchedulerOutput, PendingPass] | None = None
        self.num_passes = 0
        self.num_rows_total = 0  # rows over all passes, for the rows-per-pass metric

    def advance(
        self, scheduled: SchedulerOutput | None, transfers: bool = False
    ) -> tuple[tuple[SchedulerOutput, ModelRunnerOutput] | None, Failed]:
        """Launch `scheduled` (None: nothing was scheduled) and collect the pass that is due:
        returns that pass's schedule and results (None: none due, or it failed) and the
        requests a failed pass fails. With `transfers` (a prefill core's blocks lent to decode
        cores, or a decode core's early reads, engine/disagg/handover.py) an empty pass may just
        mean waiting for them."""
        launched, failed = None, []
        if scheduled is not None:
            if not scheduled.is_empty:
                try:
                    launched = (scheduled, self.runner.launch(scheduled))
                except Exception as exc:  # noqa: BLE001 - fails this pass's requests only
                    failed += self._failed(scheduled, exc)
                else:
                    self.num_passes += 1
                    self.num_rows_total += scheduled.num_rows
            elif scheduled.block_updates:
                # Nothing runs now (with asynchronous scheduling every request may be
                # waiting on the pass in flight), but the blocks taken, such as an admitted
                # request's cached prefix, must reach its table before any later pass.
                self.runner.apply_block_updates(scheduled.block_updates)
            if scheduled.is_empty and self.in_flight is None and not transfers:
                # Admission validated every reservation against the pool, so an idle pass
                # with work queued means a scheduler invariant broke: fail, do not spin.
                raise RuntimeError("scheduler produced an empty pass while requests wait")
        if not self.async_scheduling:
            ready, self.in_flight = launched, None
        else:
            ready, self.in_flight = self.in_flight, launched
        if ready is None:
            return None, failed
        try:
            return (ready[0], self.runner.collect(ready[1])), failed
        except Exception as exc:  # noqa: BLE001 - fails this pass's requests only
            return None, failed + self._failed(ready[0], exc)

    def drain_if_idle(self) -> None:
        """With nothing left to run, the pass still in flight only holds rows of finished
        requests: wait for it so an idle engine has nothing outstanding."""
        if self.in_flight is not None and not self.scheduler.has_unfinished:
            self.runner.collect(self.in_flight[1])
            self.in_flight = None

    def _failed(self, scheduled: SchedulerOutput, error: Exception) -> Failed:
        if is_device_fault(error):
            raise error
        requests = self.scheduler.requests_in_failed_pass(scheduled)
        logger.error("a pass failed; failing its %d requests", len(requests))
        return [(request, error) for request in requests]
