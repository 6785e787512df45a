"""fanin: in-network aggregation you can run today.

A software aggregation switch (Trio-ML / SwitchML value-stream aggregation)
and the worker library that talks to it::

    import numpy as np, fanin
    with fanin.local_switch(workers=1) as sw:
        s = fanin.Session(sw.data_addr, job_id=1, rank=0)
        print(s.allreduce(np.arange(8, dtype=np.float32)))

See ``fanin --help`` for the command line (switch, demo, bench).
"""

from fanin._native import (FaninError, FaninRefused, FaninTimeout, InputOutOfRange, MemberFailed, MemberRestarted,
                           StaleResult, SwitchGone, __version__)
from fanin.auth import derive_member_key, new_job_key, read_key_file
from fanin.session import Session
from fanin.switch import LocalSwitch, local_switch

__all__ = [
    "FaninError",
    "FaninRefused",
    "FaninTimeout",
    "InputOutOfRange",
    "LocalSwitch",
    "MemberFailed",
    "MemberRestarted",
    "Session",
    "StaleResult",
    "SwitchGone",
    "local_switch",
    "__version__",
    "derive_member_key",
    "new_job_key",
    "read_key_file",
]
