#!/usr/bin/env python3
"""Write the committed seed corpus under fuzz/corpus/<target>/.

The seeds are valid messages: the golden vectors of
crates/fanin-wire/src/value/tests.rs plus one of every message type, so each
fuzzer starts past the magic/version/type checks. Re-run after a format
change (`python3 fuzz/make_seeds.py`); it rewrites only the files it names.
"""
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
MAGIC, VERSION = 0xFA17, 1
CONTRIBUTION, RETRANSMISSION, RESULT, JOIN, JOIN_ACK, NACK = range(1, 7)
FINAL, DEGRADED, EXP_ONLY = 0x08, 0x04, 0x02


def header(msg_type, *, age_op=0, flags=0, dtype=0, src_id=0, src_cnt=0, gen_id=0,
           job_id=0, block_id=0, grad_cnt=0, exp=-128, next_exp=-128):
    return struct.pack(">HBBBBHHHIIHbb", MAGIC, VERSION, msg_type, (age_op << 4) | flags,
                       dtype, src_id, src_cnt, gen_id, job_id, block_id, grad_cnt, exp, next_exp)


def elements(*values):
    return struct.pack(">%di" % len(values), *values)


def join_params(block_cnt_max, block_grad_max, block_exp_ms, incarnation, shard_count, next_block,
                packet_elems=358, flags=0, result_key=bytes(16), result_epoch=0):
    # the 48-byte body of JoinParams (value.rs): ... next_block, packet_elems,
    # result_key (wrapped), result_epoch
    return struct.pack(">IIIIHHII16sI", block_cnt_max, block_grad_max, block_exp_ms, incarnation,
                       shard_count, flags, next_block, packet_elems, result_key, result_epoch)


def nack(reason, detail):
    return struct.pack(">HHI", reason, 0, detail)


JOIN_ACK_BODY = join_params(256, 1024, 10, 0xDEADBEEF, 2, 4096)
NACK_BODY = nack(2, 17)

SEEDS = {
    "value_packet": {
        # golden vectors (value/tests.rs)
        "golden-contribution": header(CONTRIBUTION, flags=FINAL, dtype=1, src_id=3, gen_id=7,
                                      job_id=0x01020304, block_id=0x0A0B0C0D, grad_cnt=2,
                                      exp=5, next_exp=-2) + elements(1, -1),
        "golden-result": header(RESULT, age_op=1, flags=DEGRADED, src_cnt=3, gen_id=0xFFFF,
                                job_id=42, block_id=0xFFFFFFFF, grad_cnt=1) + elements(0x7FFFFFFF),
        "golden-join-ack": header(JOIN_ACK, src_id=2, src_cnt=4, job_id=9) + JOIN_ACK_BODY,
        "golden-nack": header(NACK, src_id=17, job_id=9) + NACK_BODY,
        "golden-trim-nack": header(NACK, flags=EXP_ONLY, dtype=1, src_id=3, gen_id=7, job_id=9,
                                   block_id=0x0A0B0C0D) + nack(10, 1),
        # one of every other shape
        "join": header(JOIN, src_id=1, src_cnt=4, job_id=9),
        "retransmission-exp-only": header(RETRANSMISSION, flags=EXP_ONLY, dtype=3, src_id=1,
                                          job_id=9, block_id=5, exp=3, next_exp=4),
        "result-bfloat16-final": header(RESULT, flags=FINAL, dtype=3, src_cnt=4, gen_id=1,
                                        job_id=9, block_id=6, grad_cnt=4, exp=-3)
        + elements(0, 1, -2, -0x80000000),
        "contribution-float16-empty": header(CONTRIBUTION, dtype=2, src_id=2, job_id=1),
    },
    "join_params": {
        "golden-join-ack-body": JOIN_ACK_BODY,
        "max": join_params(0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0xFFFF, 0xFFFFFFFF),
        "zero": join_params(0, 0, 0, 0, 0, 0),
        "wrapped-result-key": join_params(256, 1024, 10, 0xDEADBEEF, 2, 4096, flags=0x0005,
                                          result_key=bytes(range(0xA0, 0xB0)), result_epoch=0x0102),
    },
    "nack": {
        "golden-nack-body": NACK_BODY,
        "too-many-elements": nack(3, 1024),
        "block-out-of-window": nack(6, 0xFFFFFFFF),
        "shape-mismatch": nack(8, 256),
        "trimmed-processing-queue": nack(10, 1),
    },
    "preamble": {
        "contribution": struct.pack(">HBB", MAGIC, VERSION, CONTRIBUTION),
        "retransmission": struct.pack(">HBB", MAGIC, VERSION, RETRANSMISSION),
        "result": struct.pack(">HBB", MAGIC, VERSION, RESULT),
        "join": struct.pack(">HBB", MAGIC, VERSION, JOIN),
        "join-ack": struct.pack(">HBB", MAGIC, VERSION, JOIN_ACK),
        "nack": struct.pack(">HBB", MAGIC, VERSION, NACK),
    },
}



def kv_header(msg_type, *, flags=0, slot_count=0, channel=0, task_id=0, seq=0):
    return struct.pack(">HBBBBHII", MAGIC, VERSION, msg_type, flags, slot_count, channel, task_id, seq)


KV_DATA, KV_LONG, KV_ACK, KV_FIN, KV_FIN_ACK, KV_SWAP, KV_SWAP_ACK, KV_FETCH, KV_FETCH_REPLY, KV_CLEAR, \
    KV_CLEAR_ACK, KV_RELEASE, KV_NACK, KV_RELEASE_ACK = range(0x20, 0x2E)
KEY_AB = b"ab" + bytes(5) + b"\x02"
SEEDS["kv_packet"] = {
    # golden vectors (crates/fanin-wire/src/kv/tests.rs)
    "golden-data": kv_header(KV_DATA, slot_count=2, channel=5, task_id=0x01020304, seq=7)
    + struct.pack(">Q", 1) + KEY_AB + struct.pack(">q", 3) + bytes(16),
    "golden-ack": kv_header(KV_ACK, flags=1, channel=5, task_id=0x01020304, seq=7),
    "golden-fetch": kv_header(KV_FETCH, task_id=0x01020304, seq=9) + struct.pack(">BBHI", 1, 3, 32, 256),
    "golden-nack": kv_header(KV_NACK, channel=5, task_id=0x01020304, seq=7) + struct.pack(">HHI", 1, 0, 0x01020304),
    "long-data": kv_header(KV_LONG, slot_count=1, channel=1, task_id=1, seq=2)
    + struct.pack(">Hq", 9, -1) + b"long-key!",
    # one fragment of a 5 000-byte key: key_id 4, total 5000, offset 1176, 9 bytes
    "long-key-fragment": kv_header(KV_LONG, flags=4, slot_count=1, channel=1, task_id=1, seq=3)
    + struct.pack(">III", 4, 5000, 1176) + struct.pack(">Hq", 9, 7) + b"fragment!",
    "fetch-reply": kv_header(KV_FETCH_REPLY, task_id=1, seq=3) + struct.pack(">BBHII", 0, 1, 1, 0, 18)
    + struct.pack(">II", 17, 2) + KEY_AB + struct.pack(">qqq", -5, -7, 2),
    "clear": kv_header(KV_CLEAR, task_id=1, seq=3) + bytes([1, 0, 0, 0]),
    "swap-final": kv_header(KV_SWAP, flags=2, task_id=1, seq=3),
    "fin": kv_header(KV_FIN, channel=1, task_id=1, seq=100),
    "release": kv_header(KV_RELEASE, task_id=1),
}
# [len][who][datagram] records for kv_machines: a data packet from sender 0, a swap from the receiver
SEEDS["kv_machines"] = {
    "data-then-swap": bytes([len(SEEDS["kv_packet"]["golden-data"]) , 1]) + SEEDS["kv_packet"]["golden-data"]
    + bytes([16, 0]) + kv_header(KV_SWAP, task_id=1, seq=1),
}


def records(*pairs):
    """[len][from][datagram] records for machines (from's low bit picks the shard)."""
    return b"".join(bytes([len(d), frm]) + d for frm, d in pairs)


# machines: job 5 relayed (GOAT on-path filtering, next hops 8 and 9): a
# worker's contribution, a result from the next hop, a trimmed header, a join
# and its answer, and job 1 relayed for a source that is not its member
SEEDS["machines"] = {
    "relay": records(
        (20, header(CONTRIBUTION, src_id=3, job_id=5, grad_cnt=2) + elements(1, 2)),
        (8, header(RESULT, src_id=9, job_id=5, grad_cnt=2) + elements(3, 4)),
        (20, header(CONTRIBUTION, src_id=3, job_id=5, block_id=1, grad_cnt=2)),
        (22, header(JOIN, src_id=4, job_id=5)),
        (8, header(JOIN_ACK, src_id=4, job_id=5) + JOIN_ACK_BODY),
        (24, header(CONTRIBUTION, src_id=7, job_id=1, grad_cnt=1) + elements(5)),
    ),
}

assert len(SEEDS["value_packet"]["golden-contribution"]) == 32
assert len(SEEDS["kv_packet"]["golden-data"]) == 56
assert len(SEEDS["value_packet"]["golden-join-ack"]) == 24 + 48  # header + JoinParams::LEN

for target, seeds in SEEDS.items():
    folder = os.path.join(HERE, "corpus", target)
    os.makedirs(folder, exist_ok=True)
    for name, data in seeds.items():
        with open(os.path.join(folder, name), "wb") as f:
            f.write(data)
