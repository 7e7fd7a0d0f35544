"""Bad input: every invalid argument fails with an error naming the field, and disturbs nothing.

docs/design.md §6 asks that each invalid setting or request is rejected with a clear message
(the field and, where there is one, the allowed range), and that a rejected request leaves the
engine exactly as it was: requests already running, and requests added afterwards, produce the
same output as when run alone, and an idle engine ends with every block and slot free.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tests.conftest import drain, frontend
from vllm_rlt import LLM, CacheConfig, ExecutionConfig, ExitConfig, SamplingParams, SchedulerConfig
from vllm_rlt.config import KV_LAYOUTS, KVLayout
from vllm_rlt.engine.builder import build_engine_core
from vllm_rlt.engine.engine_core import EngineCore
from vllm_rlt.engine.request_checks import params_for_core
from vllm_rlt.engine_config import DeviceConfig, EngineConfig
from vllm_rlt.tokenizer import Tokenizer

T = 4  # the toy's total_ut_steps
VOCAB = 259  # the toy's vocab_size (byte tokenizer)
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
TOKEN_ID = r"a token id in \[0, vocab_size - 1\]"  # SamplingParams knows no vocabulary


def greedy(max_tokens: int = 4, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, exit_threshold=0.5, **kwargs)


# ================================================================= SamplingParams
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n": 0}, r"n must be in \[1, 128\], got 0"),
        ({"n": 129}, r"n must be in \[1, 128\], got 129"),
        ({"n": 1.5}, r"n must be an integer in \[1, 128\], got 1\.5"),
        ({"max_tokens": 0}, r"max_tokens must be >= 1, got 0"),
        ({"max_tokens": True}, r"max_tokens must be an integer >= 1, got True"),
        ({"max_tokens": 4, "min_tokens": 5}, r"min_tokens must be in \[0, 4\], got 5"),
        ({"min_tokens": -1}, r"min_tokens must be in \[0, 16\], got -1"),
        ({"temperature": -0.1}, r"temperature must be in \[0\.0, 100\.0\], got -0\.1"),
        ({"temperature": 101}, r"temperature must be in \[0\.0, 100\.0\], got 101"),
        ({"temperature": "hot"}, r"temperature must be a number in \[0\.0, 100\.0\], got 'hot'"),
        ({"temperature": None}, r"temperature must be a number in \[0\.0, 100\.0\], got None"),
        ({"temperature": float("nan")}, r"temperature must be in \[0\.0, 100\.0\], got nan"),
        ({"top_k": -2}, r"top_k must be 0 or -1 \(every token\) or in \[1, 2147483647\], got -2"),
        ({"top_p": 0}, r"top_p must be in \(0\.0, 1\.0\], got 0"),
        ({"top_p": 0.0}, r"top_p must be in \(0\.0, 1\.0\], got 0\.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0\.0, 1\.0\], got 1\.5"),  # one range, as written
        ({"min_p": -0.1}, r"min_p must be in \[0\.0, 1\.0\], got -0\.1"),
        ({"min_p": 1.1}, r"min_p must be in \[0\.0, 1\.0\], got 1\.1"),
        (
            {"seed": -(2**63) - 1},
            rf"seed must be in \[{INT64_MIN}, {INT64_MAX}\], got {INT64_MIN - 1}",
        ),
        ({"seed": 2**63}, rf"seed must be in \[{INT64_MIN}, {INT64_MAX}\], got {2**63}"),
        ({"seed": "7"}, r"seed must be an integer in \[-\d+, \d+\], got '7'"),
        ({"stop": ""}, r"stop must hold non-empty strings, got ''"),
        ({"stop": ["end", ""]}, r"stop must hold non-empty strings, got ''"),
        ({"stop": [3]}, r"stop must hold non-empty strings, got 3"),
        ({"stop": 5}, r"stop must be a string or a list of strings, got 5"),
        ({"stop": ["\ud800"]}, r"stop is not valid Unicode: character 0 is a lone surrogate"),
        ({"bad_words": ["\udfff"]}, r"bad_words is not valid Unicode"),
        ({"bad_words_token_ids": [5]}, r"bad_words_token_ids must hold token-id lists, got 5"),
        ({"bad_words_token_ids": [None]}, r"bad_words_token_ids must hold token-id lists"),
        ({"stop_token_ids": 5}, r"stop_token_ids must be a list of token ids, got 5"),
        ({"stop_token_ids": [5, -1]}, rf"stop_token_ids\[1\] must be {TOKEN_ID}, got -1"),
        ({"stop_token_ids": [2**70]}, rf"stop_token_ids\[0\] must be {TOKEN_ID}, got 1180"),
        ({"stop_token_ids": ["5"]}, rf"stop_token_ids\[0\] must be {TOKEN_ID}, got '5'"),
        ({"logit_bias": {2**70: 1.0}}, rf"logit_bias key 1180\d+\.\.\. must be {TOKEN_ID}"),
        ({"allowed_token_ids": [2**31]}, rf"allowed_token_ids\[0\] must be {TOKEN_ID}"),
        ({"repetition_penalty": 1e-320}, r"repetition_penalty must be in \[1e-30, 10\.0\]"),
        ({"logprobs": 21}, r"logprobs must be in \[0, 20\], got 21"),
        ({"logprobs": -1}, r"logprobs must be in \[0, 20\], got -1"),
        ({"min_loops": 0}, r"min_loops must be >= 1, got 0"),
        ({"max_loops": 0}, r"max_loops must be >= 1, got 0"),
        ({"max_loops": 2.0}, r"max_loops must be an integer >= 1, got 2\.0"),
        ({"min_loops": 3, "max_loops": 2}, r"min_loops \(3\) must be <= max_loops \(2\)"),
        ({"exit_threshold": 1.5}, r"exit_threshold must be in \[0\.0, 1\.0\], got 1\.5"),
        ({"exit_threshold": -0.5}, r"exit_threshold must be in \[0\.0, 1\.0\], got -0\.5"),
        ({"exit_threshold": "0.5"}, r"exit_threshold must be a number in \[0\.0, 1\.0\]"),
    ],
    ids=lambda v: ",".join(f"{k}={v[k]!r}" for k in v) if isinstance(v, dict) else "",
)
def test_sampling_params_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"min_loops": 1},
        {"min_loops": 1, "max_loops": 1},
        {"min_loops": 4, "max_loops": 4},
        {"exit_threshold": 0.0},
        {"exit_threshold": 1.0},
        {"logprobs": 0},
        {"logprobs": 20},
        {"top_p": 1.0, "top_k": 0, "min_p": 1.0},
        {"temperature": 0},
        {"max_tokens": 3, "min_tokens": 3},
        {"seed": 0},
        {"seed": INT64_MAX},
        {"seed": -1},
        {"seed": INT64_MIN},
        {"stop": "end"},
        {"stop_token_ids": [0]},
    ],
)
def test_sampling_params_accepts_edges(kwargs: dict[str, Any]) -> None:
    """The ends of every range are legal; min_loops=1 is the smallest depth, not an error."""
    params = SamplingParams(**kwargs)
    if "min_loops" in kwargs:
        assert params.resolved_loops(T)[0] == kwargs["min_loops"]
    if kwargs.get("stop") == "end":
        assert params.stop == ["end"]


def test_stop_holds_at_most_64_strings() -> None:
    """Each stop string is searched for after every token."""
    assert len(SamplingParams(stop=["x"] * 64).stop) == 64
    with pytest.raises(ValueError, match=r"stop must hold at most 64 strings, got 65") as error:
        SamplingParams(stop=["x"] * 65)
    assert error.value.param == "stop"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_loops": 5}, r"max_loops must be in \[1, 4\], got 5"),
        ({"min_loops": 5}, r"min_loops must be in \[1, 4\], got 5"),
    ],
)
def test_resolved_loops_checks_model_depth(kwargs: dict[str, Any], match: str) -> None:
    params = SamplingParams(**kwargs)  # legal on its own: the depth is the model's business
    with pytest.raises(ValueError, match=match):
        params.resolved_loops(T)


class _SpacedTokenizer:
    """Encodes "w" as two tokens and " w" as `spaced` others, as a BPE tokenizer whose
    space merges into the word does."""

    def __init__(self, spaced: int) -> None:
        self.spaced = spaced

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(range(50, 50 + self.spaced)) if text.startswith(" ") else [5, 6]


def test_each_form_of_a_bad_word_is_at_most_8_tokens() -> None:
    """A bad word is barred without a leading space and with one; the second form is kept
    only where it does not end with the first (in the byte tokenizer it is always a space
    token before the first, so 8 bytes is the limit), and each kept form is at most 8
    tokens."""
    byte_level = Tokenizer.byte_level()
    eight = params_for_core(SamplingParams(bad_words=[" abcdefgh", "a"]), byte_level)
    assert eight.bad_words_token_ids == [list(range(100, 108)), [100]]
    with pytest.raises(ValueError) as error:
        params_for_core(SamplingParams(bad_words=["abcdefghi"]), byte_level)
    assert str(error.value) == "bad word 'abcdefghi' is 9 tokens without a leading space; at most 8"
    assert error.value.param == "bad_words"
    kept = params_for_core(SamplingParams(bad_words=["w"]), _SpacedTokenizer(8))  # type: ignore[arg-type]
    assert kept.bad_words_token_ids == [[5, 6], list(range(50, 58))]
    with pytest.raises(ValueError) as error:
        params_for_core(SamplingParams(bad_words=["w"]), _SpacedTokenizer(9))  # type: ignore[arg-type]
    assert str(error.value) == "bad word 'w' is 9 tokens with a leading space (' w'); at most 8"


# ================================================================= engine configs
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"layout": "paged"},
            r"layout must be one of last_exited, shared, shared_decode, got 'paged'",
        ),
        ({"block_size": 0}, r"block_size must be in \[1, 1024\], got 0"),
        ({"block_size": 2048}, r"block_size must be in \[1, 1024\], got 2048"),
        ({"block_size": 4.0}, r"block_size must be an integer in \[1, 1024\], got 4\.0"),
        ({"num_blocks": 0}, r"num_blocks must be >= 1, got 0"),
        ({"num_blocks": "8"}, r"num_blocks must be an integer >= 1, got '8'"),
        ({"kv_cache_memory_bytes": 0}, r"kv_cache_memory_bytes must be >= 1, got 0"),
        (
            {"num_blocks": 8, "kv_cache_memory_bytes": 1 << 20},
            "num_blocks and kv_cache_memory_bytes are mutually exclusive",
        ),
        ({"gpu_memory_utilization": 0}, r"gpu_memory_utilization must be in \(0, 1\], got 0"),
        ({"gpu_memory_utilization": 1.5}, r"gpu_memory_utilization must be in \(0, 1\], got 1\.5"),
        ({"gpu_memory_utilization": "0.9"}, r"gpu_memory_utilization must be in \(0, 1\]"),
    ],
)
def test_cache_config_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CacheConfig(**kwargs)


def test_kv_memory_budget_below_one_block() -> None:
    """A byte budget too small for one block fails when the pool is sized, naming the field."""
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=1 is smaller than one KV block"):
        LLM(cache_config=CacheConfig(kv_cache_memory_bytes=1))


SCHEDULER_INT_FIELDS = [
    ("max_num_seqs", 1, 65536),
    ("max_num_batched_tokens", 1, None),
    ("prefill_chunk_size", 1, None),
    ("max_prefill_batches_before_decode", 1, None),
    ("admission_scan_limit", 1, None),
    ("max_admission_bypasses", 0, None),
]


@pytest.mark.parametrize(("name", "low", "high"), SCHEDULER_INT_FIELDS)
def test_scheduler_config_int_fields(name: str, low: int, high: int | None) -> None:
    allowed = rf">= {low}" if high is None else rf"in \[{low}, {high}\]"
    with pytest.raises(ValueError, match=rf"{name} must be {allowed}, got {low - 1}"):
        SchedulerConfig(**{name: low - 1})
    with pytest.raises(ValueError, match=rf"{name} must be an integer {allowed}"):
        SchedulerConfig(**{name: "8"})
    if high is not None:
        with pytest.raises(ValueError, match=rf"{name} must be in \[{low}, {high}\]"):
            SchedulerConfig(**{name: high + 1, "max_num_batched_tokens": 10**6})
    SchedulerConfig(**{name: 64})  # a sensible value is fine


def test_scheduler_config_rejects_mode_and_row_budget() -> None:
    with pytest.raises(ValueError, match=r"mode must be one of refill, no_refill, got 'eager'"):
        SchedulerConfig(mode="eager")
    with pytest.raises(
        ValueError, match=r"max_num_batched_tokens \(8\) must be >= max_num_seqs \(16\)"
    ):
        SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=8)
    SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=16)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"mode": "greedy"},
            r"exit mode must be one of auto, ouro, ouro_delayed, random_lookahead, trace, "
            r"latent_diff, kl, entropy_diff, got 'greedy'",
        ),
        ({"seed": -1}, rf"seed must be in \[0, {INT64_MAX}\], got -1"),
        ({"seed": 1.0}, r"seed must be an integer"),
        (
            {"mode": "trace", "depths_by_request": {"a": []}},
            r"depths_by_request\['a'\] must be a non-empty list of loop depths",
        ),
        (
            {"mode": "trace", "depths_by_request": {"a": 4}},
            r"depths_by_request\['a'\] must be a non-empty list of loop depths",
        ),
        (
            {"mode": "trace", "depths_by_request": {"a": "44"}},
            r"depths_by_request\['a'\] must be a non-empty list of loop depths",
        ),
        (
            {"mode": "trace", "depths_by_request": {"a": (4, 0)}},
            r"depths_by_request\['a'\] entry must be >= 1, got 0",
        ),
        (
            {"mode": "trace", "depths_by_request": {"a": (4, "2")}},
            r"depths_by_request\['a'\] entry must be an integer >= 1, got '2'",
        ),
        (
            {"mode": "ouro", "depths_by_request": {"a": (4, 2)}},
            "depths_by_request is only used with exit mode 'trace'",
        ),
    ],
)
def test_exit_config_rejects(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ExitConfig(**kwargs)


def test_execution_config_rejects_bad_seed() -> None:
    with pytest.raises(ValueError, match=rf"seed must be in \[0, {INT64_MAX}\], got -3"):
        ExecutionConfig(seed=-3)


# ================================================================= EngineCore.add_request
PROMPT_BEFORE = [10, 20, 30, 40]
PROMPT_AFTER = [60, 70, 80]
# Both fit the 4-block pool of "small_kv" together: (4 + 5 - 1) and (3 + 4 - 1) positions.
GOOD_BEFORE = ("good-before", PROMPT_BEFORE, 5)
GOOD_AFTER = ("good-after", PROMPT_AFTER, 4)

TRACES = {
    "good-before": (4, 1, 3, 2, 4),
    "good-after": (4, 2, 2, 1),
    "first3": (3, 1, 2, 3),
    "short": (4, 1, 2),
    "deep": (4, 1, 3, 2),
    "shallow": (4, 2, 1, 2),
}
ENGINES: dict[str, dict[str, Any]] = {
    "default": {},
    "small_kv": {"num_blocks": 4, "block_size": 4},
    # one-plane blocks: a prompt takes one per loop while it prefills
    "small_shared_decode": {"layout": "shared_decode", "num_blocks": 8, "block_size": 4},
    "trace": {"exit_config": ExitConfig(mode="trace", depths_by_request=TRACES)},
}


@dataclass(frozen=True)
class BadRequest:
    engine: str
    request_id: str
    prompt: Any
    params: Any
    match: str


BAD_REQUESTS = {
    "empty_prompt": BadRequest(
        "default", "bad", [], greedy(), "prompt must contain at least one token"
    ),
    "token_above_vocab": BadRequest(
        "default",
        "bad",
        [10, VOCAB],
        greedy(),
        rf"prompt_token_ids\[1\] must be a token id in \[0, {VOCAB - 1}\], got {VOCAB}",
    ),
    "negative_token": BadRequest(
        "default", "bad", [-1, 10], greedy(), r"prompt_token_ids\[0\] .*\[0, 258\], got -1"
    ),
    "non_int_token": BadRequest(
        "default", "bad", [10, "a"], greedy(), r"prompt_token_ids\[1\] .*, got 'a'"
    ),
    "beyond_context": BadRequest(
        "default",
        "bad",
        [7] * 4000,
        greedy(max_tokens=97),
        r"prompt \(4000 tokens\) \+ max_tokens \(97\) = 4097 exceeds the context length "
        r"4096 \(max_model_len\)",
    ),
    "max_loops_above_T": BadRequest(
        "default", "bad", [10], greedy(max_loops=5), r"max_loops must be in \[1, 4\], got 5"
    ),
    "min_loops_above_T": BadRequest(
        "default", "bad", [10], greedy(min_loops=5), r"min_loops must be in \[1, 4\], got 5"
    ),
    "duplicate_request_id": BadRequest(
        "default",
        "good-before",
        PROMPT_AFTER,
        greedy(),
        r"request_id 'good-before' is already in use",
    ),
    "stop_token_above_vocab": BadRequest(
        "default",
        "bad",
        [10],
        greedy(stop_token_ids=[VOCAB]),
        rf"stop_token_ids\[0\] must be a token id in \[0, {VOCAB - 1}\], got {VOCAB}",
    ),
    "params_not_sampling_params": BadRequest(
        "default", "bad", [10], {"max_tokens": 4}, "sampling_params must be a SamplingParams"
    ),
    "reservation_beyond_pool": BadRequest(
        "small_kv",
        "bad",
        [7] * 10,
        greedy(max_tokens=8),
        r"prompt \+ max_tokens needs 5 KV blocks but the cache has 4; for this prompt "
        r"max_tokens must be in \[1, 7\], or raise num_blocks",
    ),
    "prompt_prefill_beyond_pool": BadRequest(
        "small_shared_decode",
        "bad",
        [7] * 9,
        greedy(max_tokens=1),
        r"prompt \(9 tokens\) needs 12 KV blocks while it prefills \(one plane per loop\) "
        "but the cache has 8",
    ),
    "trace_missing_request": BadRequest(
        "trace", "unknown", [10], greedy(), r"exit trace has no depths for request_id 'unknown'"
    ),
    "trace_first_depth_not_T": BadRequest(
        "trace",
        "first3",
        [10],
        greedy(),
        r"exit trace for 'first3': the first depth is the prefill depth and must be 4, got 3",
    ),
    "trace_shorter_than_max_tokens": BadRequest(
        "trace",
        "short",
        [10],
        greedy(),
        r"exit trace for 'short' has 3 depths; max_tokens=4 needs at least 4",
    ),
    "trace_depth_above_max_loops": BadRequest(
        "trace",
        "deep",
        [10],
        greedy(max_loops=2),
        r"exit trace for 'deep': depth 2 must be in \[1, 2\] \(min_loops, max_loops\), got 3",
    ),
    "trace_depth_below_min_loops": BadRequest(
        "trace",
        "shallow",
        [10],
        greedy(min_loops=2),
        r"exit trace for 'shallow': depth 2 must be in \[2, 4\] \(min_loops, max_loops\), got 1",
    ),
}

Summary = tuple[list[int], list[int], str | None]
_ALONE: dict[tuple[str, str], Summary] = {}


def summary(output) -> Summary:
    completion = output.outputs[0]
    return completion.token_ids, completion.exit_depths, completion.finish_reason


def alone(make_engine, engine_name: str, request: tuple[str, list[int], int]) -> Summary:
    """The request's output on a fresh engine of the same kind, with nothing else in it."""
    key = (engine_name, request[0])
    if key not in _ALONE:
        engine = make_engine(**ENGINES[engine_name])
        request_id, prompt, max_tokens = request
        finished = drain(engine, {0: [(request_id, prompt, greedy(max_tokens))]})
        _ALONE[key] = summary(finished[request_id])
    return _ALONE[key]


def engine_state(engine: EngineCore) -> tuple:
    """What a rejected request must not change."""
    sched = engine.scheduler
    return (
        sorted(engine.groups),
        sorted(sched.requests),
        [r.request_id for r in sched.waiting],
        {slot: r.request_id for slot, r in sched.running.items()},
        engine.kv.num_free_blocks,
        sorted(frontend(engine).states),
    )


def add_bad_between_good(engine: EngineCore, bad: BadRequest, when: str) -> dict[str, Any]:
    """good-before, then (waiting or mid-decode) the bad request, then good-after; drain."""
    request_id, prompt, max_tokens = GOOD_BEFORE
    frontend(engine).add_request(request_id, prompt, greedy(max_tokens))
    if when == "decoding":
        produced = 0
        while produced < 2:
            for output in frontend(engine).step():
                assert not output.finished, "good-before finished before the bad request came"
                produced = len(output.outputs[0].token_ids)
    before = engine_state(engine)
    with pytest.raises(ValueError, match=bad.match):
        frontend(engine).add_request(bad.request_id, bad.prompt, bad.params)
    assert engine_state(engine) == before, "a rejected request changed the engine"
    request_id, prompt, max_tokens = GOOD_AFTER
    frontend(engine).add_request(request_id, prompt, greedy(max_tokens))
    return drain(engine)


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_request_mid_generation_leaves_engine_undisturbed(make_engine, case: str) -> None:
    """Rejected while another request is decoding: both good requests match their solo runs."""
    bad = BAD_REQUESTS[case]
    engine = make_engine(**ENGINES[bad.engine])
    finished = add_bad_between_good(engine, bad, "decoding")
    assert sorted(finished) == ["good-after", "good-before"]
    for good in (GOOD_BEFORE, GOOD_AFTER):
        result = summary(finished[good[0]])
        assert result[2] is not None
        assert result == alone(make_engine, bad.engine, good)


@pytest.mark.parametrize(
    "case",
    [
        "duplicate_request_id",
        "empty_prompt",
        "reservation_beyond_pool",
        "trace_shorter_than_max_tokens",
    ],
)
def test_bad_request_while_good_one_waits(make_engine, case: str) -> None:
    """Rejected while the earlier request is still queued (not yet scheduled)."""
    bad = BAD_REQUESTS[case]
    engine = make_engine(**ENGINES[bad.engine])
    finished = add_bad_between_good(engine, bad, "waiting")
    for good in (GOOD_BEFORE, GOOD_AFTER):
        assert summary(finished[good[0]]) == alone(make_engine, bad.engine, good)


def test_the_max_tokens_a_small_pool_names_is_accepted(make_engine) -> None:
    """The range the pool's refusal gives is exact: its upper end runs to the end."""
    bad = BAD_REQUESTS["reservation_beyond_pool"]
    engine = make_engine(**ENGINES[bad.engine])
    finished = drain(engine, {0: [("edge", bad.prompt, greedy(max_tokens=7, ignore_eos=True))]})
    assert len(finished["edge"].outputs[0].token_ids) == 7


def test_request_id_is_reusable_after_it_finished(make_engine) -> None:
    """'Already in use' means in flight: a finished id may be submitted again."""
    engine = make_engine()
    first = drain(engine, {0: [("again", PROMPT_AFTER, greedy())]})
    second = drain(engine, {0: [("again", PROMPT_AFTER, greedy())]})
    assert summary(first["again"]) == summary(second["again"])


def test_min_loops_one_is_allowed_and_honoured(make_engine) -> None:
    """min_loops=1 is legal; with q=0 every decode token exits after its first loop."""
    engine = make_engine()
    params = SamplingParams(temperature=0.0, max_tokens=4, min_loops=1, exit_threshold=0.0)
    finished = drain(engine, {0: [("r", PROMPT_AFTER, params)]})
    assert finished["r"].outputs[0].exit_depths == [T, 1, 1, 1]


def test_a_prompt_that_fills_the_context_is_named_as_the_cause(make_engine) -> None:
    """Not a max_tokens the caller never chose (the server asks for one token to score)."""
    engine = make_engine(num_blocks=1100, block_size=4)
    for length, verb in ((4096, "fills"), (4100, "exceeds")):
        with pytest.raises(ValueError, match=rf"the prompt \({length} tokens\) {verb}") as raised:
            frontend(engine).add_request("full", [7] * length, greedy(max_tokens=1))
        assert raised.value.param == "prompt"


def test_context_length_boundary_is_accepted(make_engine) -> None:
    """prompt + max_tokens == max_position_embeddings is allowed (one more is rejected)."""
    engine = make_engine(num_blocks=1024, block_size=4)
    frontend(engine).add_request("edge", [7] * 4000, greedy(max_tokens=96))
    assert frontend(engine).abort_request("edge").finished
    with pytest.raises(ValueError, match=r"exceeds the context length 4096 \(max_model_len\)"):
        frontend(engine).add_request("over", [7] * 4000, greedy(max_tokens=97))


def test_reservation_exactly_filling_the_pool_runs(make_engine) -> None:
    """prompt + max_tokens - 1 positions are reserved: 9 + 8 - 1 = 16 fits 4 blocks of 4."""
    engine = make_engine(num_blocks=4, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    finished = drain(engine, {0: [("full", [7] * 9, params)]})
    assert len(finished["full"].outputs[0].token_ids) == 8


def _bare_engine(toy_model) -> EngineCore:
    """An engine outside make_engine, so a broken engine does not also fail the teardown."""
    return build_engine_core(
        toy_model,
        Tokenizer.byte_level(),
        EngineConfig(
            cache_config=CacheConfig(num_blocks=128, block_size=4),
            scheduler_config=SchedulerConfig(),
            device_config=DeviceConfig(attention_backend="torch"),
        ),
    )


@pytest.mark.parametrize("order", ["group_first", "single_first"])
def test_request_id_colliding_with_an_n_child_id(toy_model, order: str) -> None:
    """A request with n=2 runs as children 'a#0' and 'a#1'; a separate request named 'a#0'
    must either be rejected as a duplicate or run alongside. Either way nothing may crash."""
    engine = _bare_engine(toy_model)
    group = ("a", PROMPT_BEFORE, greedy(n=2))
    single = ("a#0", PROMPT_AFTER, greedy())
    first, second = (group, single) if order == "group_first" else (single, group)
    frontend(engine).add_request(*first)
    try:
        frontend(engine).add_request(*second)
        accepted = True
    except ValueError as exc:
        assert "request_id" in str(exc)
        accepted = False
    finished = drain(engine)
    expected = {"a", "a#0"} if accepted else {first[0]}
    assert set(finished) == expected
    assert len(finished["a#0" if "a#0" in finished else "a"].outputs[0].token_ids) > 0
    if "a" in finished:
        assert len(finished["a"].outputs) == 2
    assert engine.all_blocks_free() and not engine.has_unfinished


# ================================================================= LLM
@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="toy")


def assert_idle(llm: LLM) -> None:
    assert llm.engine.all_blocks_free()
    assert not llm.engine.has_unfinished


PROMPTS_MSG = r"prompts must be a string, a list of strings, token ids, or \{'prompt_token_ids'"


@pytest.mark.parametrize(
    ("prompts", "match"),
    [
        (1.5, PROMPTS_MSG),
        (None, PROMPTS_MSG),
        ([], PROMPTS_MSG),
        ((), PROMPTS_MSG),
        ({}, r"prompts\[0\] must have 'prompt_token_ids' or 'prompt'"),
        (["ok", {"ids": [5]}], r"prompts\[1\] has the key 'ids', which is not supported"),
        (["ok", 1.5], r"prompts\[1\] must be a string, a token-id list or a dict, got float"),
        ([[5, 6], None], r"prompts\[1\] must be a string, a token-id list or a dict, got NoneType"),
        ([[]], "prompt must contain at least one token"),
        ({"prompt_token_ids": []}, "prompt must contain at least one token"),
        ({"prompt_token_ids": "abc"}, r"\['prompt_token_ids'\] must be a list of token ids"),
        ({"prompt": 5}, r"prompts\[0\]\['prompt'\] must be a string, got int"),
    ],
)
def test_llm_rejects_bad_prompts(llm: LLM, prompts: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, greedy(), use_tqdm=False)
    assert_idle(llm)


def test_llm_rejects_mismatched_lengths(llm: LLM) -> None:
    with pytest.raises(ValueError, match="sampling_params has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], [greedy()], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params has 3 entries for 2 prompts"):
        llm.generate(["a", "b"], [greedy()] * 3, use_tqdm=False)
    with pytest.raises(ValueError, match="request_ids has 1 entries for 2 prompts"):
        llm.generate(["a", "b"], greedy(), use_tqdm=False, request_ids=["x"])
    assert_idle(llm)


@pytest.mark.parametrize(
    ("params", "match"),
    [
        ({"max_tokens": 2}, "a SamplingParams or a list of them, one per prompt, got dict"),
        ("greedy", "a list of them, one per prompt, got str"),
        ([None, "ok"], "entry 0 is a NoneType"),
        (["ok", "x"], "entry 1 is a str"),
    ],
)
def test_llm_rejects_sampling_params_of_another_type(llm: LLM, params: Any, match: str) -> None:
    """Not a TypeError from deep inside: a ValueError naming sampling_params, nothing queued."""
    if isinstance(params, list):
        params = [greedy() if one == "ok" else one for one in params]
    with pytest.raises(ValueError, match=match) as raised:
        llm.generate(["a", "b"], params, use_tqdm=False)
    assert raised.value.param == "sampling_params"
    assert_idle(llm)


NOTHING_LEFT = {"allowed_token_ids": [100], "bad_words": ["a"]}  # "a" is token 100


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"seed": 3},
        {"n": 8},
        {"top_k": 5, "top_p": 0.5},
        {"min_tokens": 4, "max_tokens": 8},
    ],
)
def test_llm_refuses_constraints_that_leave_nothing_to_sample(llm: LLM, kwargs) -> None:
    """The only allowed token is a bad word: refused before anything runs, naming both."""
    with pytest.raises(ValueError) as error:
        llm.generate(["1+1=", "ok"], SamplingParams(**NOTHING_LEFT, **kwargs), use_tqdm=False)
    assert error.value.param == "allowed_token_ids"  # type: ignore[attr-defined]
    assert str(error.value) == (
        "nothing could be sampled at the first token: of allowed_token_ids [100], "
        "bad_words bar [100]"
    )
    assert_idle(llm)


def test_llm_refuses_a_bad_word_that_empties_a_later_step(llm: LLM) -> None:
    """Only "a" allowed and "aa" barred: the second token would have nothing left, so two
    tokens are refused and one runs; EOS alone is refused before min_tokens."""
    params = {"allowed_token_ids": [100], "bad_words": ["aa"], "ignore_eos": True}
    later = r"after 1 token, once the output ends with the tokens \[100\]: .* bad_words bar"
    with pytest.raises(ValueError, match=later):
        llm.generate("1+1=", SamplingParams(max_tokens=2, **params), use_tqdm=False)
    once = llm.generate("1+1=", SamplingParams(max_tokens=1, **params), use_tqdm=False)
    assert once[0].outputs[0].text == "a"
    eos = sorted(llm.tokenizer.eos_token_ids)
    with pytest.raises(ValueError, match=r"min_tokens \(1\) bans the EOS and stop token ids"):
        llm.generate("1+1=", SamplingParams(allowed_token_ids=eos, min_tokens=1), use_tqdm=False)
    assert_idle(llm)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"device": "tpu"}, r"device must be 'cpu' or 'cuda\[:N\]', got 'tpu'"),
        ({"device": "meta"}, r"device must be 'cpu' or 'cuda\[:N\]', got 'meta'"),
        ({"dtype": "int8"}, r"dtype must be one of auto, float32, .*, got 'int8'"),
        ({"dtype": torch.int8}, r"dtype must be float32, bfloat16 or float16, got torch\.int8"),
        ({"attention_backend": "nope"}, r"attention_backend must be one of auto, .*got 'nope'"),
    ],
)
def test_llm_rejects_bad_construction(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
def test_llm_rejects_cuda_without_cuda() -> None:
    with pytest.raises(ValueError, match="device 'cuda' was requested but CUDA is not available"):
        LLM(device="cuda")


@pytest.mark.parametrize(
    ("prompts", "params", "request_ids", "match"),
    [
        (["Hello", [5, 999], "abc"], greedy(), None, r"prompt_token_ids\[1\] .*got 999"),
        (
            ["Hello", "abc", "xyz"],
            [greedy(n=2), greedy(), greedy(max_loops=9)],
            None,
            r"max_loops must be in \[1, 4\], got 9",
        ),
        (["Hello", "abc"], greedy(), ["x", "x"], r"request_id 'x' is already in use"),
        (["Hello", "a" * 5000], greedy(), None, r"exceeds the context length 4096 \(max_"),
    ],
    ids=["bad_token", "bad_loops_after_n2", "duplicate_ids", "too_long"],
)
def test_llm_invalid_prompt_in_batch_leaves_engine_idle(
    llm: LLM, prompts: list, params: Any, request_ids: list[str] | None, match: str
) -> None:
    """One bad prompt fails the whole call, the good ones already queued are withdrawn, and the
    next call gives the same output as before."""
    reference = [summary(o) for o in llm.generate(["Hello", "abc"], greedy(), use_tqdm=False)]
    with pytest.raises(ValueError, match=match):
        llm.generate(prompts, params, use_tqdm=False, request_ids=request_ids)
    assert_idle(llm)
    again = [summary(o) for o in llm.generate(["Hello", "abc"], greedy(), use_tqdm=False)]
    assert again == reference
    assert_idle(llm)


def test_a_layout_name_becomes_its_kind_with_its_geometry():
    layouts = {name: CacheConfig(layout=name).layout for name in KV_LAYOUTS}
    assert layouts == {
        "last_exited": KVLayout.LAST_EXITED,
        "shared": KVLayout.SHARED,
        "shared_decode": KVLayout.SHARED_DECODE,
    }
    geometry = {
        name: (
            layout.planes(4),
            layout.table_planes(4),
            layout.writes_deeper_planes,
            layout.one_position_prefill,
        )
        for name, layout in layouts.items()
    }
    assert geometry == {
        "last_exited": (4, 1, True, False),
        "shared": (1, 1, False, True),
        "shared_decode": (1, 4, False, False),
    }
    assert f"{KVLayout.SHARED}" == str(KVLayout.SHARED) == "shared"
    with pytest.raises(ValueError, match="layout must be one of last_exited, shared"):
        CacheConfig(layout="planes")
