"""A switch daemon per topology switch, all on 127.0.0.1 (different ports):
the quickest way to run a tree without the namespace testbed (tests, the
tree demo). Links are not emulated here: every switch reaches every other."""

from __future__ import annotations

import random
from contextlib import ExitStack
from typing import Optional

from ..proc import SwitchProcess
from ..switch import switch_config
from ..topology import Topology
from .fabric import StaticFabric

__all__ = ["LoopbackSwitches"]


class LoopbackSwitches:
    """Start one `fanin switch` per switch of `topo` (and per node of
    `hosts`: host aggregators, e.g. GOAT's parameter server); `fabric`
    describes them."""

    def __init__(self, topo: Topology, *, shards: int = 1, seed: Optional[int] = None, hosts: tuple[str, ...] = (),
                 **config_kw):
        self.topo = topo
        self.procs: dict[str, SwitchProcess] = {}
        self._configs: dict[str, dict] = {}
        self._stack = ExitStack()
        rng = random.Random(seed)
        table = {}
        try:
            for node in [sw.name for sw in topo.switches] + [topo.host(h).name for h in hosts]:
                proc, self._configs[node] = self._start(rng, shards, config_kw)
                self.procs[node] = proc
                table[node] = {"control": proc.control_addr, "data": proc.data_addr}
        except BaseException:
            self.stop()
            raise
        self.fabric = StaticFabric(table)

    def _start(self, rng: random.Random, shards: int, config_kw: dict) -> tuple[SwitchProcess, dict]:
        # shard n listens on port + n, so pick a free-looking range and retry
        last: Optional[Exception] = None
        for _ in range(20):
            base = rng.randrange(20000, 60000 - shards - 2)
            cfg = switch_config(data_addr=f"127.0.0.1:{base}", shards=shards,
                                control_addr="127.0.0.1:0", metrics_addr="127.0.0.1:0", **config_kw)
            try:
                return self._stack.enter_context(SwitchProcess(cfg)), cfg
            except RuntimeError as e:  # the port range was taken
                last = e
        raise RuntimeError(f"could not start a switch on 127.0.0.1: {last}")

    def restart(self, switch: str) -> None:
        """Kill `switch`'s daemon (SIGKILL: it forgets every job and block)
        and start it again on the same data and control ports, with no jobs:
        a new incarnation, as after a crash (docs/restart.md). The
        controller's `reconcile` installs its jobs again."""
        old = self.procs[switch]
        old.proc.kill()
        old.proc.wait(10)
        cfg = {**self._configs[switch], "control_addr": old.control_addr}
        self.procs[switch] = self._stack.enter_context(SwitchProcess(cfg))

    def counters(self, switch: str) -> dict[str, int]:
        return self.procs[switch].counters()

    def stop(self) -> None:
        self._stack.close()

    def __enter__(self) -> "LoopbackSwitches":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
