"""A Spark standalone cluster on this machine, with a fanin kv daemon per worker.

``local[N]`` runs every task in one JVM next to the driver; a real cluster
has a master, workers on other hosts, and executors that the workers
launch. ``StandaloneCluster`` starts exactly that from the PySpark wheel's
own ``spark-class`` (no Spark download): one master and ``workers`` worker
JVMs, each a separate process with its own ``fanin kv daemon``; a worker's
``FANIN_KV_SOCKET`` names its daemon, and the executors it launches inherit
it, so each executor talks to the daemon of "its host" and the driver to
none. Tests, ``fanin bench kv-wordcount --cluster`` and the quickstart use it::

    from fanin.spark.cluster import StandaloneCluster
    with StandaloneCluster(switch_control="127.0.0.1:9100", workers=2) as cluster:
        sc = cluster.context("my-app")
        ...
        cluster.kill_executor(1)   # SIGKILL worker 1's executor JVM

The processes are children of this one; ``stop`` (or the ``with``) ends them.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

from fanin.kv import DaemonProcess
from fanin.spark.rdd import SOCKET_ENV

__all__ = ["StandaloneCluster", "SparkClusterError", "spark_class"]

#: Seconds a master or worker may take to come up (a cold JVM on 2 busy cores
#: takes 3-8 s).
START_TIMEOUT_S = 90.0


class SparkClusterError(RuntimeError):
    """The cluster could not be started; the message quotes the process's log."""


def spark_class() -> str:
    """``bin/spark-class`` of the installed PySpark (it ships the jars)."""
    import pyspark

    path = os.path.join(os.path.dirname(pyspark.__file__), "bin", "spark-class")
    if not os.path.exists(path):
        raise SparkClusterError(f"{path} is missing: install PySpark from PyPI (pip install 'pyspark>=3.5,<3.6')")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _JvmProcess:
    """One Spark daemon JVM, its log in a file, ready when a line matches."""

    def __init__(self, name: str, args: list[str], env: dict, log_path: str) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "wb")
        # its own process group: stop() ends the JVM and anything it started
        self.proc = subprocess.Popen([spark_class(), *args], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def wait_for(self, pattern: str, timeout: float = START_TIMEOUT_S) -> str:
        deadline = time.monotonic() + timeout
        regex = re.compile(pattern)
        while time.monotonic() < deadline:
            text = self.log()
            found = regex.search(text)
            if found:
                return found.group(0)
            if self.proc.poll() is not None:
                raise SparkClusterError(f"the Spark {self.name} exited with {self.proc.returncode}:\n{text[-3000:]}")
            time.sleep(0.1)
        raise SparkClusterError(f"the Spark {self.name} did not log /{pattern}/ within {timeout:.0f} s:\n"
                                f"{self.log()[-3000:]}")

    def log(self) -> str:
        with open(self.log_path, "rb") as f:
            return f.read().decode("utf-8", "replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        self._log.close()


class StandaloneCluster:
    """A master and ``workers`` worker JVMs on 127.0.0.1, each worker with its
    own kv daemon (started against ``switch_control``, the switch's control
    API). ``cores_per_worker`` task slots each."""

    def __init__(self, switch_control: str, *, workers: int = 2, cores_per_worker: int = 1,
                 worker_memory: str = "1g", daemon_options: Optional[dict] = None,
                 work_dir: Optional[str] = None) -> None:
        if workers < 1 or cores_per_worker < 1:
            raise ValueError("StandaloneCluster needs at least one worker with at least one core")
        self.workers = workers
        self.cores_per_worker = cores_per_worker
        self.work_dir = work_dir or tempfile.mkdtemp(prefix="fanin-spark-cluster-")
        self.daemons: list[DaemonProcess] = []
        self._jvms: list[_JvmProcess] = []
        self._worker_jvms: list[_JvmProcess] = []
        from fanin.spark import ensure_java_home

        ensure_java_home()
        env = dict(os.environ)
        # the executors' Python: this interpreter and this fanin
        env.setdefault("PYSPARK_PYTHON", sys.executable)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        env["SPARK_LOG_DIR"] = self.work_dir
        try:
            port = _free_port()
            master = _JvmProcess("master", ["org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                                            "--port", str(port), "--webui-port", "0"],
                                 env, os.path.join(self.work_dir, "master.log"))
            self._jvms.append(master)
            master.wait_for(r"Successfully started service 'sparkMaster'")
            self.master_url = f"spark://127.0.0.1:{port}"
            for i in range(workers):
                daemon = DaemonProcess(switch_control, socket_path=os.path.join(self.work_dir, f"kv-{i}.sock"),
                                       **(daemon_options or {}))
                self.daemons.append(daemon)
                worker_env = dict(env, **{SOCKET_ENV: daemon.socket_path})
                worker_dir = os.path.join(self.work_dir, f"worker-{i}")
                os.makedirs(worker_dir, exist_ok=True)
                worker = _JvmProcess(f"worker {i}", ["org.apache.spark.deploy.worker.Worker", "--host", "127.0.0.1",
                                                     "--cores", str(cores_per_worker), "--memory", worker_memory,
                                                     "--webui-port", "0", "--work-dir", worker_dir, self.master_url],
                                     worker_env, os.path.join(self.work_dir, f"worker-{i}.log"))
                self._jvms.append(worker)
                self._worker_jvms.append(worker)
            for worker in self._worker_jvms:
                worker.wait_for(r"Successfully registered with master")
        except BaseException:
            self.stop()
            raise

    @property
    def slots(self) -> int:
        return self.workers * self.cores_per_worker

    def context(self, app_name: str = "fanin", **conf: str) -> Any:
        """A SparkContext on this cluster, waiting until every worker's executor
        has registered (a barrier stage needs all slots). ``conf``: more
        Spark settings (dots as given)."""
        from pyspark import SparkConf, SparkContext

        settings = {"spark.ui.enabled": "false", "spark.executor.cores": "1",
                    "spark.executor.memory": "512m", "spark.driver.host": "127.0.0.1",
                    "spark.driver.bindAddress": "127.0.0.1", **conf}
        spark_conf = SparkConf().setMaster(self.master_url).setAppName(app_name)
        for key, value in settings.items():
            spark_conf.set(key, value)
        sc = SparkContext.getOrCreate(spark_conf)
        sc.setLogLevel("ERROR")
        self.wait_for_executors(sc)
        return sc

    def wait_for_executors(self, sc: Any, timeout: float = START_TIMEOUT_S) -> None:
        """Block until every slot has an executor (after a start or a kill)."""
        from fanin.spark.rdd import task_slots

        deadline = time.monotonic() + timeout
        while task_slots(sc) < self.slots or self._executors(sc) < self.workers:
            if time.monotonic() > deadline:
                raise SparkClusterError(f"{self._executors(sc)} of {self.workers} executors registered within "
                                        f"{timeout:.0f} s; see the logs in {self.work_dir}")
            time.sleep(0.2)

    @staticmethod
    def _executors(sc: Any) -> int:
        # the driver counts itself among the block managers
        return int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1

    def executor_pids(self, worker: int) -> list[int]:
        """PIDs of the executor JVMs worker ``worker`` launched."""
        parent = self._worker_jvms[worker].proc.pid
        pids = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as f:
                    # pid (comm) state ppid ...: comm may hold spaces, so split after ')'
                    ppid = int(f.read().rsplit(b")", 1)[1].split()[1])
                if ppid != parent:
                    continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if b"CoarseGrainedExecutorBackend" in f.read():
                        pids.append(int(entry))
            except (OSError, IndexError, ValueError):
                pass
        return pids

    def kill_executor(self, worker: int) -> int:
        """SIGKILL worker ``worker``'s executor (as a crashed or preempted host
        would lose it); the worker launches a new one. Returns the PID."""
        pids = self.executor_pids(worker)
        if not pids:
            raise SparkClusterError(f"worker {worker} runs no executor")
        os.kill(pids[0], signal.SIGKILL)
        return pids[0]

    def stop(self) -> None:
        for jvm in reversed(self._jvms):
            jvm.stop()
        self._jvms.clear()
        for daemon in self.daemons:
            daemon.stop()
        self.daemons.clear()

    def __enter__(self) -> "StandaloneCluster":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
