"""The K/V connectors by name (`--kv-connector`, engine/disagg/connector.py says what one
does), from `config.KV_CONNECTOR_CLASSES`: a new connector is its module here and its line
there."""

from __future__ import annotations

import functools
import operator
import pkgutil

from vllm_rlt.config import KV_CONNECTOR_CLASSES, KV_CONNECTORS, ParamError
from vllm_rlt.engine.disagg.connector import KVConnector, PoolHandle

CONNECTORS: dict[str, type[KVConnector]] = {
    name: pkgutil.resolve_name(path) for name, path in KV_CONNECTOR_CLASSES.items()
}
DEFAULT = "torch"  # what "auto" picks

# Any connector's pool handle, as the wire carries it (each is tagged with its name).
KVPoolHandle = functools.reduce(operator.or_, (c.handle_type for c in CONNECTORS.values()))


def connector_class(name: str) -> type[KVConnector]:
    """The connector `name` ("auto": the default); a ParamError on `kv_connector` naming
    the accepted names otherwise."""
    connector = CONNECTORS.get(DEFAULT if name == "auto" else name)
    if connector is None:
        raise ParamError(
            f"kv_connector must be one of {', '.join(KV_CONNECTORS)}, got {name!r}", "kv_connector"
        )
    return connector


def connector_of(handle: PoolHandle) -> type[KVConnector]:
    """The connector whose handle `handle` is."""
    return next(c for c in CONNECTORS.values() if isinstance(handle, c.handle_type))
