"""Fixtures shared by several test modules (a module's own fixture of the
same name takes precedence)."""

import pytest

from fanin.proc import SwitchProcess
from fanin.switch import switch_config


@pytest.fixture(scope="module")
def switch():
    """A switch process with a control API on an ephemeral port (the
    key-value tests allocate regions through it)."""
    sw = SwitchProcess(switch_config(data_addr="127.0.0.1:0", control_addr="127.0.0.1:0", metrics_addr=None))
    yield sw
    sw.stop()
