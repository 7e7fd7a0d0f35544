"""Exit policies by name (ExitConfig.mode), from `config.EXIT_POLICY_CLASSES`: a new policy
is its module here and its line there."""

from __future__ import annotations

import pkgutil
from collections.abc import Callable
from typing import Any

from vllm_rlt.config import EXIT_POLICY_CLASSES, ExitConfig
from vllm_rlt.exit.policy import ExitPolicy

EXIT_POLICIES: dict[str, Callable[[ExitConfig, Any], ExitPolicy]] = {
    name: pkgutil.resolve_name(path).from_config for name, path in EXIT_POLICY_CLASSES.items()
}


def make_exit_policy(config: ExitConfig, model: Any) -> ExitPolicy:
    """The policy `config.mode` names (auto: the model's `exit_policy`), for `model`."""
    mode = model.exit_policy if config.mode == "auto" else config.mode
    return EXIT_POLICIES[mode](config, model)
