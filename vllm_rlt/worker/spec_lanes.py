"""Pipelined self-speculation, decided on the device.

A looped model drafts with its own first d loops. A speculating request holds a ring of
lanes, each a decode row of its own slot (slot + j * max_num_seqs), all in one pass:

- A lane runs one position through the loops like any decode row.
- When it finishes loop d, the LM head on that state drafts the next token. The next lane
  of the ring starts that position at loop 1 in the following pass. Meanwhile the drafting
  lane goes on with loops d + 1 .. D.
- When a lane finishes loop D it knows the target token of the next position and checks
  the draft there. Greedy: accept when equal. Sampled: accept y with probability
  min(1, p(y) / q(y)), else draw from max(0, p - q), normalised. The committed token is
  the target's either way.
- Accepted: the next lane carries on, d passes ahead of where plain decoding would be.
- Refused (or nothing was drafted): every lane of the request stops, and its own lane
  restarts the next position with the committed token.

Why it is exact: position t + 1 at loop j reads plane j of positions <= t. Position t wrote
that plane at loop j, d passes before, so t + 1 reads what plain decoding would have
written. A refused position's writes are overwritten when it runs again, before anything
reads them. So each committed token has the target's distribution.

The cost: a token takes d passes when its draft is accepted and D when it is refused. At
acceptance p that is d + (1 - p)(D - d) passes per token instead of D. Which lanes work is
decided here, on the device, so the host schedules every lane of the request every pass
(an idle lane's row reads and writes only the dummy block) and never reads a draft back.
When the host turns drafting off (under load), a request's lanes stop at its next refused
or undrafted token, and from then on it decodes in its own slot as a plain row.
"""

from __future__ import annotations

import torch

from vllm_rlt.config import (
    CacheConfig,
    KVLayout,
    SchedulerConfig,
    SpeculativeConfig,
    require,
)
from vllm_rlt.layers.sampler import filtered_probs, sample_from, seeded_uniform


def lanes_per_request(num_loops: int, draft_loops: int, max_ahead: int) -> int:
    """Positions a speculating request computes at once: a new one starts every d passes
    and each takes at most D passes, and no more than `max_ahead` of them run on drafts."""
    return min(-(-num_loops // draft_loops), max_ahead + 1)


def check_speculation(
    config: SpeculativeConfig,
    num_loops: int,
    cache_config: CacheConfig,
    scheduler_config: SchedulerConfig,
    num_lanes: int,
) -> None:
    """Every setting speculation cannot work with, as one clear error naming it."""
    require(
        config.draft_loops < num_loops,
        f"draft_loops must be in [1, {num_loops - 1}] (below the model's {num_loops} loops), "
        f"got {config.draft_loops}",
        "draft_loops",
    )
    require(
        cache_config.layout is KVLayout.LAST_EXITED,
        "speculative decoding needs the last_exited KV layout (a drafted position reads each "
        f"earlier position at its own loop), got {cache_config.layout.value!r}",
        "kv_layout",
    )
    rows = scheduler_config.max_num_seqs * num_lanes
    require(
        rows <= scheduler_config.max_num_batched_tokens,
        f"max_num_batched_tokens must be at least max_num_seqs x {num_lanes} = {rows} (a "
        f"speculating request decodes in {num_lanes} rows per pass), got "
        f"{scheduler_config.max_num_batched_tokens}",
        "max_num_batched_tokens",
    )
    require(
        scheduler_config.mode == "refill",
        f"speculative decoding needs the refill scheduling mode, got {scheduler_config.mode!r}",
        "mode",
    )


class SpecLanes:
    """Per-slot device state of the lanes, and the step that runs after each pass.

    Slots [0, num_seqs) are requests' own slots; lane j of slot s is s + j * num_seqs (lane
    0 is the slot itself). The last index is the runner's dummy slot: masked writes go
    there. Per-request values (`verified`, `last_position`) live at the request's slot.
    """

    def __init__(
        self,
        num_seqs: int,
        num_lanes: int,
        draft_loops: int,
        max_ahead: int,
        vocab_size: int,
        device: torch.device,
        replay_acceptance_rate: float | None = None,
    ) -> None:
        n = num_seqs * num_lanes + 1
        i64 = dict(dtype=torch.int64, device=device)
        self.num_seqs, self.num_lanes = num_seqs, num_lanes
        self.draft_loops, self.max_ahead = draft_loops, max_ahead
        self.dummy = n - 1
        self.is_lane = torch.zeros(n, dtype=torch.bool, device=device)
        self.active = torch.zeros(n, dtype=torch.bool, device=device)
        self.drafted = torch.zeros(n, dtype=torch.bool, device=device)  # token is a draft
        # its exit came while its token was still a draft: it waits, state kept, until the
        # lane before it accepts that token
        self.held = torch.zeros(n, dtype=torch.bool, device=device)
        self.ahead = torch.zeros(n, **i64)  # drafts ahead of the verified token, at drafting
        self.next = torch.arange(n, **i64)  # the lane that computes the following position
        self.owner = torch.arange(n, **i64)  # the request's own slot
        self.verified = torch.zeros(n, **i64)  # per request: position of its newest final token
        self.last_position = torch.zeros(n, **i64)  # per request: the last worth computing
        self.draft_probs = torch.zeros(n, vocab_size, dtype=torch.float32, device=device)
        # whether lanes may draft in the current pass (set by the host before each pass)
        self.drafting = torch.ones(1, **i64)
        self.replay_acceptance_rate = replay_acceptance_rate

    def lane_slots(self, slot: int) -> list[int]:
        return [slot + j * self.num_seqs for j in range(self.num_lanes)]

    def admit(self, slot: int, speculates: bool, position: int, last_position: int) -> None:
        """A request enters `slot`: lane 0 starts at `position`, whose token is final (the
        slot state holds it, or the prompt's sampling writes it)."""
        lanes = self.lane_slots(slot)
        for j, lane in enumerate(lanes):
            self.is_lane[lane] = speculates
            self.active[lane] = speculates and j == 0
            self.drafted[lane] = False
            self.held[lane] = False
            self.ahead[lane] = 0
            self.next[lane] = lanes[(j + 1) % len(lanes)] if speculates else lane
            self.owner[lane] = slot
        self.verified[slot] = position
        self.last_position[slot] = last_position

    def idle_rows(self, slots, positions, loops):
        """(slot whose block table each decode row uses, position, loop, whether the row
        writes no K/V): an idle lane's row, or a held one whose token is still a draft,
        runs loop 0 at position 0 on the dummy slot's table (the dummy block). A held lane
        whose token was accepted exits in this pass: its row runs loop 0 at its own
        position, so that the layers after the loop (Huginn's coda) run for it where its
        token is. Neither writes K/V (their outputs are dropped), so a layer that runs
        only for rows that write (Huginn's prelude) streams nothing for them."""
        is_lane, held = self.is_lane[slots], self.held[slots]
        idle = is_lane & (~self.active[slots] | (held & self.drafted[slots]))
        parked = is_lane & (idle | held)
        table_slots = torch.where(idle, self.dummy, self.owner[slots])
        return table_slots, positions.masked_fill(idle, 0), loops.masked_fill(parked, 0), parked

    def holding(self, slots) -> torch.Tensor:
        """[rows] bool: lanes held at the start of this pass (their state is the slot's)."""
        return self.is_lane[slots] & self.active[slots] & self.held[slots]

    def events(self, slots, positions, loops_done, exits):
        """Per row: (exits this pass, drafts this pass, held at the start of this pass, starts
        holding). A lane whose exit decision comes while its token is a draft holds (its
        exit depth and state are kept) and exits in the pass after the lane before it
        accepts that token; one finishing loop d below its request's last position drafts."""
        is_lane, active = self.is_lane[slots], self.active[slots]
        working = ~is_lane | active
        held = self.holding(slots)
        drafted = self.drafted[slots]
        owners = self.owner[slots]
        # A lane whose token is not a draft holds a final token (after passes without lanes,
        # the request's `verified` may lag behind it).
        final = is_lane & active & ~drafted
        self.verified.scatter_reduce_(0, torch.where(final, owners, self.dummy), positions, "amax")
        gate = exits & working & ~held
        hold = gate & is_lane & drafted
        exited = (gate & ~hold) | (held & ~drafted)
        drafting = (
            (self.drafting > 0)
            & is_lane
            & active
            & ~held
            & ~gate
            & (loops_done == self.draft_loops)
            & (positions + 1 <= self.last_position[owners])
        )
        return exited, drafting, held, hold

    def choose(self, state, slots, positions, logits, exited, plain, greedy: bool):
        """Tokens of the lane rows: the committed token where a lane exits, the draft where
        it drafts. A token with no draft to check is `plain`, the draw plain decoding
        makes (the argmax on a greedy row: lanes have no logit adjustments). Returns
        (tokens, accepted, had_draft, probs or None)."""
        lane_exit = exited & self.is_lane[slots]
        succ = self.next[slots]
        had_draft = (
            lane_exit
            & self.active[succ]
            & self.drafted[succ]
            & (state.position[succ] == positions + 1)
        )
        drafted_token = state.token[succ]
        target = plain  # greedy rows
        index = state.num_generated[slots]  # output index of the token these rows choose
        settings = state.sampling.rows(slots)
        seeds = settings.seed
        probs = None
        if greedy:
            accepted = had_draft & (target == drafted_token)
            tokens = target
        else:
            temperature = settings.temperature
            settings.temperature = torch.where(temperature > 0, temperature, 1.0)
            probs = filtered_probs(logits, settings)
            rows = torch.arange(slots.shape[0], device=slots.device)
            q = self.draft_probs[succ] * had_draft.unsqueeze(1)
            uniform = seeded_uniform(seeds, index * 3 + 1, 1)[:, 0]
            take = uniform * q[rows, drafted_token] <= probs[rows, drafted_token]
            residual = (probs - q).clamp_min(0.0)
            residual = torch.where(residual.sum(1, keepdim=True) > 0, residual, probs)
            replaced = sample_from(residual, seeds, index * 3 + 2)
            committed = torch.where(had_draft, torch.where(take, drafted_token, replaced), plain)
            draft = sample_from(probs, seeds, index * 3)
            greedy_row = temperature == 0
            accepted = had_draft & torch.where(greedy_row, target == drafted_token, take)
            tokens = torch.where(greedy_row, target, torch.where(exited, committed, draft))
        if self.replay_acceptance_rate is not None:
            uniform = seeded_uniform(seeds, index * 3 + 1, 1)[:, 0]
            accepted = had_draft & (uniform < self.replay_acceptance_rate)
            tokens = torch.where(accepted, drafted_token, tokens)
        return tokens, accepted, had_draft, probs

    def drafted_ahead(self, slots) -> torch.Tensor:
        """How far ahead of the verified token the next position's draft was made."""
        return self.ahead[self.next[slots]]

    def step(
        self, state, exit_policy, slots, positions, exited, drafting, hold, accepted, tokens, probs
    ) -> None:
        """After the pass's ordinary row update (an exiting row moved on to the next
        position with its committed token): hold, free or restart the lanes, then start
        drafts."""
        dummy = self.dummy
        lane_exit = exited & self.is_lane[slots]
        owners = self.owner[slots]
        # index_fill_ for constants: no host-to-device copy inside a CUDA graph
        self.held.index_fill_(0, torch.where(hold, slots, dummy), True)
        exiting = torch.where(lane_exit, slots, dummy)
        self.held.index_fill_(0, exiting, False)
        self.active.index_fill_(0, exiting, False)
        # An accepted draft is a final token now (a held lane with it exits next pass).
        accepted_next = torch.where(lane_exit & accepted, self.next[slots], dummy)
        self.drafted.index_fill_(0, accepted_next, False)
        # Refused or undrafted: every lane stops, and the next position restarts in the
        # request's own lane (so the host knows which lane works once drafting stops).
        refused = lane_exit & ~accepted
        killed = torch.zeros_like(self.active)
        for j in range(self.num_lanes):
            killed.index_fill_(0, torch.where(refused, owners + j * self.num_seqs, dummy), True)
        self.active &= ~killed
        restart = torch.where(refused, owners, dummy)
        for field in (state.token, state.position, state.num_generated):
            field[restart] = field[slots]
        state.loop.index_fill_(0, restart, 0)
        exit_policy.start(restart)
        self.active.index_fill_(0, restart, True)
        self.drafted.index_fill_(0, restart, False)
        self.held.index_fill_(0, restart, False)
        self.ahead.index_fill_(0, restart, 0)
        self.verified[torch.where(lane_exit, owners, dummy)] = positions + 1
        ahead = positions + 1 - self.verified[owners]
        spawn = drafting & ~killed[slots] & (ahead <= self.max_ahead)
        child = torch.where(spawn, self.next[slots], dummy)
        state.token[child] = tokens
        state.position[child] = positions + 1
        state.loop.index_fill_(0, child, 0)
        state.num_generated[child] = state.num_generated[slots] + 1
        exit_policy.start(child)
        self.active.index_fill_(0, child, True)
        self.drafted.index_fill_(0, child, True)
        self.held.index_fill_(0, child, False)
        self.ahead[child] = ahead
        if probs is not None:
            self.draft_probs[child] = probs
