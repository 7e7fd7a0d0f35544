"""The stats answer of several data-parallel cores: one struct, summed field by field."""

from __future__ import annotations

import msgspec

from vllm_rlt.engine.core_outputs import CoreStats, sum_core_stats
from vllm_rlt.engine.process.messages import ControlReply, message_codec


def _core(**fields) -> CoreStats:
    base = dict(num_running=1, num_waiting=0, num_free_blocks=10, num_blocks=16, num_passes=50)
    return CoreStats(**{**base, "num_rows": 400, **fields})


def test_cores_add_up_and_flags_combine():
    busy = _core(
        has_unfinished=True,
        all_blocks_free=False,
        passes_per_second=30.0,
        rows_per_pass=8.0,
        spec_accepted_per_position=[3, 1],
    )
    idle = _core(passes_per_second=10.0, rows_per_pass=4.0, spec_accepted_per_position=[2])
    total = sum_core_stats([busy, idle])
    assert (total.num_running, total.num_free_blocks, total.num_passes) == (2, 20, 100)
    assert total.has_unfinished and not total.all_blocks_free
    assert total.passes_per_second == 40.0
    assert total.rows_per_pass == (8.0 * 30 + 4.0 * 10) / 40  # over every core's passes
    assert total.spec_accepted_per_position == [5, 1]
    assert sum_core_stats([_core()]).rows_per_pass == 0.0  # no recent passes


def test_the_stats_answer_crosses_the_wire_as_itself():
    encoder, decoder = message_codec()
    encode, decode = encoder.encode, decoder.decode
    answer = _core(num_requests=3, passes_per_second=2.5)
    assert decode(encode(ControlReply(7, answer))).value == answer
    assert decode(encode(ControlReply(8, {"stopped": True}))).value == {"stopped": True}
    assert msgspec.structs.asdict(answer)["num_requests"] == 3


def test_a_data_parallel_memory_call_answers_for_every_core():
    """Sleep-mode calls reach every core: yes only where all say yes, else each refusal
    named with its core; a sleep one core refuses leaves every core awake."""
    from vllm_rlt.engine.process.dp_client import DataParallelClient

    class Core:
        def __init__(self, busy: bool = False) -> None:
            self.busy, self.sleeping = busy, False

        def call(self, name: str, timeout: float) -> dict:
            if name.startswith("sleep_"):
                if self.busy:
                    return {"error": "busy"}
                self.sleeping = True
            elif name == "wake_up":
                self.sleeping = False
            return {"is_sleeping": self.sleeping}

    def client(*cores):
        dp = DataParallelClient.__new__(DataParallelClient)
        dp._prepare(lambda reason: None, None)
        dp.cores = list(cores)
        return dp

    idle = client(Core(), Core())
    assert idle.call("sleep_1") == {"is_sleeping": True}
    assert idle.call("sleep_1") == {"is_sleeping": True}  # asleep already: a no-op
    assert idle.call("wake_up") == {"is_sleeping": False}
    for busy in (0, 1):  # the idle core slept before or after the refusal
        cores = [Core(busy=rank == busy) for rank in range(2)]
        mixed = client(*cores).call("sleep_1")
        assert mixed == {"error": f"engine core {busy}: busy"}
        assert not any(core.sleeping for core in cores)
        assert client(*cores).call("is_sleeping") == {"is_sleeping": False}
