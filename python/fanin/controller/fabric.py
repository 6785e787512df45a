"""Where the controller finds each switch: its control API, and the data
address a neighbour (a child switch or a worker) sends to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol

__all__ = ["Fabric", "StaticFabric", "TestbedFabric", "FabricError"]


class FabricError(ValueError):
    """A fabric description that does not name a switch's addresses."""


class Fabric(Protocol):
    def control_addr(self, switch: str) -> str:
        """``ip:port`` of the switch's control API."""

    def data_addr(self, switch: str, toward: str) -> str:
        """``ip:port`` (shard 0) that neighbour ``toward`` sends data to."""


class StaticFabric:
    """Addresses from a table: ``{switch: {"control": "ip:port", "data":
    "ip:port"}}`` — one data address for every neighbour, as on loopback. A
    switch may instead give ``"data": {"neighbour": "ip:port", ...}`` (with
    an optional ``"*"`` default). Loaded from JSON with :meth:`load`."""

    def __init__(self, table: dict[str, dict[str, Any]]):
        for name, entry in table.items():
            if not isinstance(entry, dict) or "control" not in entry or "data" not in entry:
                raise FabricError(f"fabric: switch {name!r} needs 'control' and 'data' addresses")
        self.table = table

    @classmethod
    def load(cls, path: str | Path) -> "StaticFabric":
        try:
            return cls(json.loads(Path(path).read_text()))
        except json.JSONDecodeError as e:
            raise FabricError(f"{path}: not valid JSON: {e}") from None

    def _entry(self, switch: str) -> dict[str, Any]:
        try:
            return self.table[switch]
        except KeyError:
            raise FabricError(f"fabric: no addresses for switch {switch!r}") from None

    def control_addr(self, switch: str) -> str:
        return str(self._entry(switch)["control"])

    def data_addr(self, switch: str, toward: str) -> str:
        data = self._entry(switch)["data"]
        if isinstance(data, str):
            return data
        if toward in data:
            return str(data[toward])
        if "*" in data:
            return str(data["*"])
        raise FabricError(f"fabric: switch {switch!r} has no data address toward {toward!r}")


class TestbedFabric:
    """The namespace testbed's addressing: control API on the management
    network, data on the point-to-point link address toward each neighbour
    (``Testbed.reach_addr``: for a node further away, the address on the
    link toward it, which needs the testbed's routing)."""

    def __init__(self, testbed):
        self.tb = testbed

    def control_addr(self, switch: str) -> str:
        return f"{self.tb.mgmt_addr(switch)}:{self.tb.SWITCH_CONTROL_PORT}"

    def data_addr(self, switch: str, toward: str) -> str:
        return f"{self.tb.reach_addr(switch, toward)}:{self.tb.SWITCH_DATA_PORT}"
