"""Self-speculative rounds: the model's first loops draft, its remaining loops verify.

A round starts at position `start`, whose input is the request's last committed token. Each
draft step runs one position through the draft loops and yields a draft token, the next
position's input. Once `size` positions have been drafted, one verify chunk runs all of them
through the remaining loops as a causal chunk (each reads the ones before it at every loop),
from the states the draft steps left. Its greedy tokens are the target's: the draft tokens
are accepted while they agree with them, and the target token where they first differ (or
after the last) is committed too. Drafting writes loops 1..d of each position and verifying
loops d+1..D, exactly what decoding those tokens one by one at depth D writes, so the result
is the non-speculative greedy output; K/V of rejected positions is overwritten when those
positions are computed again, before anything reads it.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SpecRound:
    start: int  # position of the round's first input, the last committed token
    inputs: list[int]  # that token, then each draft token as it becomes known
    size: int  # positions the round verifies (1 + its draft tokens)
    draft_loops: int
    target_loops: int
    loop: int = 0  # next loop of the draft step or verify chunk to schedule
    verifying: bool = False
    pending: bool = False  # a scheduled step's or chunk's result has not come back

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

    def accept(self, targets: tuple[int, ...]) -> int:
        """How many of the verified positions' target tokens to commit: the agreeing draft
        tokens, and one more."""
        accepted = 0
        while accepted < self.size - 1 and self.inputs[accepted + 1] == targets[accepted]:
            accepted += 1
        return accepted + 1
