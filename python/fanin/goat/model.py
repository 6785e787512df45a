"""GOAT's system model (§IV-A): the PS α, workers W, programmable switches S
with memory B(s), sub-model gradients G with sizes b(g), distances D_w(s)
and D_s(α).

Sizes are in MB (10^6 bytes) throughout, like the paper's figures.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from fanin.topology import Topology, TopologyError

__all__ = [
    "GoatError",
    "SubModel",
    "Instance",
    "instance_from_topology",
    "submodels_from_json",
    "submodels_from_sizes",
    "submodels_even",
    "submodels_from_torch",
    "TORCH_MODELS",
]


class GoatError(ValueError):
    """An input the planner cannot use; the message says what is wrong."""


@dataclass(frozen=True)
class SubModel:
    """One sub-model gradient g with its size b(g) in MB."""

    name: str
    size_mb: float


@dataclass
class Instance:
    """One GINA instance. Index j in 0..|S|-1 is a programmable switch,
    j = |S| (`alpha`) the PS."""

    switches: list[str]
    memory_mb: np.ndarray          # B(s), shape |S|
    workers: list[str]
    ps: str
    submodels: list[SubModel]
    dist_ws: np.ndarray            # D_w(s) for s in S ∪ {α}, shape |W| x (|S|+1)
    dist_sa: np.ndarray            # D_s(α), shape |S|
    topology: str = "instance"
    # workers with identical distance rows are interchangeable in the LP
    # (see lp.py); computed on demand
    _classes: Optional[tuple[np.ndarray, np.ndarray]] = field(default=None, repr=False)

    def __post_init__(self) -> None:
        s, w, g = len(self.switches), len(self.workers), len(self.submodels)
        if w == 0:
            raise GoatError("no workers: GINA needs at least one worker")
        if g == 0:
            raise GoatError("no sub-models: give at least one sub-model gradient b(g)")
        if self.dist_ws.shape != (w, s + 1):
            raise GoatError(f"dist_ws has shape {self.dist_ws.shape}, expected ({w}, {s + 1})")
        if self.dist_sa.shape != (s,) or self.memory_mb.shape != (s,):
            raise GoatError("dist_sa and memory_mb need one entry per programmable switch")
        if not np.all(np.isfinite(self.dist_ws)) or not np.all(np.isfinite(self.dist_sa)):
            raise GoatError("a worker or switch cannot reach the PS (or a switch): the topology is disconnected")
        for sm in self.submodels:
            if not (sm.size_mb > 0) or not math.isfinite(sm.size_mb):
                raise GoatError(f"sub-model {sm.name!r}: size {sm.size_mb} MB must be a positive number")
        if np.any(self.memory_mb < 0):
            raise GoatError("switch memory B(s) must be >= 0")

    @property
    def alpha(self) -> int:
        return len(self.switches)

    @property
    def sizes(self) -> np.ndarray:
        return np.array([sm.size_mb for sm in self.submodels], dtype=float)

    def worker_classes(self) -> tuple[np.ndarray, np.ndarray]:
        """(class of each worker, multiplicity of each class): workers whose
        rows D_w(·) are equal (e.g. under one edge switch)."""
        if self._classes is None:
            rows, inverse, counts = np.unique(self.dist_ws, axis=0, return_inverse=True, return_counts=True)
            self._classes = (inverse.reshape(-1), counts)
        return self._classes

    def node_name(self, j: int) -> str:
        return self.ps if j == self.alpha else self.switches[j]


def instance_from_topology(topo: Topology, submodels: Sequence[SubModel], workers: Optional[Sequence[str]] = None,
                           ps: Optional[str] = None) -> Instance:
    """The GINA instance of a topology: S = its programmable switches with
    B(s) = memory_mb, α = its host with role "ps" (or `ps`), W = its workers
    (or the given subset). D is the shortest-path length with link
    `distance` as the length (hop count by default), as in §IV-A."""
    from scipy.sparse import csr_matrix
    from scipy.sparse.csgraph import dijkstra

    if ps is None:
        pss = [h.name for h in topo.hosts if h.role == "ps"]
        if len(pss) != 1:
            raise GoatError(f"topology {topo.name} has {len(pss)} hosts with role 'ps'; mark exactly one "
                            "(or name it with --ps HOST)")
        ps = pss[0]
    try:
        topo.host(ps)
    except TopologyError as e:
        raise GoatError(str(e)) from None
    if workers is None:
        workers = [h.name for h in topo.hosts if h.name != ps and h.role == "worker"]
    workers = list(workers)
    for w in workers:
        try:
            topo.host(w)
        except TopologyError as e:
            raise GoatError(str(e)) from None
        if w == ps:
            raise GoatError(f"host {w} cannot be both a worker and the PS")
    if len(set(workers)) != len(workers):
        raise GoatError("a worker is listed twice")
    switches = [s.name for s in topo.switches if s.programmable]
    index = {n: i for i, n in enumerate(topo.nodes)}
    rows = [index[l.a] for l in topo.links] + [index[l.b] for l in topo.links]
    cols = [index[l.b] for l in topo.links] + [index[l.a] for l in topo.links]
    lengths = [l.distance for l in topo.links] * 2
    graph = csr_matrix((lengths, (rows, cols)), shape=(len(index), len(index)))
    # Hosts are single-homed, so no shortest path transits a host.
    sources = [index[n] for n in switches + [ps]]
    dist = dijkstra(graph, directed=False, indices=sources)          # (|S|+1) x nodes
    dist_ws = dist[:, [index[w] for w in workers]].T.copy()
    dist_sa = dist[: len(switches), index[ps]].copy()
    memory = np.array([topo.switch(s).memory_mb for s in switches], dtype=float)
    return Instance(switches, memory, workers, ps, list(submodels), dist_ws, dist_sa, topology=topo.name)


# -- sub-models ----------------------------------------------------------------------------


def submodels_from_sizes(sizes_mb: Sequence[float], prefix: str = "g") -> list[SubModel]:
    return [SubModel(f"{prefix}{i}", float(b)) for i, b in enumerate(sizes_mb)]


def submodels_from_json(path: str | Path) -> list[SubModel]:
    """A JSON list of sizes in MB (`[2.0, 1.5]`) or of objects
    (`[{"name": "conv1", "size_mb": 0.04}]`)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as e:
        raise GoatError(f"{path}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise GoatError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(data, list) or not data:
        raise GoatError(f"{path}: expected a non-empty JSON list of sizes in MB or of {{name, size_mb}} objects")
    out = []
    for i, item in enumerate(data):
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            out.append(SubModel(f"g{i}", float(item)))
        elif isinstance(item, dict) and set(item) <= {"name", "size_mb"} and "size_mb" in item:
            size = item["size_mb"]
            if not isinstance(size, (int, float)) or isinstance(size, bool):
                raise GoatError(f"{path}: item #{i}: size_mb must be a number, got {size!r}")
            out.append(SubModel(str(item.get("name", f"g{i}")), float(size)))
        else:
            raise GoatError(f"{path}: item #{i} is {item!r}; expected a number (MB) or {{\"name\", \"size_mb\"}}")
        if not (out[-1].size_mb > 0):
            raise GoatError(f"{path}: item #{i}: size {out[-1].size_mb} MB must be > 0")
    return out


def submodels_even(total_mb: float, parts: int) -> list[SubModel]:
    """`total_mb` split into `parts` equal sub-models (the §VII-D workload:
    221 MB per worker)."""
    if not (total_mb > 0) or parts < 1:
        raise GoatError(f"cannot split {total_mb} MB into {parts} sub-models")
    return submodels_from_sizes([total_mb / parts] * parts)


def _split(name: str, size_mb: float, max_mb: Optional[float]) -> list[SubModel]:
    if max_mb is None or size_mb <= max_mb:
        return [SubModel(name, size_mb)]
    n = math.ceil(size_mb / max_mb)
    return [SubModel(f"{name}#{i}", size_mb / n) for i in range(n)]


def _alexnet():
    import torch.nn as nn

    return nn.Sequential(
        nn.Conv2d(3, 64, 11, 4, 2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(64, 192, 5, padding=2), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Conv2d(192, 384, 3, padding=1), nn.ReLU(),
        nn.Conv2d(384, 256, 3, padding=1), nn.ReLU(),
        nn.Conv2d(256, 256, 3, padding=1), nn.ReLU(), nn.MaxPool2d(3, 2),
        nn.Flatten(), nn.Linear(256 * 6 * 6, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
        nn.Linear(4096, 1000))


def _resnet(blocks: Sequence[int]):
    """torchvision's ResNet-18/34 layout (BasicBlock), without torchvision."""
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.downsample = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                               if stride != 1 or cin != cout else None)

    layers: list = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64)]
    cin = 64
    for i, (n, cout) in enumerate(zip(blocks, (64, 128, 256, 512))):
        layers.append(nn.Sequential(*[Block(cin if j == 0 else cout, cout, 2 if (j == 0 and i > 0) else 1)
                                      for j in range(n)]))
        cin = cout
    layers.append(nn.Linear(512, 1000))
    return nn.Sequential(*layers)


TORCH_MODELS = {
    "alexnet": _alexnet,
    "resnet18": lambda: _resnet((2, 2, 2, 2)),
    "resnet34": lambda: _resnet((3, 4, 6, 3)),
}


def submodels_from_torch(model: str, max_mb: Optional[float] = None, bytes_per_element: int = 4) -> list[SubModel]:
    """One sub-model per parameter tensor of a PyTorch model (the default
    model partition the paper uses, §VI), tensors above `max_mb` cut into
    equal pieces (finer partitions, as DINA does). `model` is a torchvision
    name when torchvision is installed, else one of TORCH_MODELS (defined
    here with torch.nn)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        raise GoatError("--model needs PyTorch (pip install torch)") from None
    net = None
    try:
        import torchvision.models as tvm

        if hasattr(tvm, model):
            net = getattr(tvm, model)(weights=None)
    except ImportError:
        pass
    if net is None:
        if model not in TORCH_MODELS:
            raise GoatError(f"unknown model {model!r}; known without torchvision: {', '.join(sorted(TORCH_MODELS))}")
        net = TORCH_MODELS[model]()
    out: list[SubModel] = []
    for name, p in net.named_parameters():
        out.extend(_split(name, p.numel() * bytes_per_element / 1e6, max_mb))
    return out
