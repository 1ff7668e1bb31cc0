"""Two hosts on one machine: network namespaces joined by a rate-limited veth pair.

A benchmark that should show what crossing a link costs (a weight push from trainer hosts
to inference hosts) runs one torchrun node in each namespace: ranks of one node talk over
their own namespace's stack, ranks of different nodes over the veth pair, whose egress
``tc`` shapes to the rate asked for (a token bucket, both ways). Root only; everything it
makes is named ``rsbench-<pid>-*`` and removed on exit, and no traffic leaves the
namespaces it made.

    with EmulatedLink("10gbit") as link:
        link.launch(4, script, args, results)   # 2 nodes x 4 ranks
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

__all__ = ["EmulatedLink"]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class EmulatedLink:
    """Namespaces ``a`` (node 0) and ``b`` (node 1), 10.77.<n>.1 and .2, joined at ``rate``
    (a ``tc`` rate: ``10gbit``, ``1gbit``, ``400mbit``)."""

    def __init__(self, rate: str, delay_ms: float = 0.0) -> None:
        if os.geteuid() != 0:
            raise SystemExit("--link needs root: it makes network namespaces and a veth pair")
        self.rate, self.delay_ms = rate, delay_ms
        tag = f"rsbench-{os.getpid()}"
        self.ns = (f"{tag}-a", f"{tag}-b")
        self.dev = (f"rsb{os.getpid() % 100000}a", f"rsb{os.getpid() % 100000}b")
        net = 10 + os.getpid() % 200
        self.addr = (f"10.77.{net}.1", f"10.77.{net}.2")

    def __enter__(self) -> EmulatedLink:
        try:
            for ns in self.ns:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "add", self.dev[0], "type", "veth", "peer", "name", self.dev[1])
            for ns, dev, addr in zip(self.ns, self.dev, self.addr):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                shape = ["tbf", "rate", self.rate, "burst", "8mb", "latency", "100ms"]
                if self.delay_ms:
                    shape = ["netem", "delay", f"{self.delay_ms}ms", "rate", self.rate]
                subprocess.run(
                    ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *shape],
                    check=True,
                    capture_output=True,
                    text=True,
                )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        for ns in self.ns:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, check=False)

    def launch(self, nproc_per_node: int, script: str, args: list[str], results: str) -> list[Any]:
        """torchrun ``script --worker`` on two nodes, one per namespace; the per-rank JSON
        lines (the file system is shared: only the network is split)."""
        if os.path.exists(results):
            os.remove(results)
        port = 29400  # in namespace a, which nothing else uses
        procs = []
        for node, (ns, dev) in enumerate(zip(self.ns, self.dev)):
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node-rank={node}",
                f"--nproc-per-node={nproc_per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.addr[0]}:{port}",
                # node 0 hosts the store: its address is not the host name torch looks up
                f"--rdzv-conf=is_host={'true' if node == 0 else 'false'}",
                f"--local-addr={self.addr[node]}",
                script,
                "--worker",
                "--results",
                results,
                *args,
            ]
            env = {
                **os.environ,
                "OMP_NUM_THREADS": "1",
                "LOGLEVEL": "WARNING",
                "GLOO_SOCKET_IFNAME": dev,
            }
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL))
        codes = [p.wait() for p in procs]
        if any(codes):
            raise SystemExit(f"a node of the two-host run failed: exit codes {codes}")
        with open(results) as f:
            return [json.loads(line) for line in f]
