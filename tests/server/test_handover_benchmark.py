"""benchmarks/handover.py on the toy model: one line per layout and prompt length, and
shared_decode moves a quarter of last_exited's bytes (only the final of four planes)."""

from __future__ import annotations

import json

from benchmarks.handover import main


def test_shared_decode_hands_over_one_plane_of_four(capsys):
    assert main(["toy", "--prompt-len", "40", "--requests", "2"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kv_layout"] for r in records] == ["last_exited", "shared_decode"]
    assert all(r["handovers"] == 2 and r["seconds_per_handover"] > 0 for r in records)
    planes = records[0]["bytes_per_handover"] / records[1]["bytes_per_handover"]
    assert planes == 4
