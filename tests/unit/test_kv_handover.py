"""Prefill/decode disaggregation inside the engine core (engine/disagg/handover.py): a request
that a prefill core runs up to its first tokens and a decode core continues produces what
one core running it alone produces, in both per-plane KV layouts, and leaves no block or
slot behind on either core."""

from __future__ import annotations

import dataclasses
import functools

import pytest

from vllm_rlt import ExitConfig, SamplingParams
from vllm_rlt.config import SpeculativeConfig
from vllm_rlt.core.kv_cache_manager import block_hashes
from vllm_rlt.engine.disagg.links import OpenedPools
from vllm_rlt.engine.disagg.nixl_connector import NixlConnector
from vllm_rlt.parallel.tensor_parallel import follow
from vllm_rlt.worker.kv_pool import copy_kv

PROMPTS = [[5, 17, 33, 2, 9, 41, 7], [60, 3, 3, 12], list(range(20, 39)), [88, 1]]


@pytest.fixture
def make_pd_engine(make_engine):
    """Engine cores built for disaggregation (`make_engine`'s, with `disagg`)."""
    return functools.partial(make_engine, disaggregated=True)


def _collect(outputs: dict, delta) -> None:
    """Fold one core's RequestDelta into outputs[request][index] = [tokens, depths,
    logprobs, finish reason], checking that deltas continue where the last one ended."""
    per_request = outputs.setdefault(delta.request_id, {})
    for completion in delta.completions:
        got = per_request.setdefault(completion.index, [[], [], [], None])
        assert completion.start == len(got[0]), "a delta repeats or skips tokens"
        got[0] += completion.token_ids
        got[1] += completion.exit_depths
        got[2] += completion.logprobs or []
        if completion.finish_reason is not None:
            assert got[3] is None, "a completion ended twice"
            got[3] = completion.finish_reason
    if delta.prompt_logprobs is not None:
        assert "prompt" not in per_request, "prompt logprobs reported twice"
        per_request["prompt"] = delta.prompt_logprobs


def _colocated(engine, requests) -> dict:
    outputs: dict = {}
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished:
        for delta in engine.step():
            _collect(outputs, delta)
    return outputs


def _release_copied(prefill, decode) -> None:
    prefetched, copied = decode.disagg.collect_transfers()
    for request_id in prefetched + copied:  # lent first, released first
        assert prefill.disagg.ledger.release(request_id)


def _disaggregated(prefill, decode, requests, source=None) -> tuple[dict, list]:
    """Both cores to the end; the prefill core frees each handover's blocks once the
    decode core says its copy is done, and not before. `source` (if given) is the prefill
    pool as the decode core reads it (through a connector)."""
    outputs: dict = {}
    handed = []
    for request_id, prompt, params in requests:
        prefill.add_request(request_id, prompt, params, handover=True)
    while prefill.has_unfinished or decode.has_unfinished:
        if prefill.has_unfinished:
            for delta in prefill.step():
                _collect(outputs, delta)
            for blocks in prefill.disagg.take_prefetches():
                decode.disagg.prefetch_kv(
                    blocks, prefill.runner.kv_pool if source is None else source
                )
            for handover in prefill.disagg.take_handovers():
                handed.append(handover)
                if any(c.kv is not None for c in handover.completions):
                    assert not prefill.all_blocks_free()  # lent until the copy is done
                if source is not None:
                    handover.pool = source
                decode.disagg.import_request(handover)
        if decode.has_unfinished:
            for delta in decode.step():
                _collect(outputs, delta)
        _release_copied(prefill, decode)
    for _ in range(1000):  # copies may still run on the device
        if not (decode.disagg.ledger.importing or decode.disagg.ledger.prefetching):
            break
        _release_copied(prefill, decode)
    _release_copied(prefill, decode)
    assert not prefill.disagg.ledger.lent and not decode.disagg.ledger.importing
    assert not decode.disagg.ledger.prefetching
    return outputs, handed


def _connector(name: str, prefill, decode):
    """(what the decode core reads the prefill pool through, the shared pool to close):
    the pool itself (torch), a CPU stand-in that reads outside the stream ("reads"), or
    NIXL where installed."""
    if name == "reads":
        return _ReadLater(prefill.runner.kv_pool, decode.runner.kv_pool, polls=12), None
    if name == "nixl":
        pytest.importorskip("nixl._api")
        shared = NixlConnector().share(prefill.runner.kv_pool)
        return OpenedPools(lambda: decode.runner.kv_pool).open(shared.handle), shared
    return None, None


def _requests():
    return [
        ("greedy", PROMPTS[0], SamplingParams(max_tokens=9, temperature=0.0)),
        ("seeded", PROMPTS[1], SamplingParams(max_tokens=7, temperature=0.9, seed=11)),
        ("fanout", PROMPTS[2], SamplingParams(max_tokens=6, temperature=1.0, top_p=0.8, n=3)),
        (
            "penalised",
            PROMPTS[3],
            SamplingParams(max_tokens=8, temperature=0.7, seed=3, repetition_penalty=1.3),
        ),
        ("one-token", PROMPTS[0], SamplingParams(max_tokens=1, temperature=0.0)),
        ("prompt-lp", PROMPTS[1], SamplingParams(max_tokens=5, prompt_logprobs=2, logprobs=1)),
    ]


def _assert_same(got: dict, expected: dict) -> None:
    assert got.keys() == expected.keys()
    for request_id, completions in expected.items():
        assert got[request_id].keys() == completions.keys(), request_id
        for index, want in completions.items():
            have = got[request_id][index]
            if index == "prompt":  # per position from 1: (logprob, rank, top (id, logprob))
                assert [(e[1], [t for t, _ in e[2]]) for e in have] == [
                    (e[1], [t for t, _ in e[2]]) for e in want
                ]
                for got_entry, want_entry in zip(have, want, strict=True):
                    assert got_entry[0] == pytest.approx(want_entry[0], abs=1e-4)
                    got_top, want_top = [v for _, v in got_entry[2]], [v for _, v in want_entry[2]]
                    assert got_top == pytest.approx(want_top, abs=1e-4)
                continue
            assert have[0] == want[0], (request_id, index)  # tokens
            assert have[1] == want[1], (request_id, index)  # exit depths
            assert have[2] == pytest.approx(want[2], abs=1e-4), (request_id, index)
            assert have[3] == want[3], (request_id, index)


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
@pytest.mark.parametrize("exit_mode", ["ouro", "random_lookahead"])
def test_a_handed_over_request_decodes_as_on_one_core(
    make_engine, make_pd_engine, layout, exit_mode
):
    """With random_lookahead at threshold 0.5 tokens exit at different depths, so the decode
    inputs handed over with a completion hold K/V of mixed depths."""
    settings = dict(
        layout=layout,
        async_scheduling=True,
        enable_prefix_caching=False,
        exit_config=ExitConfig(mode=exit_mode),
    )
    threshold = 0.5 if exit_mode == "random_lookahead" else None
    requests = [
        (rid, prompt, dataclasses.replace(params, exit_threshold=threshold))
        for rid, prompt, params in _requests()
    ]
    expected = _colocated(make_engine(**settings), requests)
    if exit_mode == "random_lookahead":
        depths = {
            depth
            for completions in expected.values()
            for index, completion in completions.items()
            if index != "prompt"
            for depth in completion[1]
        }
        assert len(depths) > 1, depths
    prefill, decode = make_pd_engine(**settings), make_pd_engine(**settings)
    got, handed = _disaggregated(prefill, decode, requests)
    _assert_same(got, expected)
    # Every request but the one that ended at its first token moved; only live
    # completions carry K/V, one prompt's worth each, at every plane (last_exited) or the
    # final one (shared_decode).
    assert sorted(h.request_id for h in handed) == sorted(
        rid for rid, _, _ in _requests() if rid != "one-token"
    )
    planes = prefill.runner.geo.planes
    assert planes == (prefill.num_loops if layout == "last_exited" else 1)
    for handover in handed:
        for completion in handover.completions:
            assert completion.finish_reason is None
            computed = len(handover.prompt_token_ids) + len(completion.output_token_ids) - 1
            assert handover.pool.planes == planes
            assert completion.kv.num_positions == computed
            size = handover.pool.block_size
            assert len(completion.kv.blocks) == -(-computed // size)
            config = prefill.model.config
            per_position = config.num_hidden_layers * 2 * config.num_key_value_heads
            per_position *= config.head_dim * 4 * planes  # float32 K and V at every plane
            assert completion.kv.nbytes == computed * per_position
    assert prefill.stats().num_passes > 0 and decode.stats().num_passes > 0


EARLY_MOVES = [
    (layout, async_scheduling, "torch")
    for layout in ("last_exited", "shared", "shared_decode")
    for async_scheduling in (False, True)
] + [
    (layout, async_scheduling, connector)
    for layout, async_scheduling in (("last_exited", True), ("shared_decode", False))
    for connector in ("reads", "nixl")
]


@pytest.mark.parametrize(("layout", "async_scheduling", "connector"), EARLY_MOVES)
def test_a_long_prompt_moves_its_finished_blocks_while_later_chunks_run(
    make_engine, make_pd_engine, layout, async_scheduling, connector
):
    """A prompt run in chunks of 8 positions lends each whole block a chunk finished; the
    decode core copies them into its prefix cache at once (a connector that reads outside
    the core's stream, "reads" or nixl where installed: caches them once read, and the
    import waits for those reads), and the import copies only what came after them.
    Outputs equal one core's, in every layout (under shared_decode the blocks hold the
    final plane)."""
    settings = dict(layout=layout, async_scheduling=async_scheduling, max_num_batched_tokens=8)
    prompt = [(7 * i) % 90 + 3 for i in range(37)]
    requests = [
        ("long", prompt, SamplingParams(max_tokens=5, temperature=0.0)),
        ("fanout", prompt[:30], SamplingParams(max_tokens=4, temperature=0.8, seed=2, n=2)),
    ]
    expected = _colocated(make_engine(**settings), requests)
    prefill, decode = make_pd_engine(**settings), make_pd_engine(**settings)
    lent = []
    take = prefill.disagg.take_prefetches
    prefill.disagg.take_prefetches = lambda: lent.extend(taken := take()) or taken
    copied_from = []
    import_kv = decode.runner.import_kv
    decode.runner.import_kv = lambda source, blocks, start=0: (
        copied_from.append(start) or import_kv(source, blocks, start)
    )
    source, shared = _connector(connector, prefill, decode)
    try:
        got, _ = _disaggregated(prefill, decode, requests, source)
    finally:
        if shared is not None:
            shared.close()
    _assert_same(got, expected)
    # Blocks of 4, each lent once, in order, with the prompt up to its end.
    long = [blocks for blocks in lent if blocks.request_id == "long"]
    ends = [b.first + len(b.blocks) for b in long]
    assert [b.first for b in long] == [0, *ends[:-1]] and len(long) >= 3
    assert all(len(b.prompt_token_ids) == 4 * end for b, end in zip(long, ends, strict=True))
    # The import copies only what was not lent (at most the prompt's last 8 positions),
    # or, read outside the core's stream, only what follows the last whole block.
    assert 4 * ends[-1] >= len(prompt) - 8 and all(copied_from)
    after = 4 * ends[-1] if connector == "torch" else 4 * (len(prompt) // 4)
    assert sorted(copied_from)[-1] == after
    assert decode.kv.num_cached_blocks >= ends[-1]


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_abort_while_blocks_are_lent_early_frees_both_cores(make_pd_engine, async_scheduling):
    """Aborted while its later chunks run: the blocks lent early stay until the decode
    core's copy is done, then both cores hold nothing (the copy stays in its prefix cache,
    evictable)."""
    settings = dict(async_scheduling=async_scheduling, max_num_batched_tokens=8)
    prefill, decode = make_pd_engine(**settings), make_pd_engine(**settings)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prefill.add_request("long", [(5 * i) % 80 + 3 for i in range(40)], params, handover=True)
    lent = []
    while not lent:
        prefill.step()
        lent += prefill.disagg.take_prefetches()
    assert prefill.abort_request("long").finished
    while prefill.has_unfinished:
        prefill.step()
    assert not prefill.disagg.take_prefetches() and not prefill.all_blocks_free()
    for blocks in lent:
        decode.disagg.prefetch_kv(blocks, prefill.runner.kv_pool)
    assert decode.disagg.collect_transfers()[0] == ["long"] * len(lent)
    assert prefill.disagg.ledger.release("long") and prefill.all_blocks_free()
    assert decode.kv.num_cached_blocks == sum(len(blocks.blocks) for blocks in lent)


class _ReadLater:
    """A connector that reads outside the core's stream (engine/disagg/nixl_connector.py),
    on the CPU:
    an early read ends at its `polls`-th poll, copied or failed; a handover's read at once."""

    in_stream = False

    def __init__(self, pool, ours, fail: bool = False, polls: int = 3) -> None:
        self.pool, self.ours, self.fail, self.polls = pool, ours, fail, polls
        self.geometry, self.block_size = pool.geometry, pool.block_size

    def read_into(self, blocks, targets, start) -> None:
        copy_kv(self.pool, blocks.blocks, self.ours, targets, start, blocks.num_positions)

    def start_read(self, blocks, targets, start, after):
        connector = self

        class Read:
            polls = 0

            def done(self) -> bool:
                self.polls += 1
                if self.polls < connector.polls:
                    return False
                if connector.fail:
                    raise RuntimeError("read failed")
                connector.read_into(blocks, targets, start)
                return True

        return Read()


def _first_lend(make_pd_engine):
    """A prefill and a decode core (chunks of 8), and the prompt blocks the prefill core
    lent first for a long prompt ("long") it still runs."""
    settings = dict(max_num_batched_tokens=8)
    prefill, decode = make_pd_engine(**settings), make_pd_engine(**settings)
    prompt = [(5 * i) % 80 + 3 for i in range(40)]
    prefill.add_request("long", prompt, SamplingParams(max_tokens=2), handover=True)
    lent = []
    while not lent:
        prefill.step()
        lent += prefill.disagg.take_prefetches()
    return prefill, decode, lent


@pytest.mark.parametrize("fail", [False, True])
def test_blocks_a_connector_reads_early_enter_the_cache_once_read(make_pd_engine, fail):
    """Until the read has ended its blocks are held and uncached (an import must not find
    them); then they are cached and released, or, if the read failed, only released."""
    prefill, decode, lent = _first_lend(make_pd_engine)
    source = _ReadLater(prefill.runner.kv_pool, decode.runner.kv_pool, fail)
    decode.disagg.prefetch_kv(lent[0], source)
    assert decode.kv.num_cached_blocks == 0 and not decode.kv.all_free()
    assert decode.disagg.collect_transfers()[0] == [] and decode.disagg.collect_transfers()[0] == []
    assert decode.disagg.collect_transfers()[0] == ["long"]
    assert decode.kv.all_free()  # released: cached and evictable, or free
    assert decode.kv.num_cached_blocks == (0 if fail else len(lent[0].blocks))
    assert prefill.abort_request("long").finished
    while prefill.has_unfinished:
        prefill.step()
    assert prefill.disagg.ledger.release("long") and prefill.all_blocks_free()


def test_aborts_around_the_handover_free_everything(make_pd_engine):
    """Aborted on the prefill core before the handover, or on the decode core before its
    admission and while it decodes: both cores end with every block and slot free (the
    fixture checks), and the aborted requests report their end once."""
    prefill, decode = make_pd_engine(), make_pd_engine()
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    for request_id in ("early", "queued", "running"):
        prefill.add_request(request_id, PROMPTS[0], params, handover=True)
    prefill.step()
    assert prefill.abort_request("early").finished
    handovers = []
    while len(handovers) < 2:
        prefill.step()
        handovers += prefill.disagg.take_handovers()
    assert not prefill.has_unfinished and not prefill.all_blocks_free()  # lent
    for handover in handovers:
        decode.disagg.import_request(handover)
    assert decode.abort_request("queued").finished  # never admitted: its source is unread
    assert decode.disagg.collect_transfers()[1] == ["queued"]
    assert prefill.disagg.ledger.release("queued") and not prefill.disagg.ledger.release("queued")
    decode.step()
    decode.step()
    assert decode.disagg.collect_transfers()[1] == ["running"]  # admitted, copied
    assert decode.abort_request("running").finished
    while decode.has_unfinished:
        decode.step()
    assert prefill.disagg.ledger.release("running") and prefill.all_blocks_free()


def test_copies_are_reported_once_every_tensor_parallel_rank_has_made_them(make_pd_engine):
    """Under tensor parallelism each rank copies its own heads: a prefetch or an import is
    reported (and its source blocks freed) only once every rank says its copy is done."""
    settings = dict(max_num_batched_tokens=8)
    prefill, decode = make_pd_engine(**settings), make_pd_engine(**settings)
    prompt = [(3 * i) % 70 + 5 for i in range(30)]
    prefill.add_request("long", prompt, SamplingParams(max_tokens=3), handover=True)
    lent, handovers = [], []
    while not handovers:
        prefill.step()
        lent += prefill.disagg.take_prefetches()
        handovers += prefill.disagg.take_handovers()
    assert lent
    other = ([], [])  # what the other rank has seen end; in other calls it agrees

    def gathered(view):
        return [view, other] if isinstance(view, tuple) else [view, view]

    decode.disagg._gathered = gathered
    for blocks in lent:
        decode.disagg.prefetch_kv(blocks, prefill.runner.kv_pool)
    decode.disagg.import_request(handovers[0])
    while decode.has_unfinished:
        decode.step()
    assert decode.disagg.collect_transfers() == ([], [])  # the other rank's copies still run
    other = decode.disagg.ledger.ended()
    assert decode.disagg.collect_transfers() == (["long"] * len(lent), ["long"])
    for _ in range(len(lent) + 1):
        assert prefill.disagg.ledger.release("long")
    assert prefill.all_blocks_free() and decode.all_blocks_free()


def test_an_import_with_a_taken_id_or_a_wrong_shape_changes_nothing(make_pd_engine):
    prefill, decode = make_pd_engine(), make_pd_engine(layout="shared_decode")
    params = SamplingParams(max_tokens=4, temperature=0.0)
    prefill.add_request("r", PROMPTS[1], params, handover=True)
    handovers = []
    while not handovers:
        prefill.step()
        handovers = prefill.disagg.take_handovers()
    decode.add_request("r", PROMPTS[0], params)
    with pytest.raises(ValueError, match="already in use"):
        decode.disagg.import_request(handovers[0])
    assert decode.disagg.collect_transfers()[1] == [
        "r"
    ]  # refused: the prefill core may free its blocks
    decode.abort_request("r")
    # Four planes of K/V into a one-plane pool: the request fails alone, nothing leaks.
    decode.disagg.import_request(handovers[0])
    errors = []
    while decode.has_unfinished:
        errors += [d.error for d in decode.step() if d.error]
    assert errors and "expected" in errors[0]
    assert decode.disagg.collect_transfers()[1] == ["r"]
    assert prefill.disagg.ledger.release("r") and prefill.all_blocks_free()


@pytest.mark.parametrize("num_blocks", [12, 13, 14, 16, 20])
def test_completions_preempted_before_their_siblings_start_decoding(
    make_engine, make_pd_engine, num_blocks
):
    """A small prefill pool preempts completions of an n > 1 request while their siblings
    already decode: the request is handed over only once every completion decodes again,
    and the outputs still equal one core's."""
    settings = dict(
        async_scheduling=True,
        enable_prefix_caching=False,
        exit_config=ExitConfig(mode="random_lookahead"),
    )
    common = dict(max_tokens=30, temperature=0.8, exit_threshold=0.5, ignore_eos=True)
    requests = [
        ("a", list(range(20, 36)), SamplingParams(seed=1, n=3, **common)),
        ("b", list(range(40, 56)), SamplingParams(seed=2, n=2, **common)),
    ]
    expected = _colocated(make_engine(**settings), requests)
    prefill = make_pd_engine(**settings, num_blocks=num_blocks, max_num_batched_tokens=8)
    got, _ = _disaggregated(prefill, make_pd_engine(**settings), requests)
    _assert_same(got, expected)


def test_speculating_requests_draft_on_their_decode_core_as_on_one_core(
    make_engine, make_pd_engine
):
    spec = SpeculativeConfig(num_speculative_tokens=3, draft_loops=1)
    settings = dict(
        async_scheduling=True,
        enable_prefix_caching=False,
        exit_config=ExitConfig(mode="random_lookahead"),
        speculative_config=spec,
    )
    requests = [
        (rid, prompt, dataclasses.replace(params, exit_threshold=0.5))
        for rid, prompt, params in _requests()
        if rid in ("greedy", "seeded", "fanout")
    ]
    expected = _colocated(make_engine(**settings), requests)
    prefill, decode = make_pd_engine(**settings), make_pd_engine(**settings)
    got, _ = _disaggregated(prefill, decode, requests)
    _assert_same(got, expected)
    assert decode.scheduler.num_drafted > 0


def test_a_pool_full_of_lent_blocks_holds_back_new_prompts_until_released(make_pd_engine):
    """Blocks lent to a slow decode core may fill the prefill core's pool: new prompts wait
    (no pass runs, nothing fails) and go on once the blocks come back."""
    prefill = make_pd_engine(num_blocks=12, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    handovers = []
    for request_id in ("a", "b", "c"):
        prefill.add_request(request_id, list(range(30, 44)), params, handover=True)
    while len(handovers) < 3:
        prefill.step()
        handovers += prefill.disagg.take_handovers()
    prefill.add_request("d", list(range(50, 64)), params, handover=True)
    for _ in range(3):
        assert prefill.step() == [] and prefill.held_back
    for handover in handovers:
        assert prefill.disagg.ledger.release(handover.request_id)
    while not prefill.disagg.take_handovers():
        prefill.step()
    assert not prefill.held_back
    assert prefill.disagg.ledger.release("d") and prefill.all_blocks_free()


@pytest.mark.parametrize("layout", ["last_exited", "shared_decode"])
@pytest.mark.parametrize("connector", ["torch", "reads", "nixl"])
def test_a_decode_core_copies_only_what_its_prefix_cache_lacks(
    make_engine, make_pd_engine, layout, connector
):
    """Imports of prompts that share their first blocks: the decode core copies those
    blocks once (every plane, or under shared_decode the final one) and takes them from its
    prefix cache afterwards; the outputs still equal one core's. A connector that reads
    outside the core's stream ("reads", or nixl where installed) reads an import's whole
    prompt blocks ahead of its admission, whose read then starts after them."""
    shared = list(range(20, 37))  # 17 tokens: four whole blocks of 4
    requests = [
        ("first", shared + [5, 6, 7], SamplingParams(max_tokens=6, temperature=0.0)),
        ("second", shared + [9], SamplingParams(max_tokens=6, temperature=0.8, seed=4, n=2)),
        ("third", shared[:10], SamplingParams(max_tokens=5, temperature=0.0)),
    ]
    settings = dict(layout=layout, async_scheduling=True)
    expected = _colocated(make_engine(**settings), requests)
    prefill, decode = make_pd_engine(**settings), make_pd_engine(**settings)
    starts = []
    copy = decode.runner.import_kv

    def counted(source, blocks, start=0):
        starts.append(start)
        copy(source, blocks, start)

    decode.runner.import_kv = counted
    source, shared = _connector(connector, prefill, decode)
    # The first request alone, then the others: imports admitted in one round copy
    # whole (their blocks enter the cache once their copies are queued).
    try:
        got, _ = _disaggregated(prefill, decode, requests[:1], source)
        got.update(_disaggregated(prefill, decode, requests[1:], source)[0])
    finally:
        if shared is not None:
            shared.close()
    _assert_same(got, expected)
    # One per live completion: the first copies everything (or, read ahead, all but its
    # last partial block); the second's two completions find four blocks, the third finds
    # its two whole blocks.
    assert sorted(starts) == ([0, 8, 16, 16] if connector == "torch" else [8, 16, 16, 20])


def test_an_import_preempted_in_the_round_that_admitted_it_caches_nothing(
    make_engine, make_pd_engine
):
    """A small decode pool preempts an import in the round that admitted it (before its
    copy): its blocks must not enter the prefix cache, or its recomputation would skip
    K/V that was never written."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    long_prompt, prompt = list(range(40, 80)), list(range(100, 116))
    requests = [
        ("long", long_prompt, SamplingParams(max_tokens=4, **greedy)),
        ("imp", prompt, SamplingParams(max_tokens=12, **greedy)),
    ]
    expected = _colocated(make_engine(), requests)
    prefill = make_pd_engine()
    outputs: dict = {}
    prefill.add_request("imp", prompt, requests[1][2], handover=True)
    handovers = []
    while not handovers:
        for delta in prefill.step():
            _collect(outputs, delta)
        handovers = prefill.disagg.take_handovers()
    decode = make_pd_engine(
        num_blocks=12, prefill_chunk_size=8, max_num_batched_tokens=64, max_num_seqs=4
    )
    preempted = []
    preempt = decode.scheduler._preempt

    def recorded(request):
        preempted.append((request.request_id, request.status.name))
        preempt(request)

    decode.scheduler._preempt = recorded
    decode.add_request("long", long_prompt, requests[0][2])
    for _ in range(12):
        for delta in decode.step():
            _collect(outputs, delta)
    decode.disagg.import_request(handovers[0])
    while decode.has_unfinished:
        for delta in decode.step():
            _collect(outputs, delta)
        _release_copied(prefill, decode)
    _release_copied(prefill, decode)
    assert ("imp", "DECODE") in preempted  # in the round that admitted it
    assert outputs["imp"][0][0] == expected["imp"][0][0]


def test_a_failed_import_copy_leaves_no_unwritten_block_in_the_prefix_cache(
    make_engine, make_pd_engine
):
    prompt = list(range(100, 116)) + [7, 8]  # four whole blocks
    fanout = SamplingParams(max_tokens=6, temperature=0.8, seed=3, n=2, ignore_eos=True)
    later = [("later", prompt, SamplingParams(max_tokens=8, temperature=0.0))]
    expected = _colocated(make_engine(), later)
    prefill, decode = make_pd_engine(), make_pd_engine()
    prefill.add_request("imp", prompt, fanout, handover=True)
    handovers = []
    while not handovers:
        prefill.step()
        handovers = prefill.disagg.take_handovers()
    copy, calls = decode.runner.import_kv, []

    def failing_once(source, blocks, start=0):
        calls.append(start)
        if len(calls) == 1:
            raise RuntimeError("copy failed")
        copy(source, blocks, start)

    decode.runner.import_kv = failing_once
    decode.disagg.import_request(handovers[0])
    errors = []
    while decode.has_unfinished:
        errors += [d.error for d in decode.step() if d.error]
    _release_copied(prefill, decode)
    assert errors and "copy failed" in errors[0]
    assert _colocated(decode, later) == expected


def test_a_prompt_arriving_in_pieces_is_hashed_once_and_a_reused_id_afresh(make_pd_engine):
    """A decode core keeps the block hashes of a prompt's earlier pieces (each later piece
    hashes only its own blocks), but a request id that comes back with another prompt is
    hashed afresh: its blocks must never be taken for the old prompt's."""
    ledger, salt = make_pd_engine().disagg.ledger, b"salt"
    prompt = list(range(40))
    whole = block_hashes(salt, prompt, 4)
    assert block_hashes(salt, prompt, 4, whole[:3]) == whole
    assert ledger.prompt_hashes("r", salt, prompt[:12], 4) == whole[:3]
    assert ledger.prompt_hashes("r", salt, prompt[:28], 4) == whole[:7]
    other = [7] + prompt[1:28]
    assert ledger.prompt_hashes("r", salt, other, 4) == block_hashes(salt, other, 4)
    assert ledger.prompt_hashes("r", salt, other, 4)[0] != whole[0]


def test_an_early_read_that_failed_on_another_rank_is_cached_on_none(make_pd_engine):
    """Each rank reads its own heads: blocks whose read worked here but failed on another
    rank are freed, not cached, on every rank (their prefix caches must stay equal)."""
    prefill, decode, lent = _first_lend(make_pd_engine)
    decode.disagg.prefetch_kv(lent[0], _ReadLater(prefill.runner.kv_pool, decode.runner.kv_pool))

    def gathered(view):  # the other rank saw every read end, and fail
        if isinstance(view, tuple):
            return [view, ([(serial, False) for serial, _ in view[0]], view[1])]
        return [view, view]

    decode.disagg._gathered = gathered
    while not (reported := decode.disagg.collect_transfers())[0]:
        pass
    assert reported == (["long"], [])
    assert decode.kv.all_free() and decode.kv.num_cached_blocks == 0
    assert prefill.abort_request("long").finished
    while prefill.has_unfinished:
        prefill.step()
    assert prefill.disagg.ledger.release("long") and prefill.all_blocks_free()


def test_imports_of_a_reused_id_are_reported_oldest_first_one_each(make_pd_engine):
    """An id may come back before an aborted import of it is reported: each import is
    reported once, the oldest first (the prefill core frees its lends in that order)."""
    decode = make_pd_engine()
    decode.disagg.refuse_import("r")
    decode.disagg.refuse_import("r")
    assert decode.disagg.collect_transfers() == ([], ["r"])
    assert decode.disagg.collect_transfers() == ([], ["r"])
    assert decode.disagg.collect_transfers() == ([], []) and not decode.disagg.ledger.importing


def test_a_pool_another_rank_cannot_open_refuses_the_import_on_every_rank(make_pd_engine):
    prefill, decode = make_pd_engine(), make_pd_engine()
    prefill.add_request("r", PROMPTS[1], SamplingParams(max_tokens=4), handover=True)
    handovers = []
    while not handovers:
        prefill.step()
        handovers = prefill.disagg.take_handovers()
    decode.disagg._gathered = lambda view: (
        [view, "RuntimeError: cannot map"] if view is None else [view]
    )
    with pytest.raises(RuntimeError, match="another tensor-parallel rank cannot open the pool"):
        decode.disagg.import_request(handovers[0])
    assert not decode.has_unfinished and decode.disagg.collect_transfers() == ([], ["r"])
    assert prefill.disagg.ledger.release("r") and prefill.all_blocks_free()


def test_an_engine_built_without_disaggregation_has_none_of_it_and_runs(make_engine):
    engine = make_engine()
    assert engine.disagg is None
    outputs = _colocated(engine, _requests()[:3])
    assert all(c[3] is not None for r in outputs.values() for i, c in r.items() if i != "prompt")
    with pytest.raises(ValueError, match="handover needs an engine built for disaggregation"):
        engine.add_request("h", PROMPTS[0], SamplingParams(max_tokens=2), handover=True)
    assert not engine.has_unfinished and engine.all_blocks_free()


class _Ranks:
    """A follower's view of its tensor-parallel group: the calls rank 0 mirrored."""

    def __init__(self, calls) -> None:
        self.calls = list(calls)

    def receive(self):
        return self.calls.pop(0)

    def close(self) -> None:
        pass


def test_the_calls_of_disaggregation_are_mirrored_to_the_other_ranks_by_dotted_name(
    make_pd_engine,
):
    leader, follower = make_pd_engine(), make_pd_engine()
    sent = []
    leader.mirror = lambda name, args, kwargs: sent.append((name, args, kwargs))
    leader.disagg.refuse_import("r")
    leader.add_request("a", PROMPTS[0], SamplingParams(max_tokens=2))
    assert sent[0] == ("disagg.refuse_import", ("r",), {}) and sent[1][0] == "add_request"
    follow(follower, _Ranks([*sent, ("stop", (), {})]))
    assert list(follower.disagg.ledger.importing) == ["r"] and "a" in follower.groups
    for engine in (leader, follower):
        engine.mirror = None
        assert engine.abort_request("a").finished
        assert engine.disagg.collect_transfers() == ([], ["r"])
