"""Every quickstart in the README and docs/ runs exactly as written.

A quickstart is a ```sh block right after a `<!-- quickstart -->` line
(`<!-- quickstart: needs pyspark -->` when it needs more than fanin). Each
runs in bash inside a fresh network namespace, so the fixed ports it names
(127.0.0.1:9000, 9100) never meet another process's; `fanin` and `python3`
are this checkout's. (Not a private /tmp: the checkout itself may live
under /tmp, as CI's clean clone can. The one /tmp path a block names, the kv
daemon's socket, is checked to be free first.) A block fails the test if any
command in it fails (the blocks assert their own results).
"""

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"^<!-- quickstart(?::\s*needs (?P<needs>[\w-]+))? -->\n```sh\n(?P<code>.*?)^```$", re.M | re.S)


def quickstarts():
    return [pytest.param(m["code"], m["needs"], id=f"{doc.relative_to(ROOT)}#{i}")
            for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
            for i, m in enumerate(MARK.finditer(doc.read_text()))]


def test_the_readme_and_kv_md_have_quickstarts():
    ids = [p.id for p in quickstarts()]
    assert any(i.startswith("README.md#") for i in ids) and any(i.startswith("docs/kv.md#") for i in ids), ids


def _why_not(needs):
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "needs root and unshare(1) for a private network namespace"
    if needs == "pyspark":
        try:
            import pyspark  # noqa: F401
        except ImportError:
            return "pyspark is not installed"
        from fanin.spark import ensure_java_home

        ensure_java_home()
        if not os.environ.get("JAVA_HOME") and shutil.which("java") is None:
            return "no Java for Spark"
    elif needs:
        return f"unknown requirement {needs!r}"
    return None


@pytest.mark.parametrize("code,needs", quickstarts())
def test_quickstart_runs_as_written(code, needs):
    reason = _why_not(needs)
    if reason:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    sockets = re.findall(r"/tmp/[\w.-]+\.sock", code)
    for path in sockets:
        if os.path.exists(path):
            reason = f"{path} exists (a kv daemon of someone else's may be using it)"
            print(f"skipped: {reason}")
            pytest.skip(reason)
    try:
        with tempfile.TemporaryDirectory(prefix="fanin-quickstart-") as tmp:
            _run(code, Path(tmp))
    finally:
        for path in sockets:  # ours: it did not exist before
            if os.path.exists(path):
                os.unlink(path)


def _run(code, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, argv in (("fanin", f'"{sys.executable}" -m fanin'), ("python3", f'"{sys.executable}"')):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\nexec {argv} \"$@\"\n")
        shim.chmod(0o755)
    script = tmp_path / "quickstart.sh"
    script.write_text(
        "set -euo pipefail\n"
        "ip link set lo up\n"
        # the shims are this checkout's fanin and python3
        f"[ \"$(command -v fanin)\" = {bin_dir}/fanin ]\n"
        # whatever the block leaves running goes when it ends
        "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n"
        + code)
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "python"), os.environ.get("PYTHONPATH")])))
    r = subprocess.run(["unshare", "--net", "bash", str(script)],
                       capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert r.returncode == 0, f"exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
