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

from .fabric import Fabric, FabricError, StaticFabric, TestbedFabric
from .server import ControllerClient, ControllerServer, serve
from .service import Controller, ControllerError, JobParams
from .tree import SWITCH_RANK_BASE, Role, Tree, TreeError, build_tree, diff_roles, roles, switch_rank

__all__ = [
    "Controller", "ControllerError", "JobParams", "ControllerServer", "ControllerClient", "serve",
    "Fabric", "FabricError", "StaticFabric", "TestbedFabric",
    "SWITCH_RANK_BASE", "Role", "Tree", "TreeError", "build_tree", "diff_roles", "roles", "switch_rank",
]
