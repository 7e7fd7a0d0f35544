"""Self-speculative rounds: the model's first loops draft, its remaining loops verify.

A round starts at position `start`, whose input is the request's last committed token. Each
draft step runs one position through the draft loops and yields a draft token, the next
position's input. Once `size` positions have been drafted, one verify chunk runs all of them
through the remaining loops as a causal chunk (each reads the ones before it at every loop),
from the states the draft steps left. Drafting writes loops 1..d of each position and
verifying loops d+1..D: exactly what decoding those tokens one by one at depth D writes, so
the target's distribution at each position is the non-speculative one. K/V of rejected
positions is overwritten when those positions are computed again, before anything reads it.

Greedy: the draft tokens are accepted while they agree with the target's tokens, and the
target token where they first differ (or after the last) is committed too, so the output is
plain greedy decoding's. Sampled: each draft token y, drawn from the draft distribution q, is
accepted with probability min(1, p(y) / q(y)) under the target distribution p; the first
refused one is replaced by a draw from the residual max(0, p - q) (normalised), and a round
whose drafts are all accepted adds a draw from p, so the committed tokens follow the target's
distribution.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecRound:
    start: int  # position of the round's first input, the last committed token
    inputs: list[int]  # that token, then each draft token as it becomes known
    size: int  # positions the round verifies (1 + its draft tokens)
    first_index: int  # output index of the round's first new token
    draft_loops: int
    target_loops: int
    loop: int = 0  # next loop of the draft step or verify chunk to schedule
    verifying: bool = False
    pending: bool = False  # a scheduled step's or chunk's result has not come back

    @property
    def rows_next_pass(self) -> int:
        """Rows the round takes in the next pass: none while it waits for a result."""
        if self.pending:
            return 0
        return self.size if self.verifying else 1

    @property
    def step(self) -> int:
        """The draft step in flight: the position offset it computes."""
        return len(self.inputs) - 1

    def advance(self) -> None:
        """A pass of the current step or chunk was scheduled."""
        self.loop += 1
        if not self.verifying and self.loop == self.draft_loops:
            if self.step == self.size - 1:  # every position drafted: verify next
                self.verifying = True
            else:
                self.pending = True  # the next input is this step's draft token
                self.loop = 0
        elif self.verifying and self.loop == self.target_loops:
            self.pending = True

    def on_draft(self, token: int) -> None:
        """A draft step's token: the next position's input (the last step's has no use)."""
        if len(self.inputs) < self.size:
            self.inputs.append(token)
            self.pending = False

    def accept(self, accepted: tuple[bool, ...]) -> int:
        """How many draft tokens to keep: those before the first the verify chunk refused
        (greedy: that differs from the target's token; sampled: that rejection sampling
        refused)."""
        kept = 0
        while kept < self.size - 1 and accepted[kept]:
            kept += 1
        return kept
