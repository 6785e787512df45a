"""``reduceByKey(add)`` through fanin with distributed receivers.

One Spark stage in barrier execution mode (all its tasks start together or
none does) does the whole reduce:

1. Task ``r < R`` is also receiver ``r``: it creates a key-value task at the
   daemon of its own host (``socket_path``) with one channel per task.
2. ``BarrierTaskContext.allGather`` hands every task the R tickets, on a
   second thread, while each task encodes its input partition's (key,
   number) pairs in the extension, split by ``receiver_partition(key, R)``
   into R inputs (ASK's sender-assisted partition one level up,
   ``docs/kv.md`` §10 "Distributed receivers").
3. Each task streams input ``r`` to ticket ``r`` as channel ``task index``
   (R sends at once, a thread each); each receiver waits for its sums.
4. A final ``allGather`` shares the key types every task saw (so receivers
   give keys back as str or bytes) and keeps any task from finishing while
   another fails.
5. Receiver ``r``'s sums are task ``r``'s output. A shuffle then places them
   in the requested partitions: with as many partitions as receivers it uses
   the same ``receiver_partition``, so each receiver's keys stay one
   partition. Only aggregated keys cross it, never the input.

Why barrier mode: receivers and senders must run at the same time (a
receiver waits for every sender), and a plain stage would run some tasks
only after others finish — with fewer task slots than tasks, receivers
would wait for senders that never start. A barrier stage is scheduled whole
or not at all, and the stage has at most as many tasks as the cluster runs
at once (the input is coalesced, without a shuffle, when it has more
partitions), so it cannot deadlock. When any task fails (bad input, a lost
executor, a sender whose daemon died) Spark kills the stage's other tasks
and retries the stage as a whole; a killed task's connection to its daemon
closes, which aborts its key-value task and releases its switch region,
and the retry creates new tasks with new ids. No sum can be counted twice:
a task of an aborted attempt accepts nothing more, and nothing of an
attempt that did not finish is ever returned.
"""

from __future__ import annotations

import json
import os
import re
import threading
from typing import Any, Callable, Iterable, Iterator, Optional

from fanin.kv import DEFAULT_SOCKET, Client, KvError

__all__ = ["reduce_by_key", "reduce_by_key_as_map", "default_socket", "task_slots"]

#: Environment variable naming the kv daemon's socket on an executor's host
#: (a standalone worker passes its environment to its executors).
SOCKET_ENV = "FANIN_KV_SOCKET"

# Every task encodes its whole input before the tickets are exchanged, so
# once a receiver exists its senders join within milliseconds and report
# progress every silence_ms / 5. A sender that never joins or stops
# (its task killed by Spark before its send began, its executor lost) is
# then declared failed after 2 x / 1 x silence_ms and its receiver's task
# ends, instead of holding a switch region for many minutes; 10 s leaves
# room for a loaded machine's pauses.
SPARK_SILENCE_MS = 10_000

# Receivers exist before their senders have encoded their input (the ticket
# exchange overlaps the encoding): channels may join this long after the
# receiver's task was created (the daemon's join_ms) before it is failed.
SPARK_JOIN_MS = 20_000

#: The value types a key-value task sums (``fanin_proto::kv::ValueType``).
VALUE_TYPES = ("int64", "float64")


def default_socket() -> str:
    """The daemon socket of this host: ``$FANIN_KV_SOCKET`` or fanin's default."""
    return os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET


def task_slots(sc: Any) -> int:
    """How many tasks this SparkContext runs at once (what a barrier stage may use).

    Spark's own count for barrier stages (``maxNumConcurrentTasks`` of the
    default resource profile), which knows executors and ``spark.task.cpus``;
    ``defaultParallelism`` where that internal call is not available."""
    try:
        jsc = sc._jsc.sc()
        profile = jsc.resourceProfileManager().defaultResourceProfile()
        slots = int(jsc.maxNumConcurrentTasks(profile))
        if slots > 0:
            return slots
    except Exception:  # an internal API: fall back to the public figure
        pass
    return max(1, int(sc.defaultParallelism))


def barrier_shape(sc: Any, inputs: int, num_partitions: Optional[int], who: str) -> tuple[int, int]:
    """(tasks, receivers) of a distributed reduce over ``inputs`` partitions.

    A barrier stage runs all its tasks at once, so at most as many tasks as
    slots; Spark refuses one whose input has another partition count (a
    coalesce), so an input with more partitions than that is encoded by an
    ordinary stage and its encoded tuples moved to the tasks (the callers).
    Receivers: ``num_partitions`` of them, at most one per task."""
    if num_partitions is not None and num_partitions < 1:
        raise ValueError(f"{who}: num_partitions must be at least 1, not {num_partitions}")
    tasks = max(1, min(inputs, task_slots(sc)))
    return tasks, min(num_partitions or tasks, tasks)


def join_encoded(groups: Iterable[list], inputs: int) -> list[bytes]:
    """The ``inputs`` inputs (per receiver and value task) of several encoded
    partitions, concatenated (records are self-delimiting)."""
    parts: list[list[bytes]] = [[] for _ in range(inputs)]
    for group in groups:
        for i in range(inputs):
            parts[i].append(group[i])
    return [b"".join(p) for p in parts]


def _encode(index: int, pairs: Iterable[Any], receivers: int, value_type: str) -> tuple[list, int]:
    """A partition's pairs as ``receivers`` tuples inputs (in the extension)."""
    from fanin import _native

    try:
        return _native.encode_tuples_partitioned(pairs, receivers, value_type)
    except _native.InvalidPair as e:  # the input's own errors pass unchanged
        raise KvError(f"partition {index}: {e}") from None


class _EncodeForTask:
    """Map side when the input has more partitions than the cluster has
    slots: encode each partition, keyed by the barrier task that sends it."""

    def __init__(self, receivers: int, tasks: int, value_type: str) -> None:
        self.receivers = receivers
        self.tasks = tasks
        self.value_type = value_type

    def __call__(self, index: int, pairs: Iterable[Any]) -> Iterator[tuple[int, tuple[list, int]]]:
        yield index % self.tasks, _encode(index, pairs, self.receivers, self.value_type)


def barrier_reduce(ctx: Any, planned_tasks: int, receivers: int, prepare: Callable[[], tuple[list, Any]],
                   socket_path: Optional[str], options: dict,
                   value_types: tuple = ("int64",)) -> tuple[Optional[bytes], list]:
    """One barrier task's part of a distributed reduce (RDD and DataFrame paths).

    Task ``index < receivers`` creates receiver ``index`` at its own daemon:
    one key-value task per entry of ``value_types`` (a task's switch
    registers hold one type; the DataFrame path sends int and float columns
    to a task each). ``allGather`` shares the tickets **while** ``prepare()``
    reads and encodes this task's input (Spark 3.5 answers a barrier sync
    only at its next once-a-second poll, so the encoding hides that second);
    ``prepare`` returns the inputs and this task's note. Every task sends
    ``inputs[r * K + k]`` (K = len(value_types)) to receiver ``r``'s task
    ``k`` as channel ``index``. Returns the receiver's result records, its
    K files concatenated (None for a task without one), and every task's
    note, exchanged by the final sync.

    Two guards keep a result from ever missing a sender: a stage attempt
    must run all ``planned_tasks`` tasks (Spark re-runs only the failed tasks
    of a stage when the others had already succeeded; their receivers could
    then never hear every sender, so the attempt fails instead of giving
    partial sums), and no task returns before every task has finished its
    part (the final ``allGather``, a barrier that also carries the notes),
    so one task cannot succeed while another fails, which is what makes
    Spark re-run a stage partially."""
    index, tasks = ctx.partitionId(), len(ctx.getTaskInfos())
    if tasks != planned_tasks:
        raise KvError(f"fanin.spark: this attempt of the barrier stage runs {tasks} of its {planned_tasks} tasks "
                      "(Spark re-ran only some); a receiver needs every sender, so it cannot give complete sums: "
                      "run the job again")
    socket_path = socket_path or default_socket()
    per_receiver = len(value_types)
    receiver = Client(socket_path) if index < receivers else None
    try:
        # the receivers wait for senders that are still encoding: join_ms
        options = dict(options, join_ms=options.get("join_ms", SPARK_JOIN_MS))
        mine = [receiver.create(tasks, **options, value_type=t) for t in value_types] if receiver else None
        gathered: list = []
        exchange = threading.Thread(target=lambda: gathered.append(ctx.allGather(json.dumps(mine))), daemon=True)
        exchange.start()
        inputs, note = prepare()  # a failure here fails the stage; Spark ends the exchange
        exchange.join()
        if not gathered:
            raise KvError(f"task {index}: the barrier's ticket exchange failed")
        tickets = [ticket for m in gathered[0][:receivers] for ticket in json.loads(m)]
        if len(inputs) != receivers * per_receiver:
            raise ValueError(f"barrier_reduce: {len(inputs)} inputs for {receivers} receivers x {per_receiver} tasks")
        failures: list[BaseException] = []

        def send(i: int) -> None:
            try:
                with Client(socket_path) as c:
                    c.send_bytes(tickets[i], index, inputs[i])
            except BaseException as e:  # raised below, after the wait
                failures.append(e)

        senders = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(len(tickets))]
        for t in senders:
            t.start()
        # a sender's failure reaches this receiver as SenderFailed
        data = b"".join(receiver.wait_records(t)[0] for t in mine) if receiver else None
        for t in senders:
            t.join()
        if failures:
            raise KvError(f"task {index}: a sender failed: {failures[0]}")
    finally:
        if receiver is not None:
            receiver.close()  # an unfinished task is aborted with it
    notes = [json.loads(m) for m in ctx.allGather(json.dumps(note))]
    return data, notes


class _ReduceTask:
    """The body of one barrier task (pickled to the executors)."""

    def __init__(self, receivers: int, tasks: int, socket_path: Optional[str], options: dict, encoded: bool,
                 value_type: str) -> None:
        self.receivers = receivers
        self.tasks = tasks
        self.encoded = encoded
        self.socket_path = socket_path
        self.options = options
        self.value_type = value_type

    def __call__(self, index: int, items: Iterable[Any]) -> Iterator[tuple[Any, int]]:
        from pyspark import BarrierTaskContext

        from fanin.kv import decode_results

        def prepare() -> tuple[list, int]:
            # bad input fails this task (Spark then kills the others, whose
            # key-value tasks abort with their connections)
            if self.encoded:
                # (input partition, (inputs, key_types)) groups of _encode
                parts = [group for _, group in items]
                key_types = 0
                for _, types in parts:
                    key_types |= types
                return join_encoded((encoded for encoded, _ in parts), self.receivers), key_types
            return _encode(index, items, self.receivers, self.value_type)

        data, notes = barrier_reduce(BarrierTaskContext.get(), self.tasks, self.receivers, prepare, self.socket_path,
                                     self.options, value_types=(self.value_type,))
        seen = 0
        for t in notes:  # every task's key types, this one's included
            seen |= t
        if seen == 3:
            raise KvError("fanin.spark: keys mix str and bytes; Spark would count 'a' and b'a' apart, the "
                          "daemons compare bytes: make every key one type")
        if data is None:
            return iter(())
        return iter(decode_results(data, as_str=seen != 2, value_type=self.value_type).items())


def reduce_by_key(rdd: Any, *, num_partitions: Optional[int] = None, socket_path: Optional[str] = None,
                  value_type: str = "int64", **options: Any) -> Any:
    """Drop-in for ``rdd.reduceByKey(operator.add, num_partitions)`` on (key, number) pairs.

    Keys are str or bytes (not both; other types are refused). Values are
    int64 (exact; an overflow raises), or with ``value_type="float64"`` floats (ints are taken as
    floats; sums within rounding of Spark's, whose order of additions
    differs too: docs/kv.md "float64 values"). The sums are computed
    by fanin, each receiver on an executor, and returned as an RDD of
    ``num_partitions`` partitions (default: as many as there are
    receivers). The reduce runs when this is called (like a shuffle that
    has been written), and an error of any task raises ``KvError`` here.

    ``socket_path``: the kv daemon's socket on every executor host
    (default ``$FANIN_KV_SOCKET`` there, else ``/tmp/fanin-kv.sock``).
    ``options`` go to every key-value task (``aa_size``, ``window``, ...
    of :meth:`fanin.kv.Client.create`); ``silence_ms`` defaults to 10 s.
    """
    if value_type not in VALUE_TYPES:
        raise ValueError(f"fanin.spark: value_type {value_type!r}; use one of {', '.join(VALUE_TYPES)}")
    options.setdefault("silence_ms", SPARK_SILENCE_MS)
    sc = rdd.context
    inputs = rdd.getNumPartitions()
    tasks, receivers = barrier_shape(sc, inputs, num_partitions, "fanin.spark")
    if inputs == 0:
        return sc.parallelize([], num_partitions or 1)
    partitions = num_partitions or receivers
    encoded = tasks < inputs
    if encoded:
        source = rdd.mapPartitionsWithIndex(_EncodeForTask(receivers, tasks, value_type)).partitionBy(tasks, _identity)
    else:
        source = rdd
    reduced = source.barrier().mapPartitionsWithIndex(
        _ReduceTask(receivers, tasks, socket_path, options, encoded, value_type))
    if partitions == receivers:
        # each receiver's keys stay together: partition r holds receiver r's sums
        placed = reduced.partitionBy(partitions, _ReceiverOf(receivers))
    else:
        placed = reduced.partitionBy(partitions)
    try:
        # run the barrier stage now (the shuffle keeps its output, so later
        # actions do not redo it): one reduce task forces the whole map side
        sc.runJob(placed, lambda it: [], partitions=[0])
    except Exception as e:
        raise KvError(f"fanin.spark.reduce_by_key failed: {_task_error(e)}") from None
    return placed


def reduce_by_key_as_map(rdd: Any, **kwargs: Any) -> dict:
    """:func:`reduce_by_key`, collected into a dict on the driver (for small results)."""
    return reduce_by_key(rdd, **kwargs).collectAsMap()


def _identity(task: int) -> int:
    return task


class _ReceiverOf:
    """``partitionFunc`` placing a key in the partition of its receiver."""

    def __init__(self, receivers: int) -> None:
        self.receivers = receivers

    def __call__(self, key: Any) -> int:
        from fanin import _native

        return _native.receiver_partition(key, self.receivers)


_ERROR_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Failed)): (.*)$", re.M)


def _task_error(e: BaseException) -> str:
    """The executor's own error out of Spark's wrapping (a Python traceback
    inside a Java exception's text; fanin's errors first), else Spark's."""
    text = str(e)
    found = [(name, message) for name, message in _ERROR_LINE.findall(text) if "py4j" not in name]
    ours = [f for f in found if f[0].startswith("fanin.")]
    if ours or found:
        name, message = (ours or found)[-1]
        return f"{name.rsplit('.', 1)[-1]}: {message}"
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[0] if lines else type(e).__name__
