"""Shared fixtures: a real moto S3 server on 127.0.0.1 (server mode, its own process; its
conditional writes made atomic as S3's are, see ``tests/support/moto_s3.py``),
reset between tests, and an ``s3`` bucket fixture with s3fs configured in-process and
through the environment (so spawned workers and servers reach it too)."""

from __future__ import annotations

import ast
import functools
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import fsspec
import fsspec.config
import httpx
import pytest

from tests.support.harness import free_port, start_forkserver

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")


# ---- the suite on several pytest workers (``make test``: pytest-xdist, ``--dist loadscope``)

#: A fixture of module, class or package scope: that module's tests share it.
_SCOPED = re.compile(r"""scope=["'](module|class|package)["']""")
#: Session fixtures that stand for the one cluster of its kind a host runs.
_CLUSTERS = ("slurm", "ray_cluster")


@functools.cache
def _unit(rootdir: str, module: str) -> str | None:
    """The unit a module's tests are handed out in: the cluster they use (every module on
    it goes to one worker, so the host runs it once), the module (it shares a scoped
    fixture), or None (each test on its own)."""
    try:
        text = Path(rootdir, module).read_text()
        tree = ast.parse(text)
    except (OSError, SyntaxError):
        return module  # not a file we can read: keep it whole
    args = {
        a.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        for a in node.args.args
    }
    for cluster in _CLUSTERS:
        if cluster in args:
            return f"the {cluster} cluster"
    return module if _SCOPED.search(text) else None


def pytest_xdist_make_scheduler(config, log):
    """``--dist loadscope``, by what tests share (:func:`_unit`): a module that shares a
    fixture stays on one worker, in order, and so do all the modules on one cluster; every
    other test goes to whichever worker is free (a module of long, independent cases, such
    as the bench smoke runs, no longer queues on one worker)."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    rootdir = str(config.rootpath)

    class ByWhatIsShared(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit(rootdir, nodeid.split("::", 1)[0]) or nodeid

    return ByWhatIsShared(config, log)


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (whose workers collect, each sorting alike): the slow tests are
    handed out first, then the rest of their modules, so no long one starts last while
    the other worker idles (``make test`` keeps this order: ``--no-loadscope-reorder``). A
    module's tests keep their order among themselves."""
    if not hasattr(config, "workerinput"):
        return
    slow = {item.module.__name__ for item in items if item.get_closest_marker("slow")}
    items.sort(
        key=lambda item: (
            item.get_closest_marker("slow") is None,
            item.module.__name__ not in slow,
        )
    )


@pytest.fixture(scope="session", autouse=True)
def _worker_forkserver():
    """The gloo workers' forkserver, started before any test changes the environment."""
    start_forkserver()


@pytest.fixture(scope="session")
def moto_server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.support.moto_s3", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url + "/moto-api/", timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("moto server did not start")
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture
def s3(moto_server, monkeypatch):
    """A fresh bucket on the moto server; s3fs configured (in-process and via env)."""
    httpx.post(moto_server + "/moto-api/reset")
    opts = {"endpoint_url": moto_server, "key": "testing", "secret": "testing"}
    monkeypatch.setenv("FSSPEC_S3", json.dumps(opts))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setitem(fsspec.config.conf, "s3", dict(opts))
    fs = fsspec.filesystem("s3", skip_instance_cache=True, **opts)
    bucket = f"ckpt-{uuid.uuid4().hex[:8]}"
    fs.mkdir(bucket)
    fsspec.filesystem("s3", **opts).invalidate_cache()
    yield f"s3://{bucket}"


@pytest.fixture
def small_tmpfs(tmp_path):
    """``small_tmpfs("64k")``: a real tmpfs of that size (root only; skipped elsewhere),
    unmounted after the test: a storage that fills up."""
    mounted = []

    def mount(size: str):
        where = tmp_path / f"tmpfs-{len(mounted)}"
        where.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
            capture_output=True,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


# ---- heap errors fail the test that saw them (tests/support/heap.py)

os.environ.setdefault("RESHARD_DEBUG_BUFFERS", "1")  # poisoned releases, checked on reuse


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    from tests.support.heap import heap_error

    outcome = yield
    report = outcome.get_result()
    text = "\n".join(content for _, content in report.sections)
    found = heap_error(text)
    if found is not None:
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid}: a process aborted on a heap error during {report.when}: "
            f"{found!r} (glibc's heap checks; see the captured output)"
        )
