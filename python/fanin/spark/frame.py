"""``df.groupBy(...).agg(...)`` through fanin, Arrow batches in and out.

``aggregate(df, by=["k"], agg={"v": "sum", "*": "count"})`` is
``df.groupBy("k").agg({"v": "sum", "*": "count"})`` with the reduce done by
the switch and distributed receivers, as ``fanin.spark.rdd`` does for RDDs,
but with no row in Python: Spark hands each task Arrow record batches
(``mapInArrow``), their buffers go to the extension as numpy views
(``fanin._native.GroupEncoder``, ``fanin_kv::columns``), and each receiver's
result comes back as Arrow buffers (``decode_groups``) built into one
record batch. One barrier stage again (``mapInArrow(..., barrier=True)``);
an input with more partitions than slots is encoded by an ordinary stage
first and its encoded tuples moved to the barrier tasks.

The result is hash-partitioned by the group columns (``repartition(P,
*by)``: what Spark's own ``groupBy`` output is, so a join on the keys needs
no further shuffle), cached, and computed when ``aggregate`` is called. The
shuffle moves aggregated rows only; it is also what makes the result an
ordinary DataFrame, since Spark refuses ``show()``/``limit`` (jobs on some
partitions) on anything computed in the same stage as a barrier task.
"""

from __future__ import annotations

import uuid
from typing import Any, Iterable, Iterator, Optional, Union

from fanin.kv import KvError
from fanin.spark.rdd import SPARK_SILENCE_MS, _task_error, barrier_reduce, barrier_shape, join_encoded

__all__ = ["aggregate", "AGGREGATES"]

AGGREGATES = ("sum", "count", "min", "max")


def _kinds(spark_type: Any) -> Optional[str]:
    """The ``fanin_kv::columns::Kind`` of a Spark column type, None if unsupported."""
    from pyspark.sql import types as T

    return {T.ByteType: "int8", T.ShortType: "int16", T.IntegerType: "int32", T.LongType: "int64",
            T.StringType: "utf8", T.BinaryType: "binary", T.FloatType: "float",
            T.DoubleType: "double"}.get(type(spark_type))


INTEGERS = ("int8", "int16", "int32", "int64")
FLOATS = ("float", "double")  # pyarrow's names of float32 and float64


def _arrow_kind(array: Any) -> str:
    import pyarrow as pa

    t = array.type
    for test, name in ((pa.types.is_large_string, "large_utf8"), (pa.types.is_large_binary, "large_binary"),
                       (pa.types.is_string, "utf8"), (pa.types.is_binary, "binary")):
        if test(t):
            return name
    return str(t)  # int8 .. int64, float, double


def _column(array: Any) -> tuple:
    """An Arrow array as ``(kind, offset, length, validity, offsets, data)``,
    the buffers uint8 numpy views (no copy)."""
    import numpy as np

    def view(buf: Any) -> Any:
        return None if buf is None else np.frombuffer(buf, dtype=np.uint8)

    buffers = array.buffers()
    kind = _arrow_kind(array)
    validity = view(buffers[0]) if array.null_count else None
    if kind.endswith(("utf8", "binary")):
        return kind, array.offset, len(array), validity, view(buffers[1]), view(buffers[2])
    return kind, array.offset, len(array), validity, None, view(buffers[1])


class _Plan:
    """What every task needs to know (pickled to the executors)."""

    def __init__(self, by: list[str], key_kinds: list[tuple[str, bool]], values: list[str],
                 value_kinds: list[str], tagged: bool, aggs: list[tuple[int, str]], out_types: list[str],
                 receivers: int, socket_path: Optional[str], options: dict) -> None:
        from fanin import _native

        self.by, self.key_kinds, self.values = by, key_kinds, values
        # tagged: keys end in the value column's index byte (needed unless
        # there is one value column without nulls; KeyFormat)
        self.value_kinds, self.tagged, self.aggs, self.out_types = value_kinds, tagged, aggs, out_types
        self.receivers, self.socket_path, self.options = receivers, socket_path, options
        # one key-value task per value type among the columns (ValueTasks):
        # the switch's registers of a task read every value as one type
        self.value_types = tuple(_native.GroupEncoder(key_kinds, tagged, 1, value_kinds).value_types)

    def encode(self, batches: Iterable[Any]) -> list[bytes]:
        from fanin import _native

        encoder = _native.GroupEncoder(self.key_kinds, self.tagged, self.receivers, self.value_kinds)
        for batch in batches:
            keys = [_column(batch.column(i)) for i in range(len(self.by))]
            values = []
            for j, kind in enumerate(self.value_kinds):
                if kind == "one":
                    values.append(("one", 0, batch.num_rows, None, None, None))
                else:
                    values.append(_column(batch.column(len(self.by) + j)))
            try:
                encoder.add(keys, values)
            except _native.InvalidPair as e:
                raise KvError(f"fanin.spark.aggregate: {e}") from None
        return encoder.finish()

    def decode(self, data: bytes) -> Any:
        import pyarrow as pa

        from fanin import _native

        rows, key_buffers, agg_buffers = _native.decode_groups(data, self.key_kinds, self.tagged,
                                                               self.value_kinds, self.aggs)
        types = {"int8": pa.int8(), "int16": pa.int16(), "int32": pa.int32(), "int64": pa.int64(),
                 "utf8": pa.string(), "binary": pa.binary(), "float": pa.float32(), "double": pa.float64()}
        arrays = []
        for i, ((validity, offsets, payload), type_name) in enumerate(zip(key_buffers + agg_buffers, self.out_types)):
            buffers = [None if validity is None else pa.py_buffer(validity)]
            if offsets is not None:
                buffers.append(pa.py_buffer(offsets))
            buffers.append(pa.py_buffer(payload))
            if i < len(key_buffers):
                arrays.append(pa.Array.from_buffers(types[type_name], rows, buffers))
                continue
            # aggregates come as 8 bytes a row: int64, float64 for sum, min
            # and max of a float column; min and max go back to the column's
            # type (they are values of it, so the cast is exact)
            wide = pa.float64() if type_name in FLOATS else pa.int64()
            array = pa.Array.from_buffers(wide, rows, buffers)
            arrays.append(array if type_name in ("int64", "int64agg", "double") else array.cast(types[type_name]))
        return arrays


class _EncodeForTask:
    """Map side when the input has more partitions than slots: one row per
    partition, its encoded tuples per receiver, for barrier task ``task``."""

    def __init__(self, plan: _Plan, task_ids: list[int]) -> None:
        self.plan, self.task_ids = plan, task_ids

    def __call__(self, batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        inputs = self.plan.encode(batches)
        task = self.task_ids[TaskContext.get().partitionId() % len(self.task_ids)]
        yield pa.RecordBatch.from_arrays([pa.array([task], pa.int64()), pa.array([inputs], pa.list_(pa.binary()))],
                                         names=["task", "tuples"])


class _GroupTask:
    """The body of one barrier task: encode, exchange tickets, stream, wait, decode."""

    def __init__(self, plan: _Plan, tasks: int, encoded: bool) -> None:
        self.plan, self.tasks, self.encoded = plan, tasks, encoded
        # one per call: the result is cached, and Spark's cache serves any
        # later plan equal to a cached one (this pickled object is part of
        # the plan), so a second call over a re-read of changed files got
        # the first call's sums
        self.call = uuid.uuid4().hex

    def __call__(self, batches: Iterable[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import BarrierTaskContext

        plan = self.plan
        ctx = BarrierTaskContext.get()

        def prepare() -> tuple[list, None]:
            if self.encoded:
                # one row per input partition, its receivers' inputs in a list
                return join_encoded((t for b in batches for t in b.column("tuples").to_pylist()),
                                    plan.receivers * len(plan.value_types)), None
            return plan.encode(batches), None

        data, _ = barrier_reduce(ctx, self.tasks, plan.receivers, prepare, plan.socket_path, plan.options,
                                 value_types=plan.value_types)
        if data is not None:
            yield pa.RecordBatch.from_arrays(plan.decode(data), names=_output_names(plan))


def _output_names(plan: _Plan) -> list[str]:
    names = list(plan.by)
    for v, fn in plan.aggs:
        col = plan.values[v]
        names.append("count(1)" if col == "*" else f"{fn}({col})")
    return names


def _normalise(agg: Union[dict, list]) -> list[tuple[str, str]]:
    pairs = []
    items = agg.items() if isinstance(agg, dict) else agg
    for col, fns in items:
        for fn in [fns] if isinstance(fns, str) else fns:
            pairs.append((col, fn))
    if not pairs:
        raise ValueError("fanin.spark.aggregate: agg is empty; give e.g. {'value': 'sum'}")
    return pairs


def aggregate(df: Any, by: Union[str, list[str]], agg: Union[dict, list], *, num_partitions: Optional[int] = None,
              socket_path: Optional[str] = None, **options: Any) -> Any:
    """``df.groupBy(*by).agg(agg)`` through fanin; a DataFrame.

    ``by``: group columns (string, binary or integer types; nulls form a
    group, as in Spark). ``agg``: {column: "sum" | "count" | "min" | "max"
    or a list of them}, or [(column, fn), ...]; ``"*": "count"`` counts
    rows. Values: integer columns (summed in int64, exact; an overflow
    raises) and float/double columns (summed in float64, within rounding
    of Spark's sums, whose order of additions differs too; NaN and ±inf as
    in Spark); nulls are skipped as Spark skips them (``sum`` of none is
    null, ``count`` 0). Integer and float columns in one call run as two
    key-value tasks per receiver. Output columns: the group columns, then ``fn(column)``
    (``count(1)`` for ``*``), Spark's names. ``num_partitions``: of the
    result (default: the number of receivers). ``socket_path`` and
    ``options`` as for :func:`fanin.spark.reduce_by_key`.
    """
    from pyspark.sql import types as T

    by = [by] if isinstance(by, str) else list(by)
    if not by:
        raise ValueError("fanin.spark.aggregate: give at least one group column in by=")
    pairs = _normalise(agg)
    fields = {f.name: f for f in df.schema.fields}
    key_kinds = []
    for name in by:
        if name not in fields:
            raise ValueError(f"fanin.spark.aggregate: no column {name!r} to group by; columns: {sorted(fields)}")
        kind = _kinds(fields[name].dataType)
        if kind is None or kind in FLOATS:
            raise TypeError(f"fanin.spark.aggregate: group column {name!r} is {fields[name].dataType.simpleString()};"
                            " fanin groups by string, binary and integer columns (cast it first)")
        key_kinds.append((kind, bool(fields[name].nullable)))
    values: list[str] = []
    value_kinds: list[str] = []
    aggs: list[tuple[int, str]] = []
    out_types = [k for k, _ in key_kinds]
    out_fields = [T.StructField(name, fields[name].dataType, True) for name in by]
    for col, fn in pairs:
        if fn not in AGGREGATES:
            raise ValueError(f"fanin.spark.aggregate: {fn!r} for {col!r}; fanin computes {', '.join(AGGREGATES)}")
        if col == "*":
            if fn != "count":
                raise ValueError(f"fanin.spark.aggregate: '*' takes only 'count', not {fn!r}")
        elif col not in fields:
            raise ValueError(f"fanin.spark.aggregate: no column {col!r} to aggregate; columns: {sorted(fields)}")
        elif _kinds(fields[col].dataType) not in INTEGERS + FLOATS:
            raise TypeError(f"fanin.spark.aggregate: {col!r} is {fields[col].dataType.simpleString()}; fanin "
                            "aggregates integer and float columns (cast decimals to double first)")
        if col not in values:
            values.append(col)
            value_kinds.append("one" if col == "*" else _kinds(fields[col].dataType))
        v = values.index(col)
        aggs.append((v, fn))
        if fn == "sum" and value_kinds[v] in FLOATS:
            out_types.append("double")  # Spark sums float and double columns as double
            out_fields.append(T.StructField(f"sum({col})", T.DoubleType(), True))
        elif fn in ("sum", "count"):
            out_types.append("int64agg")
            out_fields.append(T.StructField("count(1)" if col == "*" else f"{fn}({col})", T.LongType(), fn == "sum"))
        else:
            out_types.append(value_kinds[v])
            out_fields.append(T.StructField(f"{fn}({col})", fields[col].dataType, True))
    options.setdefault("silence_ms", SPARK_SILENCE_MS)
    spark = df.sparkSession
    selected = df.select(*by, *[c for c in values if c != "*"])
    inputs = selected.rdd.getNumPartitions()
    tasks, receivers = barrier_shape(spark.sparkContext, inputs, num_partitions, "fanin.spark.aggregate")
    tagged = len(values) > 1 or any(fields[c].nullable for c in values if c != "*")
    plan = _Plan(by, key_kinds, values, value_kinds, tagged, aggs, out_types, receivers, socket_path, options)
    schema = T.StructType(out_fields)
    if inputs > tasks:
        ids = _task_ids(spark, tasks)
        encoded = selected.mapInArrow(_EncodeForTask(plan, ids), "task long, tuples array<binary>")
        source, is_encoded = encoded.repartition(tasks, "task"), True
    else:
        source, is_encoded = selected, False
    reduced = source.mapInArrow(_GroupTask(plan, tasks, is_encoded), schema, barrier=True)
    result = reduced.repartition(num_partitions or receivers, *by).cache()
    try:
        result.count()
    except Exception as e:
        result.unpersist()
        raise KvError(f"fanin.spark.aggregate failed: {_task_error(e)}") from None
    return result


def _task_ids(spark: Any, tasks: int) -> list[int]:
    """One long per barrier task that Spark's hash partitioning into ``tasks``
    partitions sends to partition ``t`` (so ``repartition(tasks, "task")``
    gives each barrier task one share of the encoded input, none twice)."""
    rows = spark.range(0, 64 * tasks).selectExpr("id", f"pmod(hash(id), {tasks}) AS p").collect()
    first: dict[int, int] = {}
    for row in rows:
        first.setdefault(row.p, row.id)
    if len(first) < tasks:
        raise KvError(f"fanin.spark: no value hashes to each of {tasks} partitions among {64 * tasks} tried")
    return [first[t] for t in range(tasks)]
