"""Control API of the fanin switch daemon (gRPC ``fanin.control.v1``).

    >>> from fanin.control import ControlClient
    >>> with ControlClient("127.0.0.1:9100") as c:
    ...     c.admit_job(1, members=range(4), block_cnt_max=64, block_grad_max=256)
    ...     c.list_jobs()
"""

from .client import API_VERSION, MODES, ControlClient, ControlError

__all__ = ["API_VERSION", "MODES", "ControlClient", "ControlError"]
