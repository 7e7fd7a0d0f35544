"""One line per busy period of a pass timeline (see sitecustomize.py here): when requests
arrived, how many passes ran with prompt rows, and where the host time went.

python -m benchmarks.pass_timeline.report FOLDER [--passes N]
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import statistics


def origin(events: list) -> float:
    """The period's start: its generate call, else its first arrival, else its first event."""
    for kinds in (("generate",), ("add", "front_add")):
        times = [e[1] for e in events if e[0] in kinds]
        if times:
            return min(times)
    return events[0][1]


def summary(events: list) -> dict:
    """Times in ms from the period's start (`origin`)."""
    kinds: dict[str, list] = {}
    for event in events:
        kinds.setdefault(event[0], []).append(event)
    arrivals = [e[1] for e in kinds.get("add", []) + kinds.get("front_add", [])]
    t0 = origin(events)

    def ms(t: float) -> float:
        return round(1e3 * (t - t0), 1)

    def total(kind: str) -> float:
        return round(1e3 * sum(e[2] - e[1] for e in kinds.get(kind, [])), 1)

    out: dict = {}
    if arrivals:
        out.update(requests=len(arrivals), arrival_span_ms=ms(max(arrivals)))
    if "generated" in kinds:
        out["generate_ms"] = ms(kinds["generated"][0][1])
    launches = kinds.get("launch", [])
    if launches:
        prompt = [e for e in launches if e[4]]
        out.update(
            passes=len(launches),
            prompt_passes=len(prompt),
            prompt_phase_ms=ms(prompt[-1][2]) if prompt else 0.0,
            last_collect_ms=ms(kinds["collect"][-1][2]),
            launch_ms=total("launch"),
            collect_ms=total("collect"),
            decode_rows_median=statistics.median(e[3] for e in launches),
            by_path=by_path(launches),
        )
    for kind in ("publish", "front_outputs"):
        if kind in kinds:
            out[f"{kind}_ms"] = total(kind)
    if "front_release" in kinds:
        out["last_release_ms"] = ms(max(e[1] for e in kinds["front_release"]))
    return out


def by_path(launches: list) -> dict:
    """Per path a pass took: passes, mean wall ms from its launch to the next launch (its
    share of the run while the host keeps up), mean rows and prompt chunks."""
    paths: dict[str, list[float]] = {}
    for this, following in itertools.pairwise(launches):
        totals = paths.setdefault(this[6], [0, 0.0, 0, 0])
        totals[0] += 1
        totals[1] += following[1] - this[1]
        totals[2] += this[3] + this[4]
        totals[3] += this[7]
    return {
        path: {
            "passes": n,
            "ms_per_pass": round(1e3 * wall / n, 2),
            "rows_per_pass": round(rows / n, 1),
            "chunks_per_pass": round(chunks / n, 1),
        }
        for path, (n, wall, rows, chunks) in paths.items()
    }


def passes(events: list, count: int) -> list[str]:
    """The first `count` passes: start ms, launch ms, decode rows/prompt rows/admitted."""
    launches = [e for e in events if e[0] == "launch"]
    t0 = origin(events)
    return [
        f"{1e3 * (e[1] - t0):.0f}:{1e3 * (e[2] - e[1]):.1f}:{e[3]}/{e[4]}/{e[5]}"
        for e in launches[:count]
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    parser.add_argument("--passes", type=int, default=0, help="list the first N passes")
    args = parser.parse_args()
    for path in sorted(glob.glob(os.path.join(args.folder, "*.jsonl"))):
        with open(path) as lines:
            for number, line in enumerate(lines):
                events = json.loads(line)
                record = {"file": os.path.basename(path), "period": number, **summary(events)}
                if args.passes and "passes" in record:
                    record["first_passes"] = passes(events, args.passes)
                print(json.dumps(record))


if __name__ == "__main__":
    main()
