"""benchmarks/profile_depth.py refuses what it cannot profile before it looks for a GPU."""

from __future__ import annotations

import pytest

from benchmarks import profile_depth


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        ([], "--depth-trace-mean is required"),
        (["--depth-trace-mean", "16", "--concurrency", "8", "64"], "--concurrency takes one"),
    ],
)
def test_bad_flags_are_named(argv, named, capsys):
    with pytest.raises(SystemExit):
        profile_depth.main(argv)
    assert named in capsys.readouterr().err
