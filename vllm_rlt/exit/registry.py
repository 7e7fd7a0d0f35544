"""Exit policies by name (ExitConfig.mode): a new policy is its module and its line here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from vllm_rlt.config import ExitConfig
from vllm_rlt.exit.ouro import OuroPolicy
from vllm_rlt.exit.ouro_delayed import OuroDelayedPolicy
from vllm_rlt.exit.policy import ExitPolicy
from vllm_rlt.exit.random_lookahead import RandomLookaheadPolicy
from vllm_rlt.exit.trace import TracePolicy

EXIT_POLICIES: dict[str, Callable[[ExitConfig, Any], ExitPolicy]] = {
    "ouro": OuroPolicy.from_config,
    "ouro_delayed": OuroDelayedPolicy.from_config,
    "random_lookahead": RandomLookaheadPolicy.from_config,
    "trace": TracePolicy.from_config,
}


def make_exit_policy(config: ExitConfig, model: Any) -> ExitPolicy:
    """The policy `config.mode` names, for `model`."""
    return EXIT_POLICIES[config.mode](config, model)
