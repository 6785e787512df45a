"""The fanin controller (SwitchML++): one aggregation tree per job over a
topology, programmed into the switches through their control API, with
workers subscribing and unsubscribing while jobs run. See docs/trees.md.

    >>> from fanin import topology
    >>> from fanin.controller import Controller, JobParams, StaticFabric
    >>> ctl = Controller(topology.load("deep-tree:2,2"), StaticFabric({...}))
    >>> ctl.create_job(JobParams(1, max_workers=2))   # keyed by default (auth=False: open)
    >>> sub = ctl.subscribe(1, rank=0, host="h0")     # data_addr, programmed, member_key
    >>> fanin.Session(sub["data_addr"], 1, 0, auth_key=sub["member_key"])
"""

import importlib
from typing import TYPE_CHECKING

# Names resolve on first use (PEP 562): `fanin --help` imports fanin.controller.command, and with it this
# package, to register `fanin controller`; the server and service below import grpc, which no command but
# `fanin controller` should pay for.
_EXPORTS = {
    "Controller": "service", "ControllerError": "service", "JobParams": "service",
    "ControllerServer": "server", "ControllerClient": "server", "serve": "server",
    "Fabric": "fabric", "FabricError": "fabric", "StaticFabric": "fabric", "TestbedFabric": "fabric",
    "SWITCH_RANK_BASE": "tree", "Role": "tree", "Tree": "tree", "TreeError": "tree", "build_tree": "tree",
    "diff_roles": "tree", "roles": "tree", "switch_rank": "tree",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


if TYPE_CHECKING:
    from .fabric import Fabric, FabricError, StaticFabric, TestbedFabric
    from .server import ControllerClient, ControllerServer, serve
    from .service import Controller, ControllerError, JobParams
    from .tree import SWITCH_RANK_BASE, Role, Tree, TreeError, build_tree, diff_roles, roles, switch_rank
