"""Exit policies: tensor functions from (gate, loop, per-row params, state) to exit decisions."""

from vllm_rlt.exit.policies import EXIT_POLICIES, ExitInputs, ExitPolicy, make_exit_policy

__all__ = ["EXIT_POLICIES", "ExitInputs", "ExitPolicy", "make_exit_policy"]
