"""PySpark integration: ``reduceByKey`` for sums, aggregated by fanin.

The driver creates a key-value task at its host daemon (one sender channel
per partition); every executor task streams its partition to *its* host's
daemon (``socket_path`` must name the daemon on each executor host), which
joins the task at the driver's daemon and sends through the switch; the
driver waits for the merged sums. No shuffle.

Example::

    from fanin.spark import reduce_by_key
    counts = reduce_by_key(sc.textFile(path).flatMap(str.split).map(lambda w: (w, 1)))
    counts.collect()

Guarantee: the result equals ``rdd.reduceByKey(operator.add)`` for integer
values (int64; keys ``str`` or ``bytes``), whatever loss or reordering the
network adds. Preconditions: a ``fanin kv daemon`` on every host (with the
switch reachable), values that fit int64, keys of at most 1024 bytes.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Optional

from fanin.kv import DEFAULT_SOCKET, Client, KvError, SenderFailed

__all__ = ["reduce_by_key", "reduce_by_key_as_map", "ensure_java_home"]


def ensure_java_home() -> None:
    """Point JAVA_HOME at the machine's JDK if it is unset (PySpark needs it)."""
    if os.environ.get("JAVA_HOME"):
        return
    java = os.path.realpath("/usr/bin/java")
    if os.path.exists(java):
        os.environ["JAVA_HOME"] = os.path.dirname(os.path.dirname(java))


def _send_partition(socket_path: str, ticket: dict, index: int, pairs: Any) -> Any:
    with Client(socket_path) as client:
        reply = client.send(ticket, index, pairs)
    yield reply["tuples"]


# A partition is computed (and encoded) before it is streamed, so a sender
# can be silent for as long as Spark takes to compute a partition. Dead
# executors are noticed by Spark itself (the job fails and the task is
# aborted at once); the daemon's silence timer is only the backstop here.
SPARK_SILENCE_MS = 300_000
#: How long a failed Spark job leaves the daemons to report a failed sender
#: themselves before the driver aborts the task.
ABORT_GRACE_S = 5.0


def reduce_by_key_as_map(rdd: Any, *, socket_path: str = DEFAULT_SOCKET, **options: Any) -> dict:
    """Sum the values of ``rdd`` (of (key, int) pairs) per key; a dict on the driver.

    ``options`` go to the task (``aa_size``, ``silence_ms``, ... of
    :meth:`fanin.kv.Client.create`); ``silence_ms`` defaults to 5 minutes.
    """
    options.setdefault("silence_ms", SPARK_SILENCE_MS)
    partitions = rdd.getNumPartitions()
    driver = Client(socket_path)
    try:
        ticket = driver.create(max(partitions, 1), **options)
        try:
            # Keys travel as bytes: str or bytes results. This runs a small
            # Spark job, so a failure upstream in the RDD shows here first.
            as_str = _first_key_is_str(rdd)
        except BaseException:
            driver.abort(ticket)
            raise
        failure: list[BaseException] = []
        waited = threading.Event()

        def run_job() -> None:
            try:
                # Executors stream their partitions; the job's result is
                # just the tuple counts.
                rdd.mapPartitionsWithIndex(
                    lambda i, it: _send_partition(socket_path, ticket, i, it)).collect()
            except BaseException as e:  # surfaced after the wait
                failure.append(e)
                # A sender that failed is reported by the daemons themselves
                # within milliseconds (SenderFailed, with the partial sums);
                # abort only if the wait is still blocked after a grace
                # period (e.g. the job failed before a partition reached its
                # daemon, which nothing else would notice before silence_ms).
                if waited.wait(timeout=ABORT_GRACE_S):
                    return
                try:
                    with Client(socket_path) as c:
                        c.abort(ticket)
                except KvError:
                    pass

        job = threading.Thread(target=run_job, name="fanin-spark-senders", daemon=True)
        job.start()
        try:
            try:
                results = driver.wait(ticket, as_str=as_str)
            finally:
                waited.set()
        except SenderFailed as e:
            # Keep which partitions' senders failed and the partial sums.
            job.join(timeout=30)
            cause = f" (Spark job: {failure[0]})" if failure else ""
            raise SenderFailed(f"{e}{cause}", e.failed, e.partial, e.reply) from None
        except KvError as e:
            job.join(timeout=30)
            cause = f" (Spark job: {failure[0]})" if failure else ""
            raise KvError(f"{e}{cause}") from None
        job.join()
        if failure:
            raise KvError(f"the Spark job failed: {failure[0]}")
        return results
    finally:
        driver.close()


def reduce_by_key(rdd: Any, *, socket_path: str = DEFAULT_SOCKET, num_partitions: Optional[int] = None,
                  **options: Any) -> Any:
    """Drop-in for ``rdd.reduceByKey(operator.add)``: an RDD of (key, sum)."""
    results = reduce_by_key_as_map(rdd, socket_path=socket_path, **options)
    sc = rdd.context
    return sc.parallelize(list(results.items()), num_partitions or max(rdd.getNumPartitions(), 1))


def _first_key_is_str(rdd: Any) -> bool:
    # Keys travel as bytes; results come back as str unless the input used
    # bytes keys. One element is enough to tell (an empty RDD has no keys).
    first = rdd.take(1)
    return not (first and isinstance(first[0][0], (bytes, bytearray)))
