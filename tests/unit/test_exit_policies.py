"""The exit policy registry and the trace policy's own per-slot state."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from vllm_rlt.config import EXIT_MODES, ExitConfig
from vllm_rlt.core.contract import NewSlot
from vllm_rlt.exit.policy import ExitInputs, ExitPolicy
from vllm_rlt.exit.registry import EXIT_POLICIES, make_exit_policy


def test_every_exit_mode_names_an_exit_policy():
    """Each name of `config.EXIT_POLICY_CLASSES` imports a policy class of its own."""
    classes = {name: make.__self__ for name, make in EXIT_POLICIES.items()}
    assert ("auto", *classes) == EXIT_MODES
    assert all(issubclass(cls, ExitPolicy) for cls in classes.values())
    assert len(set(classes.values())) == len(classes)


def _inputs(slots: list[int], num_generated: list[int], loops_done: list[int], carried=None):
    rows = len(slots)
    return ExitInputs(
        hidden=torch.zeros(rows, 4),
        slots=torch.tensor(slots),
        num_generated=torch.tensor(num_generated),
        loops_done=torch.tensor(loops_done),
        min_loops=torch.ones(rows, dtype=torch.int64),
        max_loops=torch.full((rows,), 4),
        exit_threshold=torch.ones(rows),
        carried=carried or {},
    )


def test_trace_policy_replays_each_admitted_requests_depths():
    config = ExitConfig(mode="trace", depths_by_request={"a": (4, 1, 3), "b": (4, 2, 2)})
    policy = make_exit_policy(config, model=None)
    policy.bind(4, torch.device("cpu"))
    # slot 2 holds a completion of an n > 1 request "b": it replays b's depths
    news = [NewSlot(slot=0, request_id="a", prompt_len=3, sampling=None)]  # type: ignore[arg-type]
    news.append(NewSlot(slot=2, request_id="b#1", prompt_len=3, sampling=None))  # type: ignore[arg-type]
    policy.admit(news, torch.tensor([0, 2]), lambda values: values)
    # token 1 of "a" exits at depth 1, token 2 at depth 3; "b#1" at 2 for both
    decision = policy.decide(_inputs([0, 0, 0, 2, 2], [1, 2, 2, 1, 2], [1, 2, 3, 1, 2]))
    assert decision.exit.tolist() == [True, False, True, False, True]


def test_a_policy_carries_its_own_values_from_loop_to_loop():
    """ouro_delayed keeps each slot's survival and pending trigger: a trigger at loop r
    exits after loop r + 1, and an exited row starts its next token fresh."""
    model = SimpleNamespace(gate=lambda hidden: torch.full((hidden.shape[0],), 10.0))
    policy = make_exit_policy(ExitConfig(mode="ouro_delayed"), model)
    policy.bind(3, torch.device("cpu"))
    slots = torch.tensor([1])
    policy.admit([], slots, lambda values: values)
    threshold = torch.tensor([0.5])
    decisions = []
    for loop in (1, 2):
        inputs = _inputs([1], [1], [loop], policy.gather(slots))
        inputs.exit_threshold = threshold
        decision = policy.decide(inputs)
        policy.store(slots, decision.carried, decision.exit)
        decisions.append(bool(decision.exit))
    assert decisions == [False, True]
    assert policy.carried["survival"][1] == 1.0 and not policy.carried["pending"][1]
