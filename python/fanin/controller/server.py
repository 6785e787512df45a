"""The controller over gRPC (`fanin.control.v1.Controller`), and the client
workers use to subscribe."""

from __future__ import annotations

import hmac
import json
import logging
from concurrent import futures
from typing import Any, Optional

import grpc

from ..control._gen import control_pb2 as pb
from ..control._gen import control_pb2_grpc as pb_grpc
from ..control.client import RECONNECT_OPTIONS, call_rpc, control_token_from_env
from ..switch import JOB_DEFAULTS
from .service import Controller, ControllerError, JobParams
from .watch import RestartWatcher

__all__ = ["ControllerServer", "ControllerClient", "serve"]

log = logging.getLogger(__name__)


class _Servicer(pb_grpc.ControllerServicer):
    def __init__(self, controller: Controller, token: Optional[str]):
        self.c = controller
        self.token = token

    def _run(self, context, fn):
        if self.token is not None:
            md = dict(context.invocation_metadata())
            got = str(md.get("authorization", "")).encode()
            if not hmac.compare_digest(got, f"Bearer {self.token}".encode()):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
        try:
            return fn()
        except ControllerError as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))

    def CreateJob(self, request, context):
        def go():
            self.c.create_job(JobParams(
                job_id=request.job_id,
                block_cnt_max=request.block_cnt_max or JOB_DEFAULTS["block_cnt_max"],
                # 0 (unset): the default, sized to the tree's links
                block_grad_max=request.block_grad_max or None,
                block_exp_ms=request.block_exp_ms,
                slow_after_windows=(request.slow_after_windows if request.HasField("slow_after_windows")
                                    else JOB_DEFAULTS["slow_after_windows"]),
                max_workers=request.max_workers or 64,
                on_failure=(None if not request.HasField("on_failure") else
                            "fail" if request.on_failure == pb.FailurePolicy.FAILURE_POLICY_FAIL else "degrade"),
                member_timeout_ms=request.member_timeout_ms,
                # absent = keyed: safe by default, also for older clients
                auth=request.auth if request.HasField("auth") else True,
            ))
            return pb.CreateJobResponse()
        return self._run(context, go)

    def DeleteJob(self, request, context):
        return self._run(context, lambda: (self.c.delete_job(request.job_id), pb.DeleteJobResponse())[1])

    def Subscribe(self, request, context):
        def go():
            r = self.c.subscribe(request.job_id, request.rank, request.host, sync=request.sync)
            return pb.SubscribeResponse(data_addr=r["data_addr"], programmed=r["programmed"],
                                        member_key=r["member_key"] or b"")
        return self._run(context, go)

    def Unsubscribe(self, request, context):
        def go():
            r = self.c.unsubscribe(request.job_id, request.rank)
            return pb.UnsubscribeResponse(programmed=r["programmed"])
        return self._run(context, go)

    def GetTree(self, request, context):
        def go():
            tree = self.c.tree(request.job_id)
            return pb.GetTreeResponse(tree_json=json.dumps(tree.to_dict() if tree else None))
        return self._run(context, go)


class ControllerServer:
    """A running gRPC server around a :class:`Controller`."""

    def __init__(self, controller: Controller, listen: str = "127.0.0.1:9200", token: Optional[str] = None,
                 reconcile_s: float = 0.25, rebuild: bool = True):
        # an empty token is none (it would let "Bearer " with nothing after it in)
        token = token or control_token_from_env()
        host = listen.rsplit(":", 1)[0].strip("[]")
        if token is None and host not in ("127.0.0.1", "localhost", "::1"):
            # Safe by default (docs/security.md): anyone who reaches the
            # controller could create jobs and obtain member keys.
            raise ValueError(f"controller: listening on {listen} (not loopback) needs a token "
                             "(--token or FANIN_CONTROL_TOKEN)")
        self.controller = controller
        if rebuild:
            # a restarted controller takes the running jobs back from the
            # switches before it answers anyone (docs/restart.md)
            report = controller.rebuild()
            for job_id in report["adopted"]:
                log.warning("controller: adopted job %d from the switches", job_id)
            for job_id, why in report["not_adopted"].items():
                log.error("controller: job %d not adopted from the switches: %s", job_id, why)
            for why in report["unreachable"]:
                log.warning("controller: switch not reachable while rebuilding: %s", why)
        # gRPC's default SO_REUSEPORT let a second controller bind the same
        # port, and calls then went to either at random: one owner per port
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_ControllerServicer_to_server(_Servicer(controller, token), self._server)
        try:
            port = self._server.add_insecure_port(listen)
        except RuntimeError:  # grpc's "Failed to bind"
            port = 0
        if port == 0:
            raise OSError(f"controller: cannot listen on {listen} (in use by another process, or not an address "
                          "of this machine): pick another --listen")
        # re-installs jobs on restarted switches (docs/restart.md)
        self._watcher = RestartWatcher(controller, reconcile_s)
        host = listen.rsplit(":", 1)[0]
        self.addr = f"{host}:{port}"
        self._server.start()

    def stop(self) -> None:
        self._watcher.stop()
        self._server.stop(grace=1).wait()
        self.controller.close()

    def wait(self) -> None:
        self._server.wait_for_termination()

    def __enter__(self) -> "ControllerServer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def serve(controller: Controller, listen: str, token: Optional[str] = None) -> ControllerServer:
    return ControllerServer(controller, listen, token)


class ControllerClient:
    """What a worker (or an operator) uses to talk to `fanin controller`.

        >>> c = ControllerClient("127.0.0.1:9200")
        >>> c.create_job(1, max_workers=8)          # keyed (auth=False: unauthenticated)
        >>> sub = c.subscribe(1, rank=0, host="h0_0_0")
        >>> s = fanin.Session(sub["data_addr"], job_id=1, rank=0, auth_key=sub["member_key"])
    """

    def __init__(self, addr: str, token: Optional[str] = None, timeout: float = 10.0):
        self.addr = addr
        self.timeout = timeout
        self._channel = grpc.insecure_channel(addr, options=RECONNECT_OPTIONS)
        self._stub = pb_grpc.ControllerStub(self._channel)
        token = token if token is not None else control_token_from_env()
        self._metadata = [("authorization", f"Bearer {token}")] if token else None

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "ControllerClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: str, request: Any) -> Any:
        return call_rpc(self._stub, method, request, addr=self.addr, timeout=self.timeout, metadata=self._metadata)

    def create_job(self, job_id: int, *, block_cnt_max: int = JOB_DEFAULTS["block_cnt_max"],
                   block_grad_max: Optional[int] = None, block_exp_ms: int = JOB_DEFAULTS["block_exp_ms"],
                   slow_after_windows: int = JOB_DEFAULTS["slow_after_windows"], max_workers: int = 64,
                   on_failure: Optional[str] = None, member_timeout_ms: int = 0, auth: bool = True) -> None:
        """Create a job. ``auth`` (default True): the controller draws a job
        key and every subscriber gets a member key (docs/security.md).
        ``on_failure`` None: "degrade" if ``block_exp_ms`` > 0, else "fail"."""
        policy = {"degrade": pb.FailurePolicy.FAILURE_POLICY_DEGRADE, "fail": pb.FailurePolicy.FAILURE_POLICY_FAIL,
                  None: None}
        if on_failure not in policy:
            raise ValueError(f"on_failure must be degrade, fail or None (the default for block_exp_ms), "
                             f"not {on_failure!r}")
        # the controller's own checks, here, so a caller gets the field's
        # name and range (protobuf says "Value out of range: -1"), and a 0
        # is refused rather than sent as "the default"
        try:
            JobParams(job_id, block_cnt_max=block_cnt_max, block_grad_max=block_grad_max, block_exp_ms=block_exp_ms,
                      slow_after_windows=slow_after_windows, max_workers=max_workers, on_failure=on_failure,
                      member_timeout_ms=member_timeout_ms, auth=auth).validate()
        except ControllerError as e:
            raise ValueError(str(e)) from None
        self._call("CreateJob", pb.CreateJobRequest(
            job_id=job_id, block_cnt_max=block_cnt_max, block_grad_max=block_grad_max or 0, block_exp_ms=block_exp_ms,
            slow_after_windows=slow_after_windows, max_workers=max_workers, on_failure=policy[on_failure],
            member_timeout_ms=member_timeout_ms, auth=auth))

    def delete_job(self, job_id: int) -> None:
        self._call("DeleteJob", pb.DeleteJobRequest(job_id=job_id))

    def subscribe(self, job_id: int, rank: int, host: str, sync: bool = False) -> dict:
        """Join job `job_id` as `rank` on topology host `host`: ``data_addr``,
        ``programmed`` and ``member_key`` (16 bytes for
        ``fanin.Session(auth_key=...)``, None for an unauthenticated job)."""
        r = self._call("Subscribe", pb.SubscribeRequest(job_id=job_id, rank=rank, host=host, sync=sync))
        return {"data_addr": r.data_addr, "programmed": list(r.programmed), "member_key": bytes(r.member_key) or None}

    def unsubscribe(self, job_id: int, rank: int) -> dict:
        r = self._call("Unsubscribe", pb.UnsubscribeRequest(job_id=job_id, rank=rank))
        return {"programmed": list(r.programmed)}

    def tree(self, job_id: int) -> Optional[dict]:
        return json.loads(self._call("GetTree", pb.GetTreeRequest(job_id=job_id)).tree_json)
