"""PySpark integration: Spark's reduce stage replaced by fanin (ASK, ``docs/kv.md`` §10).

``aggregate(df, by=[...], agg={...})`` replaces ``df.groupBy(...).agg(...)``
(sum, count, min, max of integer and float columns) with Arrow batches end
to end (``fanin.spark.frame``). ``reduce_by_key(rdd)`` replaces
``rdd.reduceByKey(operator.add)`` for integer sums (float sums with
``value_type="float64"``): every executor task is a sender, and receivers run as
executor tasks too, each owning a hash range of the keys (distributed
receivers, ``fanin.spark.rdd``). Nothing is collected on the driver.

Example::

    from fanin.spark import reduce_by_key
    counts = reduce_by_key(sc.textFile(path).flatMap(str.split).map(lambda w: (w, 1)))
    counts.take(5)

Guarantee: the result equals ``rdd.reduceByKey(operator.add)`` for integer
values (int64; keys ``str`` or ``bytes`` of any length), and for float64
values within the rounding of sums added in another order, whatever loss
or reordering the network adds, or an error is raised. Preconditions: a
``fanin kv daemon`` on every executor host (``$FANIN_KV_SOCKET`` or
``/tmp/fanin-kv.sock``) with the switch reachable; no dynamic allocation
(barrier stages refuse it).
"""

from __future__ import annotations

import os

from fanin.spark.frame import aggregate
from fanin.spark.rdd import SOCKET_ENV, default_socket, reduce_by_key, reduce_by_key_as_map, task_slots

__all__ = ["reduce_by_key", "reduce_by_key_as_map", "aggregate", "ensure_java_home", "default_socket", "task_slots",
           "SOCKET_ENV"]


def ensure_java_home() -> None:
    """Point JAVA_HOME at the machine's JDK if it is unset (PySpark needs it)."""
    if os.environ.get("JAVA_HOME"):
        return
    java = os.path.realpath("/usr/bin/java")
    if os.path.exists(java):
        os.environ["JAVA_HOME"] = os.path.dirname(os.path.dirname(java))
