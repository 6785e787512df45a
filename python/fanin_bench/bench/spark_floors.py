"""What any Spark integration pays before it can aggregate: the floors
beside ``kv-wordcount``'s and ``kv-groupby``'s systems.

A replacement for ``reduceByKey`` or ``groupBy().agg()`` receives the
caller's RDD or DataFrame. Before fanin (or anything else) sees a pair,
Spark must compute it and hand it over, and that much no aggregation
design can save. Each floor here runs that hand-over and drops the data:

* ``rdd_drain``: the RDD's pairs reach a Python worker (the caller's own
  ``flatMap``/``map`` lambdas run; the pairs go nowhere).
* ``arrow_drain``: the DataFrame's rows reach Python as Arrow record
  batches (``mapInArrow``, the batches dropped): the DataFrame form's
  hand-over.
* ``jvm_drain``: the DataFrame computed in the JVM and written to Spark's
  ``noop`` sink: what a JVM-side encoder would still pay.
* ``barrier_sync_seconds``: one ``allGather`` of a barrier stage, as the
  tasks see it (Spark 3.5 checks the coordinator's answer once a second,
  ``Thread.sleep(1000)`` in ``BarrierTaskContext.runBarrier``).

The job time divided by a floor is the most any design that starts from
that hand-over could gain: the ceiling the benchmarks print beside each
target (taken against the floor's fastest run, so it errs high).
"""

from __future__ import annotations

import time
from typing import Any, Iterator

__all__ = ["rdd_drain", "arrow_drain", "jvm_drain", "barrier_sync_seconds"]


def _drop(items: Iterator[Any]) -> None:
    for _ in items:
        pass


def rdd_drain(rdd: Any) -> None:
    rdd.foreachPartition(_drop)


def _drop_batches(batches: Iterator[Any]) -> Iterator[Any]:
    for _ in batches:
        pass
    return iter(())


def arrow_drain(df: Any) -> None:
    first = df.schema.fields[0]
    df.mapInArrow(_drop_batches, f"`{first.name}` {first.dataType.simpleString()}") \
        .write.format("noop").mode("overwrite").save()


def jvm_drain(df: Any) -> None:
    df.write.format("noop").mode("overwrite").save()


def _one_sync(_: Iterator[Any]) -> Iterator[float]:
    from pyspark import BarrierTaskContext

    ctx = BarrierTaskContext.get()
    ctx.allGather("warm")  # the tasks start at different moments; time the second
    t0 = time.perf_counter()
    ctx.allGather("timed")
    yield time.perf_counter() - t0


def barrier_sync_seconds(sc: Any, tasks: int) -> float:
    """The mean over the tasks of one ``allGather`` once all tasks run."""
    took = sc.parallelize(range(tasks), tasks).barrier().mapPartitions(_one_sync).collect()
    return sum(took) / len(took)
