"""The K/V connectors by name (`--kv-connector`, engine/disagg/connector.py says what one
does): a new connector is one line in `CONNECTORS`."""

from __future__ import annotations

import functools
import operator

from vllm_rlt.config import ParamError
from vllm_rlt.engine.disagg.connector import KVConnector, PoolHandle
from vllm_rlt.engine.disagg.nixl_connector import NixlConnector
from vllm_rlt.engine.disagg.torch_connector import TorchConnector

CONNECTORS: dict[str, type[KVConnector]] = {
    "torch": TorchConnector,
    "nixl": NixlConnector,
}
DEFAULT = "torch"  # what "auto" picks
ACCEPTED = ("auto", *CONNECTORS)

# Any connector's pool handle, as the wire carries it (each is tagged with its name).
KVPoolHandle = functools.reduce(operator.or_, (c.handle_type for c in CONNECTORS.values()))


def connector_class(name: str) -> type[KVConnector]:
    """The connector `name` ("auto": the default); a ParamError on `kv_connector` naming
    the accepted names otherwise."""
    connector = CONNECTORS.get(DEFAULT if name == "auto" else name)
    if connector is None:
        raise ParamError(
            f"kv_connector must be one of {', '.join(ACCEPTED)}, got {name!r}", "kv_connector"
        )
    return connector


def connector_of(handle: PoolHandle) -> type[KVConnector]:
    """The connector whose handle `handle` is."""
    return next(c for c in CONNECTORS.values() if isinstance(handle, c.handle_type))
