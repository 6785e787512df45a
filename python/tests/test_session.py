"""The Python worker API against a real in-process switch (shard threads and
UDP sockets on 127.0.0.1)."""

import threading
import time

import numpy as np
import pytest

import fanin
from fanin.proc import check_result, worker_inputs
from fanin.switch import free_result_group, job_config, switch_config
from threads import in_threads


def run_workers(addr, n, fn):
    return in_threads(n, fn)


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_three_workers_get_identical_correct_results_and_shape(dtype):
    n, size = 3, 50_003
    with fanin.local_switch(workers=n, shards=2) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank)
            x = worker_inputs(rank, size, dtype).reshape(-1, 1)
            before = x.copy()
            y = s.allreduce(x)
            assert np.array_equal(x, before), "input is not modified"
            assert y.shape == x.shape and y.dtype == x.dtype
            return y.ravel()

        results = run_workers(sw.data_addr, n, work)
    for r in results:
        assert r.tobytes() == results[0].tobytes()
    assert check_result(results[0], n, dtype, 1024)["ok"]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_lanes_send_from_several_sockets_and_the_results_are_the_same(dtype):
    """lanes=2 on a three-shard switch: lane 0 carries shards 0 and 2,
    lane 1 shard 1, each lane's socket gets its shards' replies, and every
    rank gets the same sum as without lanes."""
    n, size = 3, 40_003
    with fanin.local_switch(workers=n, shards=3) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank, lanes=2)
            y = s.allreduce(worker_inputs(rank, size, dtype))
            return y, s.socket_stats()

        results = run_workers(sw.data_addr, n, work)
    for y, stats in results:
        assert y.tobytes() == results[0][0].tobytes()
        assert stats["lanes"] == 2
        sent, got = stats["sent_by_lane"], stats["received_by_lane"]
        assert sum(sent) == stats["datagrams_sent"] and min(sent) > 0.2 * sum(sent), stats
        assert len(got) == 2 and min(got) > 0, stats
    assert check_result(results[0][0], n, dtype, 1024)["ok"]


def test_a_lane_count_out_of_range_is_refused_saying_what_is_allowed():
    with fanin.local_switch(workers=1) as sw:
        for bad in (0, 17):
            with pytest.raises(ValueError, match=f"lanes {bad} is not 1 to 16"):
                fanin.Session(sw.data_addr, 1, 0, lanes=bad)
        # more lanes than the switch has shards: only as many as carry any
        assert fanin.Session(sw.data_addr, 1, 0, lanes=4).socket_stats()["lanes"] == 1


@pytest.mark.parametrize("dtype", ["float32", "int32", "float16"])
def test_keep_makes_a_reduce_scatter_of_each_ranks_own_range(dtype):
    """Each rank keeps a third of the sum (shard boundaries inside blocks),
    the switch withholds the rest from it; a refused call forgets its range
    and the next allreduce is whole again."""
    n, size = 3, 30_001
    with fanin.local_switch(workers=n) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank)
            x = worker_inputs(rank, size, dtype)
            whole = s.allreduce(x)
            k = size // n
            keep = (rank * k, size if rank == n - 1 else (rank + 1) * k)
            part = x.copy()
            s.allreduce(part, out=part, keep=keep)
            with pytest.raises(ValueError, match="not a range"):
                s.allreduce(x, keep=(5, 2))
            with pytest.raises(TypeError):
                s.allreduce(x.astype(np.float64), keep=keep)
            again = s.allreduce(x)
            return whole, part, keep, again

        results = run_workers(sw.data_addr, n, work)
        withheld = sw.counters()["results_without_data"]
    for whole, part, (lo, hi), again in results:
        assert part[lo:hi].tobytes() == whole[lo:hi].tobytes(), "the shard is the allreduce's, bit for bit"
        assert again.tobytes() == whole.tobytes()
    assert withheld > 0


@pytest.mark.parametrize("dtype", ["float32", "int32"])
def test_out_receives_the_sum_in_place_and_in_a_given_array(dtype):
    n, size = 3, 20_011
    with fanin.local_switch(workers=n) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank)
            x = worker_inputs(rank, size, dtype)
            fresh = s.allreduce(x)
            y = np.full_like(x, 7)
            got = s.allreduce(x, out=y)
            assert got is y
            # the staging buffer is reused: a second call into the same out
            # still sees this call's input, not the last result
            y2 = s.allreduce(x, out=y)
            z = x.copy()
            s.allreduce(z, out=z)  # in place, like torch.distributed.all_reduce
            # the input shares memory with out, shifted by one element: it
            # is staged, as in place, not read while the sums land
            shifted = np.empty(size + 1, dtype=x.dtype)
            shifted[:size] = x
            s.allreduce(shifted[:size], out=shifted[1:])
            # the two halves of one buffer touch but do not overlap: the
            # input half is lent (read in place), the sum lands in the other
            halves = np.empty(2 * size, dtype=x.dtype)
            halves[:size] = x
            s.allreduce(halves[:size], out=halves[size:])
            assert halves[:size].tobytes() == x.tobytes(), "the input half is left as it was"
            # read in place (no memory shared with out) and left untouched
            assert x.tobytes() == worker_inputs(rank, size, dtype).tobytes()
            if dtype == "float32":
                mean = s.allreduce(x, average=True)
                mean_out = s.allreduce(x, average=True, out=np.empty_like(x))
                assert mean_out.tobytes() == mean.tobytes()
            return fresh, y.copy(), y2.copy(), z, shifted[1:], halves[size:]

        results = run_workers(sw.data_addr, n, work)
    for fresh, y, y2, z, shifted, halves in results:
        assert fresh.tobytes() == results[0][0].tobytes()
        assert y.tobytes() == fresh.tobytes() and y2.tobytes() == fresh.tobytes() and z.tobytes() == fresh.tobytes()
        assert shifted.tobytes() == fresh.tobytes() and halves.tobytes() == fresh.tobytes()
    assert check_result(results[0][0], n, dtype, 1024)["ok"]


def test_non_c_contiguous_inputs_are_summed_in_their_logical_order():
    n = 2
    with fanin.local_switch(workers=n) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank)
            base = np.arange(12, dtype=np.int32).reshape(3, 4) * (rank + 1)
            fortran = np.asfortranarray(base)
            strided = np.arange(24, dtype=np.int32)[::2] * (rank + 1)
            out = np.empty((3, 4), dtype=np.int32)
            return s.allreduce(fortran), s.allreduce(strided), s.allreduce(fortran, out=out)

        results = run_workers(sw.data_addr, n, work)
    want = np.arange(12, dtype=np.int32).reshape(3, 4) * 3
    for f, st, o in results:
        assert np.array_equal(f, want)
        assert np.array_equal(st, np.arange(24, dtype=np.int32)[::2] * 3)
        assert np.array_equal(o, want)


def test_a_bad_out_is_refused_before_anything_is_sent():
    with fanin.local_switch(workers=1) as sw:
        s = fanin.Session(sw.data_addr, 1, 0)
        x = np.ones(6, dtype=np.float32)
        with pytest.raises(TypeError, match="dtype float32.*int32"):
            s.allreduce(x, out=np.empty(6, dtype=np.int32))
        with pytest.raises(ValueError, match=r"shape \[3, 2\].*\[6\]"):
            s.allreduce(x, out=np.empty((3, 2), dtype=np.float32))
        with pytest.raises(ValueError, match="C-contiguous"):
            s.allreduce(x.reshape(2, 3), out=np.empty((3, 2), dtype=np.float32).T)
        ro = np.empty(6, dtype=np.float32)
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="not writable"):
            s.allreduce(x, out=ro)
        with pytest.raises(TypeError, match="out must be a numpy array"):
            s.allreduce(x, out=[0.0] * 6)
        # nothing was sent for the refused calls: the next allreduce is the
        # job's first and completes alone
        assert s.allreduce(x, out=np.empty(6, dtype=np.float32)).tolist() == [1.0] * 6
        assert s.last_stats["gen_id"] == 1


def test_loss_everywhere_is_recovered():
    n = 4
    with fanin.local_switch(workers=n, ingress_drop=0.1, egress_drop=0.1, seed=5) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank, send_drop=0.1, seed=rank, rto_ms=5, rto_min_ms=2)
            y = s.allreduce(worker_inputs(rank, 100_000, "int32"))
            retransmissions = s.last_stats["retransmissions"]
            # into a given array (the sum written there directly) as well
            x = worker_inputs(rank, 100_000, "float32")
            into = s.allreduce(x, out=np.empty_like(x))
            retransmissions += s.last_stats["retransmissions"]
            return y, retransmissions, s.socket_stats(), into

        results = run_workers(sw.data_addr, n, work)
        counters = sw.counters()
    assert check_result(results[0][0], n, "int32", 1024)["ok"]
    assert check_result(results[0][3], n, "float32", 1024)["ok"]
    assert all(r[3].tobytes() == results[0][3].tobytes() for r in results)
    assert sum(r[1] for r in results) > 0
    assert all(r[2]["dropped_by_fault_injection"] > 0 for r in results)
    assert counters["duplicate"] > 0 and counters["malformed"] == 0


def test_wrong_dtype_and_non_arrays_are_refused_clearly():
    with fanin.local_switch(workers=1) as sw:
        s = fanin.Session(sw.data_addr, 1, 0)
        with pytest.raises(TypeError, match="int32, float32 or float16.*float64"):
            s.allreduce(np.zeros(4))
        with pytest.raises(TypeError, match="numpy array"):
            s.allreduce([1.0, 2.0])
        # the session still works after a refused dtype (every rank runs the same code)
        assert s.allreduce(np.ones(3, dtype=np.float32)).tolist() == [1.0, 1.0, 1.0]
        del s
        # a finite value of 2^126 or more is named by its index in the
        # tensor (block 4 of 1024 elements), with or without `out`; it
        # depends on the data, so other ranks may be waiting: the session
        # takes no more calls
        far = np.ones(5000, dtype=np.float32)
        far[4321] = -np.finfo(np.float32).max
        for bad, kw, what in ((np.array([1, 2, 2.0 ** 126], dtype=np.float32), {}, "element 2 is 8507"),
                              (far, {}, "element 4321 is -3402"), (far, {"out": np.empty_like(far)}, "element 4321 is -3402")):
            s = fanin.Session(sw.data_addr, 1, 0)
            with pytest.raises(fanin.InputOutOfRange, match=what):
                s.allreduce(bad, **kw)
            with pytest.raises(fanin.FaninError, match="takes no more allreduces"):
                s.allreduce(np.ones(3, dtype=np.float32))
            del s
        # a new session does
        s = fanin.Session(sw.data_addr, 1, 0)
        assert s.allreduce(np.ones(3, dtype=np.float32)).tolist() == [1.0, 1.0, 1.0]


def test_unknown_job_non_member_and_oversized_packets_are_refused():
    with fanin.local_switch(workers=2, block_grad_max=256) as sw:
        with pytest.raises(fanin.FaninRefused, match="unknown job"):
            fanin.Session(sw.data_addr, 99, 0)
        with pytest.raises(fanin.FaninRefused, match="not a member"):
            fanin.Session(sw.data_addr, 1, 7)
        with pytest.raises(fanin.FaninRefused, match="block_grad_max is 256"):
            fanin.Session(sw.data_addr, 1, 0, elems_per_packet=1024)


def test_no_switch_times_out_within_the_join_timeout():
    import socket

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.1", 0))
    addr = "127.0.0.1:%d" % s.getsockname()[1]
    s.close()
    t = time.monotonic()
    # the host said nothing listens there: SwitchGone, a FaninTimeout
    with pytest.raises(fanin.SwitchGone, match="nothing listens on the switch's port"):
        fanin.Session(addr, 1, 0, join_timeout_s=0.5)
    assert time.monotonic() - t < 3
    assert issubclass(fanin.SwitchGone, fanin.FaninTimeout)


def test_bad_arguments_say_what_is_wrong():
    with pytest.raises(ValueError, match="HOST:PORT"):
        fanin.Session("localhost", 1, 0)
    with pytest.raises(ValueError, match="shards = 0 is out of range"):
        fanin.LocalSwitch(switch_config(data_addr="127.0.0.1:0", shards=0, control_addr=None, metrics_addr=None))
    with pytest.raises(ValueError, match="not a probability"):
        fanin.LocalSwitch(switch_config(data_addr="127.0.0.1:0", ingress_drop=2.0, control_addr=None, metrics_addr=None))
    with fanin.local_switch(workers=1) as sw:
        with pytest.raises(fanin.FaninRefused, match="already exists"):
            sw.admit_job(job_config(1, 2))
        with pytest.raises(ValueError, match="missing `members`"):
            sw.admit_job({"job_id": 5})
        with pytest.raises(fanin.FaninRefused, match="needs .* bytes of aggregation memory"):
            sw.admit_job(job_config(6, 2, block_cnt_max=1 << 20, block_grad_max=16000))


def test_jobs_are_admitted_and_removed_at_runtime_and_isolated():
    with fanin.local_switch(workers=1) as sw:
        sw.admit_job(job_config(2, 2, block_cnt_max=8, block_grad_max=64))
        res = run_workers(sw.data_addr, 2, lambda r: fanin.Session(sw.data_addr, 2, r, elems_per_packet=64)
                          .allreduce(np.full(1000, r + 1, dtype=np.int32)))
        assert res[0].tolist() == [3] * 1000
        assert fanin.Session(sw.data_addr, 1, 0).allreduce(np.arange(5, dtype=np.int32)).tolist() == list(range(5))
        sw.remove_job(2)
        with pytest.raises(fanin.FaninRefused, match="unknown job"):
            fanin.Session(sw.data_addr, 2, 0)


def test_gil_is_released_while_communicating():
    with fanin.local_switch(workers=2) as sw:
        ticks = []
        stop = threading.Event()

        def ticker():
            while not stop.is_set():
                ticks.append(1)
                time.sleep(0.001)

        t = threading.Thread(target=ticker)
        t.start()
        # rank 1 joins 0.3 s later; meanwhile rank 0 waits at the job's
        # barrier (the round starts when both joined), then inside allreduce
        threading.Timer(0.3, lambda: fanin.Session(sw.data_addr, 1, 1).allreduce(np.ones(10, np.float32))).start()
        s0 = fanin.Session(sw.data_addr, 1, 0, join_timeout_s=5)
        s0.allreduce(np.ones(10, np.float32))
        stop.set()
        t.join()
        assert len(ticks) > 50, "other Python threads ran during allreduce"


def test_results_on_a_multicast_group_under_loss():
    """Workers listening on the job's result group get each result from one
    group datagram (the last worker does not listen and gets unicast); the
    sums are right and identical everywhere, loss included."""
    n, group = 3, free_result_group()
    job = job_config(2, n, result_group=group)
    with fanin.local_switch(workers=1, shards=2, ingress_drop=0.03, egress_drop=0.03, seed=3,
                            extra_jobs=[job]) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 2, rank, send_drop=0.03, seed=rank, rto_ms=5, rto_min_ms=2,
                              result_group=group if rank < n - 1 else None)
            assert s.params["results_on_group"] == (rank < n - 1)
            x = worker_inputs(rank, 150_001, "float32")
            y = s.allreduce(x, out=np.empty_like(x))
            z = s.allreduce(worker_inputs(rank, 150_001, "int32"))
            return y, z, s.socket_stats()

        results = run_workers(sw.data_addr, n, work)
        counters = sw.counters()
    assert check_result(results[0][0], n, "float32", 1024)["ok"]
    assert check_result(results[0][1], n, "int32", 1024)["ok"]
    assert all(r[0].tobytes() == results[0][0].tobytes() for r in results)
    assert all(r[2]["datagrams_from_group"] > 100 for r in results[:-1])
    assert results[-1][2]["datagrams_from_group"] == 0
    assert counters["results_to_group"] > 0 and counters["malformed"] == 0


def test_a_bad_result_group_is_refused_with_the_reason():
    with pytest.raises(Exception, match="not an IPv4 multicast group"):
        with fanin.local_switch(workers=1, extra_jobs=[job_config(2, 1, result_group="10.0.0.1:5000")]):
            pass
    with fanin.local_switch(workers=1) as sw:
        with pytest.raises(ValueError, match='result_group "nowhere" is not IPV4:PORT'):
            fanin.Session(sw.data_addr, 1, 0, result_group="nowhere")
        with pytest.raises(ValueError, match="not an IPv4 multicast group"):
            fanin.Session(sw.data_addr, 1, 0, result_group="127.0.0.1:5000")
        # a group the job does not have: results come by unicast
        s = fanin.Session(sw.data_addr, 1, 0, result_group=free_result_group())
        assert not s.params["results_on_group"]
        assert np.array_equal(s.allreduce(np.arange(5000, dtype=np.int32)), np.arange(5000, dtype=np.int32))


def _bf16_bits(x):
    """float32 -> bfloat16 bits, rounded to nearest even."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def _bf16_value(bits):
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("fmt", ["float16", "bfloat16"])
def test_16_bit_floats_travel_as_2_bytes_each_way_within_the_bound(fmt):
    """float16 (a numpy dtype) and bfloat16 (its bits, dtype="bfloat16") are
    summed through the switch under loss: identical bits on every worker,
    within N * 2^(e - B - 1) + one ulp of the float64 sum with B = 14 -
    ceil(log2 N) (docs/protocol.md 5.6), the mean rounded once; and a
    datagram carries 2 bytes per element: 24 + 2k bytes for k elements."""
    n, size, epp = 3, 30_011, 512
    rng = np.random.default_rng(7)
    # magnitudes vary across blocks (sums stay inside float16's range)
    scale = 2.0 ** (np.arange(size) // 700 % 20 - 10)
    values = [rng.uniform(-1, 1, size) * scale for _ in range(n)]
    if fmt == "float16":
        inputs = [v.astype(np.float16) for v in values]
        exact_of = [x.astype(np.float64) for x in inputs]
    else:
        inputs = [_bf16_bits(v) for v in values]
        exact_of = [_bf16_value(x).astype(np.float64) for x in inputs]
    with fanin.local_switch(workers=n, ingress_drop=0.05, egress_drop=0.05, seed=3) as sw:
        def work(rank):
            s = fanin.Session(sw.data_addr, 1, rank, elems_per_packet=epp, rto_ms=5, rto_min_ms=2)
            kw = {} if fmt == "float16" else {"dtype": "bfloat16"}
            total = s.allreduce(inputs[rank], **kw)
            mean = s.allreduce(inputs[rank], average=True, **kw)
            inplace = inputs[rank].copy()
            s.allreduce(inplace, out=inplace, **kw)
            before = s.socket_stats()
            s.allreduce(inputs[rank][:epp], **kw)  # exactly one block
            after = s.socket_stats()
            return total, mean, inplace, before, after

        results = in_threads(n, work)
    total = results[0][0]
    assert total.dtype == inputs[0].dtype and total.shape == (size,)
    for t, m, inplace, _, _ in results:
        assert t.tobytes() == total.tobytes() and inplace.tobytes() == total.tobytes()
        assert m.tobytes() == results[0][1].tobytes()
    value = (lambda b: b.astype(np.float64)) if fmt == "float16" else (lambda b: _bf16_value(b).astype(np.float64))
    got, mean = value(total), value(results[0][1])
    exact = sum(exact_of)
    fraction_bits = 10 if fmt == "float16" else 7
    b = 14 - int(np.ceil(np.log2(n)))
    for start in range(0, size, epp):
        blk = slice(start, start + epp)
        e = max(int(np.frexp(np.abs(x[blk]).max())[1]) for x in exact_of)
        ulp = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(got[blk]), 2.0 ** -14))), -14) - fraction_bits)
        bound = n * 2.0 ** (e - b - 1) + ulp
        assert (np.abs(got[blk] - exact[blk]) <= bound).all(), start
        mulp = 2.0 ** (np.maximum(np.floor(np.log2(np.maximum(np.abs(mean[blk]), 2.0 ** -14))), -14) - fraction_bits)
        assert (np.abs(mean[blk] - got[blk] / n) <= mulp).all(), start
    # one block of epp elements: headers of 24 bytes (the exponent round's
    # have no elements) and 2 * epp bytes of elements per data datagram
    # (more than one if lost and resent), never the 4 * epp of float32 lanes
    _, _, _, before, after = results[0]
    sent = after["bytes_sent"] - before["bytes_sent"]
    datagrams = after["datagrams_sent"] - before["datagrams_sent"]
    data_datagrams, rest = divmod(sent - 24 * datagrams, 2 * epp)
    assert rest == 0 and 1 <= data_datagrams <= datagrams, (sent, datagrams)


def test_an_input_refused_on_one_rank_never_pairs_that_ranks_next_allreduce_with_the_others():
    """A value beyond 2^126 on rank 0 only (a NaN did this until NaN was
    carried): rank 0's allreduce is refused before anything is sent while
    rank 1's waits for it. Rank 0's next allreduce of the same length used
    to be summed with rank 1's pending one (11 for both, no error); now
    rank 0's session takes no more allreduces and rank 1's call fails, so
    nothing returns a sum of two different calls."""
    with fanin.local_switch(workers=2) as sw:
        def rank(r):
            s = fanin.Session(sw.data_addr, job_id=1, rank=r, dead_after_s=3)
            first = np.ones(3000, dtype=np.float32)
            if r == 0:
                first[10] = 1e38
            out = {}
            out["error_before"] = s.error
            for name, x in (("first", first), ("second", np.full(3000, 10.0 * (r + 1), dtype=np.float32))):
                try:
                    out[name] = np.unique(s.allreduce(x)).tolist()
                except Exception as e:  # the type and message (the traceback holds the session)
                    out[name] = (type(e), str(e))
            out["error_after"] = s.error
            del s  # unsendable: dropped on its own thread
            return out

        r0, r1 = in_threads(2, rank, timeout=60)
    assert issubclass(r0["first"][0], fanin.InputOutOfRange) and issubclass(r0["first"][0], ValueError), r0
    assert "element 10 is 1000000" in r0["first"][1] and "below 2^126" in r0["first"][1], r0
    assert issubclass(r0["second"][0], fanin.FaninError) and "takes no more allreduces" in r0["second"][1], r0
    # the session says why it ended, as its calls do
    assert r0["error_before"] is None and r0["error_after"] == r0["second"][1], r0
    assert isinstance(r1["first"], tuple) and issubclass(r1["first"][0], fanin.FaninError), r1  # never [11.0]
    assert r1["second"] == [30.0] or isinstance(r1["second"], tuple), r1


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_nan_or_infinity_on_one_rank_makes_its_block_nan_on_every_rank_and_the_session_goes_on(dtype):
    """As in Gloo, a NaN or an infinity in one rank's tensor reaches every
    rank's result (AMP's loss scaler then skips the step on every rank):
    here the whole block holding it is NaN, every other element is the
    exact sum, and the next allreduce is exact (nothing was refused, so no
    rank is out of step)."""
    n, epp, bad = 3000, 256, {0: (10, np.nan), 1: (2900, -np.inf)}
    with fanin.local_switch(workers=2) as sw:
        def rank(r):
            s = fanin.Session(sw.data_addr, job_id=1, rank=r, elems_per_packet=epp)
            first = np.full(n, 1.0 + r)
            first[bad[r][0]] = bad[r][1]
            calls = []
            for x in (first, np.full(n, 10.0 * (r + 1))):
                if dtype == "float32":
                    calls.append(s.allreduce(x.astype(np.float32)))
                elif dtype == "float16":
                    calls.append(s.allreduce(x.astype(np.float16)).astype(np.float32))
                else:
                    calls.append(_bf16_value(s.allreduce(_bf16_bits(x), dtype="bfloat16")).astype(np.float32))
            del s
            return calls

        (a0, s0), (a1, s1) = in_threads(2, rank, timeout=60)
    assert a0.tobytes() == a1.tobytes(), "every rank gets the same bits"
    nan = np.isnan(a0)
    per = epp  # (a worker that set its packet size uses it for every dtype)
    blocks = {10 // per, 2900 // per}
    expect_nan = np.zeros(n, dtype=bool)
    for b in blocks:
        expect_nan[b * per:(b + 1) * per] = True
    assert (nan == expect_nan).all(), np.flatnonzero(nan ^ expect_nan)[:5]
    assert (a0[~nan] == 3.0).all()
    assert (s0 == 30.0).all() and (s1 == 30.0).all()


def test_linger_ends_when_every_member_is_done_and_not_before():
    """Each rank lingers after its last allreduce (docs/restart.md, "Idle
    members"); the switch says all are done once every rank did, so every
    linger returns within about one probe interval of the last rank's, not
    at its bound."""
    import time

    with fanin.local_switch(workers=3) as sw:
        def rank(r):
            s = fanin.Session(sw.data_addr, job_id=1, rank=r)
            s.allreduce(np.ones(5000, dtype=np.float32))
            if r == 2:
                time.sleep(1.0)  # still at work while the others linger
            t = time.monotonic()
            report = s.linger(30.0)
            ended = time.monotonic()
            del s
            return report, ended - t, ended

        results = in_threads(3, rank, timeout=60)
    print("linger per rank (s): " + ", ".join(f"{took:.3f}" for _, took, _ in results)
          + f"; ends within {max(e for *_, e in results) - min(e for *_, e in results):.3f} s")
    for r, (report, took, _) in enumerate(results):
        assert report["all_done"], (r, report)
    ends = [end for *_, end in results]
    assert max(ends) - min(ends) < 0.6, ends  # together, within ~2 probe intervals
    assert results[0][1] > 0.9 and results[2][1] < 0.6, results  # not before rank 2 was done


def test_a_16_bit_input_or_out_of_another_format_or_byte_order_is_refused_before_anything_is_sent():
    """found by a review: the 16-bit path looked at the item size only, so a
    float16 array with dtype="bfloat16" was summed as bfloat16 ([1, 2] came
    back [1.125, 2.25]), big-endian bits were summed as native ones
    (garbage), and a float16 input with an int16 ``out`` filled it with the
    result's raw bits. Each is refused, saying what to change, and nothing
    is sent: the next allreduce is the job's first."""
    with fanin.local_switch(workers=1) as sw:
        s = fanin.Session(sw.data_addr, 1, 0)
        half = np.array([1.0, 2.0], dtype=np.float16)
        bits = _bf16_bits(np.array([1.0, 2.0]))
        with pytest.raises(TypeError, match=r"dtype='bfloat16' got a float16 array.*bits in a uint16 or int16 array"):
            s.allreduce(half, dtype="bfloat16")
        with pytest.raises(TypeError, match=r"array is >u2, not in this machine's byte order.*astype"):
            s.allreduce(bits.astype(">u2"), dtype="bfloat16")
        with pytest.raises(TypeError, match=r"out is int16 but the input is float16.*dtype='float16'"):
            s.allreduce(half, out=np.zeros(2, dtype=np.int16))
        with pytest.raises(TypeError, match=r"out is >f2 but the input is float16"):
            s.allreduce(half, out=np.zeros(2, dtype=">f2"))
        with pytest.raises(TypeError, match=r"out is >u2, not in this machine's byte order"):
            s.allreduce(bits, dtype="bfloat16", out=np.zeros(2, dtype=">u2"))
        with pytest.raises(TypeError, match=r"out is a float16 array but dtype='bfloat16'"):
            s.allreduce(bits, dtype="bfloat16", out=np.zeros(2, dtype=np.float16))
        with pytest.raises(TypeError, match=r"dtype='float16' got a float32 array"):
            s.allreduce(np.ones(2, dtype=np.float32), dtype="float16")
        assert s.allreduce(half, out=np.empty(2, dtype=np.float16)).tolist() == [1.0, 2.0]
        assert s.last_stats["gen_id"] == 1
        # what the messages ask for works: bits of either sign, native order,
        # and a float16 array with dtype="float16" (into its bits as well)
        assert s.allreduce(bits.astype(">u2").astype(np.uint16), dtype="bfloat16").tolist() == bits.tolist()
        assert s.allreduce(bits.view(np.int16), dtype="bfloat16").tolist() == bits.view(np.int16).tolist()
        into = np.empty(2, dtype=np.uint16)
        assert s.allreduce(half, dtype="float16", out=into) is into and into.tolist() == half.view(np.uint16).tolist()


def test_an_ml_dtypes_bfloat16_array_is_refused_as_float16():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    with fanin.local_switch(workers=1) as sw:
        s = fanin.Session(sw.data_addr, 1, 0)
        x = np.array([1.0, 2.0], dtype=ml_dtypes.bfloat16)
        with pytest.raises(TypeError, match=r"dtype='float16' got a bfloat16 array"):
            s.allreduce(x, dtype="float16")
        assert s.allreduce(x, dtype="bfloat16").tolist() == x.tolist()
        assert s.allreduce(x).tolist() == x.tolist()


# the session made on a thread that ended is dropped on another at the end:
# pyo3 can only leak it there, and says so as an unraisable RuntimeError
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_session_used_on_another_thread_raises_a_runtime_error_and_goes_on_on_its_own():
    """found by a review: the native session is bound to its thread, and
    using it from another raised pyo3's PanicException (a BaseException
    that escapes ``except Exception``, with a Rust backtrace on stderr).
    Now every call says which thread to use, as a RuntimeError; nothing is
    sent, and the session still works on its own thread. A thread that
    reuses the creator's ident (pools do: CPython reuses idents of threads
    that ended) is another thread too."""
    with fanin.local_switch(workers=1) as sw:
        s = fanin.Session(sw.data_addr, 1, 0)
        calls = {"allreduce": lambda: s.allreduce(np.ones(2, dtype=np.float32)), "last_stats": lambda: s.last_stats,
                 "elems_per_packet": lambda: s.elems_per_packet, "params": lambda: s.params,
                 "error": lambda: s.error, "linger": lambda: s.linger(0.1), "socket_stats": s.socket_stats}
        seen = {}

        def other():
            for name, call in calls.items():
                try:
                    call()
                    seen[name] = "no error"
                except BaseException as e:  # a PanicException is not an Exception
                    seen[name] = (type(e), str(e))

        t = threading.Thread(target=other, name="other-thread")
        t.start()
        t.join()
        for name, got in seen.items():
            assert got[0] is RuntimeError, (name, got)
            assert "created on thread 'MainThread'" in got[1] and "used on thread 'other-thread'" in got[1], got
            assert "create one Session per thread" in got[1], got
        assert s.allreduce(np.ones(2, dtype=np.float32)).tolist() == [1.0, 1.0]
        assert s.last_stats["gen_id"] == 1
        del s

        # a session whose thread ended, used on threads that may reuse its
        # ident (it is dropped on another thread at the end: pyo3 leaks it
        # then, saying so, which is all it can do)
        made = {}
        maker = threading.Thread(target=lambda: made.update(s=fanin.Session(sw.data_addr, 1, 0)))
        maker.start()
        maker.join()

        def late():
            seen["late"] = _raised(lambda: made["s"].error)

        for _ in range(4):
            t = threading.Thread(target=late)
            t.start()
            t.join()
            assert seen["late"][0] is RuntimeError, seen["late"]


def _raised(fn):
    try:
        fn()
        return ("no error", None)
    except BaseException as e:
        return (type(e), str(e))


def test_bad_integers_and_timeouts_name_the_argument_its_range_and_the_value_as_given():
    """Out-of-range integers used to raise `OverflowError: out of range
    integral type conversion attempted` naming nothing, and rto_ms=-5 said
    "got -0.005" (converted to seconds before the message)."""
    import re

    most = fanin._native.Session.MAX_ELEMS_PER_PACKET  # the most one datagram carries

    with fanin.local_switch(workers=1) as sw:
        a = sw.data_addr
        for kw, says in [
            (dict(window=-1), "window = -1 is out of range (1 to 2**32-1; blocks in flight)"),
            (dict(window=2**32), f"window = {2**32} is out of range (1 to 2**32-1"),
            (dict(elems_per_packet=-1), f"elems_per_packet = -1 is out of range (0 to {most}; 0 = the job's)"),
            (dict(elems_per_packet=10**7), f"elems_per_packet = 10000000 is out of range (0 to {most}"),
            (dict(members=-1), "members = -1 is out of range (0 to 65535; 0 = any)"),
            (dict(align_blocks=-1), "align_blocks = -1 is out of range (0 to 2**32-1)"),
            (dict(seed=-1), "seed = -1 is out of range (0 to 2**64-1)"),
            (dict(lanes=-1), "lanes = -1 is out of range (1 to 16)"),
            (dict(rto_ms=-5), "rto_ms must be a positive number of milliseconds, got -5"),
            (dict(rto_min_ms=0), "rto_min_ms must be a positive number of milliseconds, got 0"),
            (dict(rto_max_ms=float("nan")), "rto_max_ms must be a positive number of milliseconds, got nan"),
            (dict(rto_min_ms=50, rto_max_ms=10), "rto_min_ms = 50 must be at most rto_max_ms = 10"),
            (dict(rto_ms=1e30), "rto_ms = 1e30 is too long"),
            (dict(join_timeout_s=1e30), "join_timeout_s = 1e30 is too long"),
            (dict(dead_after_s=-1), "dead_after_s must be a positive number of seconds, got -1"),
        ]:
            with pytest.raises(ValueError, match=re.escape(says)):
                fanin.Session(a, 1, 0, **kw)
        for args, says in [((-1, 0), "job_id = -1 is out of range (0 to 2**32-1)"),
                           ((2**32, 0), f"job_id = {2**32} is out of range (0 to 2**32-1)"),
                           ((1, -1), "rank = -1 is out of range (0 to 65535)"),
                           ((1, 70000), "rank = 70000 is out of range (0 to 65535)")]:
            with pytest.raises(ValueError, match=re.escape(says)):
                fanin.Session(a, *args)
        with pytest.raises(TypeError, match="window"):
            fanin.Session(a, 1, 0, window=1.5)
        # the values that still work
        s = fanin.Session(a, 1, 0, window=1, rto_ms=5, rto_min_ms=1, rto_max_ms=5, seed=2**64 - 1)
        assert np.array_equal(s.allreduce(np.arange(10, dtype=np.int32)), np.arange(10, dtype=np.int32))


def test_port_0_is_refused_as_a_switch_address():
    # used to fail with "socket error: Invalid argument (os error 22)"
    with pytest.raises(ValueError, match=r"port 0 is not a switch's address.*127\.0\.0\.1:9000"):
        fanin.Session("127.0.0.1:0", 1, 0)
    with pytest.raises(ValueError, match="port 0 is not a switch's address"):
        fanin.Session("localhost:0", 1, 0)


def test_local_switch_and_the_config_builders_name_a_bad_argument():
    """local_switch(workers=-1) said "invalid value: integer `-1`, expected u16 at line 1 column 524"."""
    import re

    for call, says in [
        (lambda: fanin.local_switch(workers=-1), "workers = -1 is out of range (1 to 4096)"),
        (lambda: fanin.local_switch(workers=0), "workers = 0 is out of range (1 to 4096)"),
        (lambda: fanin.local_switch(workers=2, shards=-1), "shards = -1 is out of range (1 to 64)"),
        (lambda: fanin.local_switch(workers=2, job_id=-1), "job_id = -1 is out of range (0 to 2**32-1)"),
        (lambda: fanin.local_switch(workers=2, block_exp_ms=-1), "block_exp_ms = -1 is out of range (0 to 2**32-1)"),
        (lambda: fanin.local_switch(workers=2, egress_drop=float("nan")), "egress_drop = nan is not a probability"),
        (lambda: fanin.local_switch(workers=2, seed=-1), "seed = -1 is out of range (0 to 2**64-1)"),
        (lambda: job_config(1, 2, mode="sum"), "mode='sum': give aggregate or forward"),
        (lambda: job_config(1, members=[0, -1]), "members: member -1 is out of range (0 to 4095)"),
        (lambda: switch_config(data_addr="nowhere"), "data_addr: 'nowhere' is not IP:PORT"),
        (lambda: switch_config(metrics_addr="9101"), "metrics_addr='9101' is not an address: give \"auto\""),
        (lambda: switch_config(jobs=[{"job_id": 1, "sources": -2}]), "jobs[0].sources = -2 is out of range"),
        (lambda: fanin.LocalSwitch(switch_config(data_addr="127.0.0.1:0", control_addr=None, metrics_addr=None,
                                                 trim_watermark=float("nan"))),
         "trim.watermark = nan is not a number the switch takes"),
    ]:
        with pytest.raises(ValueError, match=re.escape(says)):
            call()
    with pytest.raises(TypeError, match="workers must be an integer"):
        fanin.local_switch(workers=1.5)
