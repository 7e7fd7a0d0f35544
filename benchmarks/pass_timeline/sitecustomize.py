"""Per-pass timeline of the engine, in every process of a run (offline, engine core,
API servers), for finding where a server spends the time an offline run does not.

Loaded at interpreter start when this folder is on PYTHONPATH and PASS_TIMELINE_DIR names
an existing folder; it wraps a few engine methods with timestamps (time.monotonic, one clock
for every process of the machine) and writes one JSON line per busy period to
`<role>-<pid>.jsonl`: an offline `generate` call, an engine core's work between two idle
waits, an API server's requests between two moments with none open.

    PASS_TIMELINE_DIR=/tmp/tl PYTHONPATH=benchmarks/pass_timeline:$PYTHONPATH \\
        vllm-rlt bench serve --launch MODEL --compare-offline ...
    python -m benchmarks.pass_timeline.report /tmp/tl

Events: ("add", t) a request reaches the core; ("launch", t0, t1, decode rows, prompt
rows, admitted requests, path, prompt chunks), the path being "decode_graph", "prompt_graph"
or "eager"; ("collect", t0, t1); ("step", t0, t1, groups); ("publish", t0,
t1); ("generate", t) / ("generated", t); in an API server ("front_add", t),
("front_outputs", t0, t1, deltas) and ("front_release", t).
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import time

FOLDER = os.environ.get("PASS_TIMELINE_DIR")
EVENTS: list = []


def flush(role: str) -> None:
    global EVENTS
    if EVENTS:
        with open(os.path.join(FOLDER, f"{role}-{os.getpid()}.jsonl"), "a") as out:
            out.write(json.dumps(EVENTS) + "\n")
        EVENTS = []


def timed(cls, name: str, event, after=None) -> None:
    """Wrap cls.name: append event(t0, t1, args, result) and call after(self) when done."""
    method = getattr(cls, name)

    def wrapper(self, *args, **kwargs):
        start = time.monotonic()
        result = method(self, *args, **kwargs)
        EVENTS.append(event(start, time.monotonic(), args, result))
        if after is not None:
            after(self)
        return result

    setattr(cls, name, wrapper)


def patch_engine_core(module) -> None:
    timed(module.EngineCore, "_step", lambda t0, t1, a, r: ("step", t0, t1, len(r)))


def patch_runner(module) -> None:
    runner_class = module.ModelRunner
    launch_pass = runner_class.launch

    def launch(self, out):
        # The path the pass takes, judged before it runs: the graphs' counters say which.
        start = time.monotonic()
        replays = self.num_decode_graph_passes, self.num_prompt_graph_passes
        result = launch_pass(self, out)
        if replays[1] != self.num_prompt_graph_passes:
            path = "prompt_graph"
        elif replays[0] != self.num_decode_graph_passes:
            path = "decode_graph"
        else:
            path = "eager"
        chunks = out.prefill_chunks
        EVENTS.append(
            (
                "launch",
                start,
                time.monotonic(),
                len(out.decode_slots),
                sum(len(c.token_ids) for c in chunks),
                len(out.new_slots),
                path,
                len(chunks),
            )
        )
        return result

    runner_class.launch = launch
    timed(module.ModelRunner, "collect", lambda t0, t1, a, r: ("collect", t0, t1))


def patch_core_loop(module) -> None:
    loop = module.CoreLoop
    add, take = loop._add, loop._take_commands

    def _add(self, command):
        EVENTS.append(("add", time.monotonic()))
        return add(self, command)

    def _take_commands(self, wait_ms):
        if wait_ms is None:
            flush("core")  # idle: the busy period is over
        return take(self, wait_ms)

    loop._add, loop._take_commands = _add, _take_commands
    timed(loop, "_publish", lambda t0, t1, a, r: ("publish", t0, t1))


def patch_llm(module) -> None:
    generate = module.LLM.generate

    def wrapper(self, *args, **kwargs):
        EVENTS.append(("generate", time.monotonic()))
        result = generate(self, *args, **kwargs)
        EVENTS.append(("generated", time.monotonic()))
        flush("offline")
        return result

    module.LLM.generate = wrapper


def patch_frontend(module) -> None:
    frontend = module.AsyncLLM
    add, release = frontend.add_request, frontend.release

    def add_request(self, *args, **kwargs):
        EVENTS.append(("front_add", time.monotonic()))
        return add(self, *args, **kwargs)

    def release_stream(self, stream):
        EVENTS.append(("front_release", time.monotonic()))
        release(self, stream)
        if not self._streams:
            flush("front")

    frontend.add_request, frontend.release = add_request, release_stream
    timed(
        frontend,
        "_on_outputs",
        lambda t0, t1, a, r: ("front_outputs", t0, t1, len(a[0].requests)),
    )


PATCHES = {
    "vllm_rlt.engine.engine_core": patch_engine_core,
    "vllm_rlt.worker.model_runner": patch_runner,
    "vllm_rlt.engine.process.core_proc": patch_core_loop,
    "vllm_rlt.engine.llm": patch_llm,
    "vllm_rlt.engine.async_llm": patch_frontend,
}


class PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself: when one of PATCHES' modules is imported, patches it after
    it has run."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


if FOLDER and os.path.isdir(FOLDER):
    sys.meta_path.insert(0, PatchOnImport())
