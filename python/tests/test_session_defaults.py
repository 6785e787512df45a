"""Session options have one source: the Rust `SessionConfig::new` defaults.

`fanin.Session`'s signature, the torch backend's options and the protocol
document must all say the same (they had drifted: `rto_min` was 10 ms in
Rust and 25 ms in Python)."""

import inspect
import json
import re
from pathlib import Path

import fanin
from fanin import _native

ROOT = Path(__file__).resolve().parents[2]


def test_the_python_session_takes_its_defaults_from_rust():
    defaults = _native.session_defaults()
    assert set(defaults) == {"elems_per_packet", "window", "rto_ms", "rto_min_ms", "rto_max_ms", "join_timeout_s",
                             "dead_after_s", "barrier_timeout_s", "switch_gone_after_s"}
    params = inspect.signature(fanin.Session).parameters
    for name, value in defaults.items():
        assert params[name].default == value, name


def test_the_torch_backend_uses_the_same_packet_and_window():
    from fanin.torch._connect import ConnectOptions

    defaults = _native.session_defaults()
    opts = ConnectOptions()
    assert (opts.elems_per_packet, opts.window) == (defaults["elems_per_packet"], defaults["window"])


def test_the_protocol_document_states_the_defaults():
    text = (ROOT / "docs" / "protocol.md").read_text()
    line = re.search(r"Worker defaults:(.*?)\n\n", text, re.S).group(1).replace("\n", " ")
    d = _native.session_defaults()
    for expected in (f"`elems_per_packet` {d['elems_per_packet']}", f"`window` {d['window']}",
                     f"`rto_initial` {d['rto_ms']:g} ms", f"`rto_min` {d['rto_min_ms']:g} ms",
                     f"`rto_max` {d['rto_max_ms'] / 1000:g} s", f"`join_timeout` {d['join_timeout_s']:g} s",
                     f"`dead_after` {d['dead_after_s']:g} s", f"`switch_gone_after` {d['switch_gone_after_s']:g} s"):
        assert expected in line, (expected, line)


def test_a_session_made_without_options_runs_with_the_defaults():
    import numpy as np

    with fanin.local_switch(workers=1) as sw:
        s = _native.Session(sw.data_addr, 1, 0)  # every tunable left to Rust
        assert np.array_equal(s.allreduce(np.arange(3000, dtype=np.int32)), np.arange(3000, dtype=np.int32))


def test_a_hostname_is_an_address_and_a_hex_member_key_is_a_key():
    """`localhost:PORT` is accepted wherever a switch address is, and the
    member key as the CLI prints it (hex) is accepted as it is."""
    import numpy as np
    import pytest

    from fanin.switch import job_config

    key = fanin.new_job_key()
    with fanin.local_switch(workers=1, job_id=99, extra_jobs=[job_config(1, 1, key=key)]) as sw:
        port = sw.data_addr.rsplit(":", 1)[1]
        member = fanin.derive_member_key(key, 1, 0)
        s = fanin.Session(f"localhost:{port}", 1, 0, auth_key=member.hex())
        assert np.array_equal(s.allreduce(np.ones(10, dtype=np.int32)), np.ones(10, dtype=np.int32))
    with pytest.raises(ValueError, match="not hex; give 32 hex digits") as e:
        fanin.Session("127.0.0.1:9", 1, 0, auth_key="zz-almost-a-secret")
    assert "secret" not in str(e.value), "a mistyped key is never echoed"
    with pytest.raises(ValueError, match="is not HOST:PORT"):
        fanin.Session("localhost", 1, 0)
    with pytest.raises(ValueError, match="does not resolve"):
        fanin.Session("no-such-host.invalid:9000", 1, 0)


def test_every_layer_that_describes_a_job_takes_its_defaults_from_rust(tmp_path):
    """A job is described by the config file (Rust), `job_config`,
    `local_switch`, the switch API client, the controller's JobParams and its
    client: each default comes from `fanin._native.job_defaults()` (the
    default block_cnt_max was written out in seven places)."""
    from fanin.control import ControlClient
    from fanin.controller.server import ControllerClient
    from fanin.controller.service import JobParams
    from fanin.switch import job_config, local_switch

    defaults = _native.job_defaults()
    assert defaults == {"block_cnt_max": 256, "block_grad_max": 1024, "block_exp_ms": 0, "slow_after_windows": 2}
    layers = {
        "job_config": inspect.signature(job_config).parameters,
        "local_switch": inspect.signature(local_switch).parameters,
        "ControlClient.admit_job": inspect.signature(ControlClient.admit_job).parameters,
        "ControllerClient.create_job": inspect.signature(ControllerClient.create_job).parameters,
    }
    # The controller's layers leave block_grad_max unset: it then sizes the
    # default to the tree's smallest-MTU link (docs/trees.md), which a
    # written-out 1024 would defeat.
    sized_by_controller = {("ControllerClient.create_job", "block_grad_max")}
    for layer, params in layers.items():
        for name, value in defaults.items():
            expected = None if (layer, name) in sized_by_controller else value
            assert params[name].default == expected, (layer, name)
    job = JobParams(1)
    assert all(getattr(job, name) == value for name, value in defaults.items() if name != "block_grad_max")
    assert job.block_grad_max is None
    # and the CLI that creates a controller's job
    from fanin.cli import build_parser

    args = build_parser().parse_args(["controller", "create-job", "1"])
    assert (args.block_cnt_max, args.block_grad_max) == (defaults["block_cnt_max"], None)
    # the config file's defaults: a job naming only its id and sources
    path = tmp_path / "switch.toml"
    path.write_text("[[jobs]]\njob_id = 1\nsources = 2\n")
    cfg = json.loads(_native.load_config(str(path)))
    for name, value in defaults.items():
        assert cfg["jobs"][0][name] == value, name


def test_every_field_of_the_rust_job_is_taken_by_job_config_and_the_cli(tmp_path):
    """The job's fields are read from the Rust type (`JOB_SCHEMA`): a field
    added there fails here until `job_config` and `--job` take it, and each
    one they write is read back by the switch's own config parser."""
    from fanin._cli_util import job_arg
    from fanin.switch import JOB_SCHEMA, job_config, switch_config

    assert JOB_SCHEMA["block_cnt_max"] == _native.job_defaults()["block_cnt_max"]
    params = inspect.signature(job_config).parameters
    assert set(JOB_SCHEMA) == set(params), set(JOB_SCHEMA) ^ set(params)
    for name, default in JOB_SCHEMA.items():
        if name != "job_id":
            assert params[name].default == default, name
    values = {"job_id": "5", "members": "0:2", "sources": "2", "block_cnt_max": "8", "block_grad_max": "64",
              "block_exp_ms": "3", "slow_after_windows": "1", "mode": "forward", "workers": "4",
              "key": "000102030405060708090a0b0c0d0e0f", "on_failure": "fail", "member_timeout_ms": "700",
              "rate_limit": "100:10", "result_group": "239.1.0.7:47001", "quorum": "2"}
    assert set(values) == set(JOB_SCHEMA)
    for name, text in values.items():
        job = job_arg(f"{name}={text}" + ("" if name in ("sources", "members") else ",sources=2") + ",id=5")
        assert name in job, name
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(switch_config(jobs=[job])))
        (read,) = json.loads(_native.load_config(str(path)))["jobs"]
        assert read[name] not in (None, JOB_SCHEMA[name]) or name == "job_id", (name, read[name])
