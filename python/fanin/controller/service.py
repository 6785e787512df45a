"""The controller's logic: jobs, subscriptions, trees, and programming the
switches whose role changed. Transport-free: `fanin controller` serves it
over gRPC (server.py); tests and benchmarks may call it directly.

Programming order on every change (docs/trees.md):

1. switches new to the tree are admitted first (no traffic reaches them
   before their parent knows them as a child); one new above the running
   tree (a new root) is admitted without the joiner's branch and learns it
   as awaiting, as in step 2,
2. switches whose role changed are updated in place (members, parent),
   parents with a new child learn it as *awaiting* when the worker syncs
   into a running job, so no block waits for it before its start block,
3. switches that left the tree lose the job last (their parents already
   stopped waiting for them).

Jobs are keyed by default (docs/security.md): create_job draws a 128-bit
job key, every switch of the tree is admitted with it (and re-admitted with
it after a restart), and subscribe hands the worker its member key. The job
key never leaves the controller except towards the switches.

The controller keeps nothing on disk: a restarted controller rebuilds its
jobs from the switches (`rebuild`, docs/restart.md), which hold every job
role with its key.
"""

from __future__ import annotations

import threading
import dataclasses
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..auth import derive_member_key, new_job_key
from ..control import ControlClient
from ..switch import JOB_DEFAULTS
from ..topology import Topology
from .fabric import Fabric
from .tree import SWITCH_RANK_BASE, Role, Tree, TreeError, build_tree, diff_roles, roles, switch_rank

__all__ = ["Controller", "JobParams", "ControllerError"]


class ControllerError(Exception):
    """A request the controller refuses; ``code`` is the gRPC status name."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class JobParams:
    job_id: int
    block_cnt_max: int = JOB_DEFAULTS["block_cnt_max"]
    #: Elements per block, and the packet size of every switch of the tree.
    #: None: the default (1024) capped to what one unfragmented datagram
    #: carries on the tree's smallest-MTU switch (docs/trees.md); a value is
    #: used as given (a caller that chose its packets keeps them).
    block_grad_max: Optional[int] = None
    block_exp_ms: int = JOB_DEFAULTS["block_exp_ms"]
    slow_after_windows: int = JOB_DEFAULTS["slow_after_windows"]
    #: Most workers at once; workers scale block floating point for it.
    max_workers: int = 64
    #: When a worker dies: "degrade" or "fail" (docs/failures.md). None = the
    #: switch's rule: "degrade" for a job that asked for straggler aging
    #: (block_exp_ms > 0), "fail" for any other, so a job that did not opt
    #: into partial results fails loudly.
    on_failure: Optional[str] = None
    #: 0 = the switch's default member timeout.
    member_timeout_ms: int = 0
    #: Authenticate the job's datagrams (docs/security.md): the controller
    #: draws a job key and subscribe returns each worker's member key.
    #: False = an unauthenticated job (anyone on the network can contribute).
    auth: bool = True

    def __post_init__(self) -> None:
        if self.on_failure is None:
            object.__setattr__(self, "on_failure", "degrade" if self.block_exp_ms > 0 else "fail")

    #: What the switch admits (crates/fanin-proto/src/job.rs, JobSpec::validate): field -> (lowest, highest,
    #: what the range means). Not dataclass fields (no annotation). `fanin controller create-job` checks its
    #: flags against them too.
    LIMITS = {
        "block_cnt_max": (1, 1 << 20, ""),                                          # MAX_BLOCK_CNT
        "block_grad_max": (1, 16370, ", the most elements one UDP datagram carries"),  # MAX_GRAD_CNT
        "block_exp_ms": (0, 600_000, "; 0 disables aging"),                         # MAX_BLOCK_EXP_MS
        "slow_after_windows": (0, 10_000, "; 0 never declares a source slow"),      # MAX_SLOW_AFTER_WINDOWS
        "max_workers": (1, SWITCH_RANK_BASE, ""),                                   # a job's workers are ranks below it
        "member_timeout_ms": (0, 600_000, "; 0 = the switch's default, 5000"),     # MAX_MEMBER_TIMEOUT_MS
    }

    def validate(self) -> None:
        """Refuse (INVALID_ARGUMENT, naming the field and its range) what the
        switches would refuse when the first worker subscribes."""
        if isinstance(self.job_id, bool) or not isinstance(self.job_id, int) or not 0 <= self.job_id < 2**32:
            raise ControllerError("INVALID_ARGUMENT", f"job_id {self.job_id} is out of range (0..{2**32 - 1})")
        if self.on_failure not in ("degrade", "fail"):
            raise ControllerError("INVALID_ARGUMENT",
                                  f"job {self.job_id}: on_failure {self.on_failure!r} is not degrade or fail")
        for name, (lo, hi, means) in self.LIMITS.items():
            value = getattr(self, name)
            if value is None and name == "block_grad_max":
                continue  # sized to the tree when it is built
            if isinstance(value, bool) or not isinstance(value, int):
                raise ControllerError("INVALID_ARGUMENT", f"job {self.job_id}: {name} {value!r} is not an integer")
            if not lo <= value <= hi:
                raise ControllerError("INVALID_ARGUMENT",
                                      f"job {self.job_id}: {name} {value} is out of range ({lo}..{hi}{means})")


@dataclass
class _Job:
    params: JobParams
    workers: dict[int, str] = field(default_factory=dict)
    tree: Optional[Tree] = None
    roles: dict[str, Role] = field(default_factory=dict)
    #: the job key (None: unauthenticated); kept out of reprs and errors
    key: Optional[bytes] = field(default=None, repr=False)
    #: ranks rebuilt from the switches, whose host is only known up to its
    #: switch until the worker subscribes again
    unconfirmed: set[int] = field(default_factory=set)
    #: ranks that unsubscribed while others stayed: the tree still runs the
    #: stream they left (emptied when the last rank leaves, which takes the
    #: job off the switches)
    left_running: set[int] = field(default_factory=set)
    #: switches of a tree (of more than one switch) that restarted while
    #: holding the job and had it installed again (`reconcile`): their spec
    #: says `resumed`, so they take only recovery (and sync) joins from ranks
    #: new to their life — the switches around them may hold results of the
    #: stream they never saw (docs/trees.md, "A second run on a live tree")
    #: — and count a child switch's partials only once it reported its
    #: subtree's lowest block in a recovery (docs/restart.md, "Trees")
    resumed_on: set[str] = field(default_factory=set)


class Controller:
    """One controller over one topology. Thread-safe: requests are
    serialised, since each recomputes and reprograms a tree."""

    def __init__(self, topo: Topology, fabric: Fabric, *, token: Optional[str] = None, timeout: float = 5.0,
                 client_factory: Optional[Callable[[str], ControlClient]] = None):
        self.topo = topo
        self.fabric = fabric
        self._clients: dict[str, ControlClient] = {}
        self._shards: dict[str, int] = {}
        self._factory = client_factory or (lambda addr: ControlClient(addr, token=token, timeout=timeout))
        self._jobs: dict[int, _Job] = {}
        self._lock = threading.Lock()
        # switch -> the incarnation it had when this controller programmed it
        self._incarnations: dict[str, int] = {}

    # -- requests ----------------------------------------------------------------

    def create_job(self, params: JobParams) -> None:
        params.validate()
        with self._lock:
            if params.job_id in self._jobs:
                raise ControllerError("ALREADY_EXISTS", f"job {params.job_id} already exists")
            self._jobs[params.job_id] = _Job(params, key=new_job_key() if params.auth else None)

    def delete_job(self, job_id: int) -> None:
        with self._lock:
            job = self._job(job_id)
            # (partial progress stands: a retry removes what is left)
            self._apply(job, {}, {}, undo_on_failure=False)
            del self._jobs[job_id]

    def subscribe(self, job_id: int, rank: int, host: str, sync: bool = False) -> dict:
        """Add worker `rank` on `host`: the tree is recomputed and the
        switches whose role changed are programmed. Returns ``data_addr``
        (where the worker sends), ``programmed`` (switch names) and
        ``member_key`` (the worker's 16-byte key for
        ``fanin.Session(auth_key=...)``; None for an unauthenticated job).

        ``sync=True``: the worker joins the job's running stream
        (``Session(sync_join=True)``). A rank that unsubscribed while other
        ranks stayed must come back that way: a plain subscribe would start
        it at the stream's start, where the tree may still hold results it
        took part in (refused, FAILED_PRECONDITION). Once the last rank has
        left, the job is off the switches and every rank subscribes plainly
        again (a new run)."""
        with self._lock:
            job = self._job(job_id)
            if rank in job.unconfirmed and self.topo.is_host(host) and \
                    self.topo.attachment(host) == self.topo.attachment(job.workers[rank]):
                # A worker of a rebuilt job subscribing again (to a restarted
                # controller): nothing to program, it learns its key again.
                job.unconfirmed.discard(rank)
                job.workers[rank] = host
                if job.tree is not None:
                    job.tree.hosts[rank] = host
                return self._subscribed(job, rank, host, [])
            if rank in job.workers:
                where = (f"a host under {self.topo.attachment(job.workers[rank])}" if rank in job.unconfirmed
                         else f"host {job.workers[rank]}")
                raise ControllerError("ALREADY_EXISTS", f"job {job_id}: rank {rank} is already subscribed (from {where})")
            if rank in job.left_running and not sync:
                # Subscribed again without sync, it would start at the
                # stream's start, and the switches above its own may still
                # hold results it took part in there: they would hand its
                # new process those sums for its own (docs/trees.md).
                raise ControllerError(
                    "FAILED_PRECONDITION",
                    f"job {job_id}: rank {rank} left while other ranks stayed subscribed, and the tree still runs the "
                    f"stream it left: subscribe it with sync=True to join that stream (fanin.Session(sync_join=True)), "
                    f"or unsubscribe every rank of the job before subscribing any again (a new run starts afresh)")
            if not self.topo.is_host(host):
                raise ControllerError("INVALID_ARGUMENT", f"host {host!r} is not a host of topology {self.topo.name}")
            if len(job.workers) >= job.params.max_workers:
                raise ControllerError("INVALID_ARGUMENT",
                                      f"job {job_id} already has max_workers={job.params.max_workers} workers")
            self._data_addr(host)  # before anything is programmed: a fabric without it fails the call here
            workers = {**job.workers, rank: host}
            tree = self._tree(workers)
            new_roles = roles(self.topo, tree)
            awaiting = self._joining(tree, new_roles, job.roles, rank) if sync else {}
            programmed = self._apply(job, new_roles, awaiting)
            job.workers, job.tree = workers, tree
            job.left_running.discard(rank)
            return self._subscribed(job, rank, host, programmed)

    def _subscribed(self, job: _Job, rank: int, host: str, programmed: list[str]) -> dict:
        job_id = job.params.job_id
        member_key = derive_member_key(job.key, job_id, rank) if job.key is not None else None
        return {"data_addr": self._data_addr(host), "programmed": programmed,
                "member_key": member_key}

    def unsubscribe(self, job_id: int, rank: int) -> dict:
        with self._lock:
            job = self._job(job_id)
            if rank not in job.workers:
                raise ControllerError("NOT_FOUND", f"job {job_id}: rank {rank} is not subscribed")
            job.unconfirmed.discard(rank)
            workers = {r: h for r, h in job.workers.items() if r != rank}
            tree = self._tree(workers) if workers else None
            new_roles = roles(self.topo, tree) if tree else {}
            programmed = self._apply(job, new_roles, {})
            job.workers, job.tree = workers, tree
            if workers:
                job.left_running.add(rank)
            else:
                job.left_running.clear()  # the job left every switch
            return {"programmed": programmed}

    def tree(self, job_id: int) -> Optional[Tree]:
        with self._lock:
            return self._job(job_id).tree

    def reconcile(self) -> list[tuple[str, int]]:
        """Re-install jobs on switches that restarted (docs/restart.md).

        A restarted switch has a new incarnation and no jobs. For every
        switch this controller programmed, compare its incarnation with the
        one it had then; on a change, admit again every job role it held
        (with its tree role). A switch that does not answer is skipped and
        retried at the next call. Returns the ``(switch, job_id)`` pairs
        re-installed."""
        from ..control import ControlError

        done: list[tuple[str, int]] = []
        with self._lock:
            switches = sorted({s for job in self._jobs.values() for s in job.roles})
            for s in switches:
                try:
                    inc = int(self._client(s).info()["incarnation"])
                except ControlError:
                    continue  # still down
                old = self._incarnations.setdefault(s, inc)
                if old == inc:
                    continue
                self._shards.pop(s, None)
                try:
                    for job in self._jobs.values():
                        role = job.roles.get(s)
                        if role is None:
                            continue
                        if len(job.roles) > 1:
                            # its tree ran: a new run must not start on it
                            # under switches that still hold the old stream,
                            # and its children recover with its workers
                            job.resumed_on.add(s)
                        try:
                            self._client(s).admit_job(**self._spec(job, s, role))
                        except ControlError as e:
                            if e.code != "ALREADY_EXISTS":  # e.g. from its own config
                                raise
                        done.append((s, job.params.job_id))
                except ControlError:
                    continue  # retried at the next call: the incarnation is not recorded yet
                self._incarnations[s] = inc
        return done

    def rebuild(self) -> dict:
        """Adopt the jobs the switches of the topology hold: what a
        restarted controller does before serving (docs/restart.md).

        Every switch that answers lists its jobs (`ListJobs`: the spec, the
        tree role and the job key). A job's roles are its specs on the
        switches; each switch's parent is the switch that lists its rank as
        a member; each worker rank is placed on a host of the switch that
        lists it (the tree depends only on that switch) until the worker
        subscribes again. The incarnations seen are recorded, so a switch
        that restarts from now on gets its roles back (`reconcile`). A
        switch that does not answer is skipped and named in ``unreachable``;
        a job whose specs disagree across switches (job parameters or key),
        or whose workers hang off a switch with no host in the topology, is
        not adopted, rather than guessed, and named with the reason in
        ``not_adopted``. Returns ``{"adopted": [job_id, ...],
        "unreachable": [...], "not_adopted": {job_id: why}}``."""
        from ..control import ControlError

        found: dict[int, dict[str, dict]] = {}
        unreachable: list[str] = []
        incarnations: dict[str, int] = {}
        for sw in (s.name for s in self.topo.switches):
            try:
                client = self._client(sw)
                incarnations[sw] = int(client.info()["incarnation"])
                jobs = client.list_jobs()
            except (ControlError, ValueError) as e:  # ValueError: no address in the fabric
                unreachable.append(f"{sw}: {e}")
                continue
            for spec in jobs:
                if spec["mode"] == "aggregate":
                    found.setdefault(spec["job_id"], {})[sw] = spec
        by_rank = {switch_rank(self.topo, s.name): s.name for s in self.topo.switches}
        adopted: list[int] = []
        not_adopted: dict[int, str] = {}
        with self._lock:
            for job_id, specs in sorted(found.items()):
                if job_id in self._jobs:
                    continue
                try:
                    self._check_tree_roles(specs)
                    job = _adopt(self.topo, job_id, specs, by_rank)
                except ValueError as e:
                    not_adopted[job_id] = str(e)
                    continue
                self._jobs[job_id] = job
                for sw in job.roles:
                    self._incarnations.setdefault(sw, incarnations[sw])
                adopted.append(job_id)
        return {"adopted": adopted, "unreachable": unreachable, "not_adopted": not_adopted}

    def _check_tree_roles(self, specs: dict[str, dict]) -> None:
        """ValueError unless every tree role in `specs` (switch -> spec) is
        one this controller could have programmed on its topology: the
        switch's rank is its topology rank, and its parent address is a
        switch of the topology's data address toward it. A job whose parent
        is elsewhere (a GOAT plan's, whose parent is the parameter server's
        daemon, `fanin controller install-goat`) is not this controller's
        tree: adopted, a restart of one of its switches was re-installed
        as a root and its results lacked the rest of the plan."""
        from .fabric import FabricError

        for sw, spec in specs.items():
            tree = spec.get("tree")
            if not tree:
                continue
            if tree["rank"] != switch_rank(self.topo, sw):
                raise ValueError(f"{sw} holds it as tree rank {tree['rank']}, but its rank in topology "
                                 f"{self.topo.name} is {switch_rank(self.topo, sw)} (another topology's job?)")
            parents = []
            for p in self.topo.switches:
                try:
                    parents.append(self.fabric.data_addr(p.name, toward=sw))
                except (FabricError, ValueError, KeyError):
                    continue
            if tree["parent_addr"] not in parents:
                raise ValueError(f"{sw}'s parent {tree['parent_addr']} is no switch of topology {self.topo.name}: "
                                 "not a tree of this controller (a GOAT plan's job?), left as it is")

    def close(self) -> None:
        for c in self._clients.values():
            c.close()
        self._clients.clear()

    # -- internals ---------------------------------------------------------------

    def _job(self, job_id: int) -> _Job:
        try:
            return self._jobs[job_id]
        except KeyError:
            raise ControllerError("NOT_FOUND", f"job {job_id} does not exist (create it first)") from None

    def _tree(self, workers: dict[int, str]) -> Tree:
        try:
            return build_tree(self.topo, workers)
        except TreeError as e:
            raise ControllerError("INVALID_ARGUMENT", str(e)) from None

    def _joining(self, tree: Tree, new: dict[str, Role], old: dict[str, Role], rank: int) -> dict[str, set[int]]:
        """Members that join a running job with worker `rank`: the worker at
        its switch, and every switch added for it alone at its parent."""
        awaiting: dict[str, set[int]] = {}
        node = tree.attach[rank]
        awaiting.setdefault(node, set()).add(rank)
        # walk up while the switch is new to the tree and carries only this worker
        while node not in old and tree.parent[node] is not None:
            parent = tree.parent[node]
            awaiting.setdefault(parent, set()).add(switch_rank(self.topo, node))
            node = parent
        return awaiting

    def _data_addr(self, host: str) -> str:
        """Where a worker on `host` sends: its switch's data address toward it."""
        from .fabric import FabricError

        switch = self.topo.attachment(host)
        try:
            return self.fabric.data_addr(switch, toward=host)
        except FabricError as e:
            raise ControllerError("FAILED_PRECONDITION", f"{e}: the fabric must name where {host}'s worker "
                                                         f"sends to {switch} before it can subscribe") from None

    def _client(self, switch: str) -> ControlClient:
        if switch not in self._clients:
            self._clients[switch] = self._factory(self.fabric.control_addr(switch))
        return self._clients[switch]

    def _parent_shards(self, switch: str) -> int:
        if switch not in self._shards:
            self._shards[switch] = int(self._client(switch).info()["shard_count"])
        return self._shards[switch]

    def _spec(self, job: _Job, switch: str, role: Role) -> dict:
        p = job.params
        tree = None
        if role.parent is not None:
            tree = {
                "parent_addr": self.fabric.data_addr(role.parent, toward=switch),
                "parent_shards": self._parent_shards(role.parent),
                "rank": role.rank,
            }
        return {
            "job_id": p.job_id,
            "members": list(role.members),
            "block_cnt_max": p.block_cnt_max,
            "block_grad_max": p.block_grad_max or JOB_DEFAULTS["block_grad_max"],
            "block_exp_ms": p.block_exp_ms,
            "slow_after_windows": p.slow_after_windows,
            "mode": "aggregate",
            "workers": p.max_workers,
            "tree": tree,
            "on_failure": p.on_failure,
            "member_timeout_ms": p.member_timeout_ms,
            # the same job key on every switch: a child derives its member
            # key at the parent from its tree rank (docs/security.md)
            "key": job.key,
            "resumed": switch in job.resumed_on,
        }

    def _fit_packets(self, job: _Job, new_roles: dict[str, Role]) -> None:
        """Fix the job's packet size at its first programming: the given
        block_grad_max, or the default capped to what one unfragmented datagram carries
        over the data port of the tree's switch with the smallest MTU
        (GetInfo's `packet_elems_max`). Every switch of a tree sends and
        expects blocks of the job's block_grad_max, and every worker learns
        it as its packet size, so it must fit every link, and it must stay
        the same for the job's life: a switch that joins the tree later
        with a smaller MTU gets the same size (docs/trees.md)."""
        if job.params.block_grad_max is not None:
            return  # the caller's choice, or fixed at the first programming
        size = JOB_DEFAULTS["block_grad_max"]
        for s in sorted(new_roles):
            limit = int(self._client(s).info().get("packet_elems_max") or 0)
            if limit:
                size = min(size, limit)
        job.params = dataclasses.replace(job.params, block_grad_max=size)

    def _apply(self, job: _Job, new_roles: dict[str, Role], awaiting: dict[str, set[int]], *,
               undo_on_failure: bool = True) -> list[str]:
        """Program the switches whose role differs between the job's current
        roles and `new_roles`; returns their names in programming order.

        All or nothing up to the removals: when an admission or an update
        fails (a switch refuses, or does not answer), the switches this
        call admitted lose the job again and the ones it updated get their
        old role back, so a retry starts from the tree as it was (a retried
        sync subscribe found its new leaf already there and programmed the
        parent with the joiner active). Removals come last and are not
        undone: a switch that could not be told stays in `job.roles`, and
        the next change removes it. The switch's refusal keeps its status
        (INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, ...: not
        worth retrying as is); a switch that does not answer is UNAVAILABLE."""
        from ..control import ControlError
        from .fabric import FabricError

        diff = diff_roles(job.roles, new_roles)
        done: list[str] = []
        undo: list[tuple[str, Callable[[], None]]] = []
        removing = False
        try:
            for s in diff.added:
                self._shards.pop(s, None)  # (re)learnt: it may have restarted with other shards
            self._fit_packets(job, new_roles)
            for s, role in diff.added.items():
                # A switch added above the running tree (a new root over the
                # old one) gets the joiner's branch as awaiting, as a parent
                # that gains a child does: admitted with it active, its
                # blocks waited for that branch from the first one and the
                # job stopped. AdmitJob takes no awaiting: admit without the
                # branch, then add it. A switch whose members all join (one
                # added for the joiner alone) has no other traffic to wait
                # behind: admitted with them.
                wait = set(role.members) & awaiting.get(s, set())
                admitted = role
                if wait and wait != set(role.members):
                    admitted = dataclasses.replace(role, members=tuple(m for m in role.members if m not in wait))
                self._client(s).admit_job(**self._spec(job, s, admitted))
                job.roles[s] = admitted
                undo.append((s, lambda s=s: self._take_off(job, s)))
                # the incarnation this controller programmed: a restart
                # from now on is one (reconcile); an earlier one, while it
                # held nothing of this controller's, is not
                self._incarnations[s] = int(self._client(s).info()["incarnation"])
                if admitted is not role:
                    self._client(s).update_job(self._spec(job, s, role), awaiting=sorted(wait))
                    job.roles[s] = role
                done.append(s)
            for s, role in diff.changed.items():
                old = job.roles[s]
                joined = set(role.members) - set(old.members)
                self._client(s).update_job(self._spec(job, s, role), awaiting=sorted(joined & awaiting.get(s, set())))
                job.roles[s] = role
                undo.append((s, lambda s=s, old=old: self._undo_update(job, s, old)))
                done.append(s)
            removing = True
            for s in diff.removed:
                self._take_off(job, s)
                job.resumed_on.discard(s)
                done.append(s)
        except (ControlError, FabricError) as e:
            undone, stuck = [], []
            if undo_on_failure and not removing:
                for s, step in reversed(undo):
                    try:
                        step()
                        undone.append(s)
                    except (ControlError, FabricError):
                        stuck.append(s)
            # a fabric without an address the tree needs: nothing to retry until it is described
            code = getattr(e, "code", "FAILED_PRECONDITION")
            if code in ("DEADLINE_EXCEEDED", "INTERNAL", "UNKNOWN"):
                code = "UNAVAILABLE"
            what = (f"; undone on {undone}" if undone else "") + (
                f"; {stuck} could not be given their old role back (retry, or unsubscribe every rank)" if stuck else "")
            raise ControllerError(code, f"job {job.params.job_id}: programming the tree failed after "
                                        f"{done or 'no switch'}{what}: {e}") from None
        return done

    def _take_off(self, job: _Job, switch: str) -> None:
        """Remove the job from `switch` and its role from the job; a switch
        that no longer holds it (it restarted, or was told before) counts."""
        from ..control import ControlError

        try:
            self._client(switch).remove_job(job.params.job_id)
        except ControlError as e:
            if e.code != "NOT_FOUND":
                raise
        job.roles.pop(switch, None)

    def _undo_update(self, job: _Job, switch: str, old: Role) -> None:
        self._client(switch).update_job(self._spec(job, switch, old), awaiting=[])
        job.roles[switch] = old


#: The job parameters a switch's spec carries, with their JobParams names.
_SPEC_PARAMS = {"block_cnt_max": "block_cnt_max", "block_grad_max": "block_grad_max", "block_exp_ms": "block_exp_ms",
                "slow_after_windows": "slow_after_windows", "workers": "max_workers", "on_failure": "on_failure",
                "member_timeout_ms": "member_timeout_ms"}


def _adopt(topo: Topology, job_id: int, specs: dict[str, dict], by_rank: dict[int, str]) -> _Job:
    """The job as the switches in `specs` (switch -> ListJobs spec) hold
    it; ValueError (saying why) when that is not one consistent job."""
    first_sw, first = next(iter(specs.items()))
    for sw, spec in specs.items():
        differ = [k for k in (*_SPEC_PARAMS, "key") if spec.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"switches {first_sw} and {sw} hold it with different {', '.join(differ)}")
    params = JobParams(job_id=job_id, auth=first["key"] is not None,
                       **{name: first[k] for k, name in _SPEC_PARAMS.items() if first.get(k) is not None})
    parent_of = {by_rank[m]: sw for sw, spec in specs.items() for m in spec["members"] if m in by_rank}
    job = _Job(params, key=first["key"])
    # A child switch its parent lists that does not hold the job itself lost
    # it (it restarted while no controller watched, or is down): installed
    # again under a parent that still runs the stream, it is resumed.
    job.resumed_on.update(child for child in parent_of if child not in specs)
    for sw, spec in specs.items():
        job.roles[sw] = Role(members=tuple(sorted(spec["members"])), parent=parent_of.get(sw),
                             rank=spec["tree"]["rank"] if spec["tree"] else None)
        if spec.get("resumed"):
            job.resumed_on.add(sw)
        hosts = [h.name for h in topo.hosts if topo.attachment(h.name) == sw]
        for m in spec["members"]:
            if m < SWITCH_RANK_BASE:
                if not hosts:
                    raise ValueError(f"worker rank {m} hangs off {sw}, which has no host in topology {topo.name}")
                job.workers[m] = hosts[0]
                job.unconfirmed.add(m)
    if job.workers:
        try:
            job.tree = build_tree(topo, job.workers)
        except TreeError as e:
            raise ValueError(str(e)) from None
    return job
