"""How every benchmark hands back its result: JSON on stdout, and a copy in --output."""

from __future__ import annotations

import json
from typing import Any


def emit_report(report: dict[str, Any], output: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if output:
        with open(output, "w") as handle:
            handle.write(text + "\n")
