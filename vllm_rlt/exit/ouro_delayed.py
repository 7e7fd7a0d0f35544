"""The `ouro_delayed` policy: `ouro`'s CDF, but a trigger at loop r exits after loop r + 1."""

from __future__ import annotations

from vllm_rlt.exit.ouro import OuroPolicy


class OuroDelayedPolicy(OuroPolicy):
    delayed = True
    fresh = {"survival": 1.0, "pending": False}  # pending: a trigger fired on the last loop
