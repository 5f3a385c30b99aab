"""Server processes for the benchmark, and what /proc says about them (CPU, memory).

Every server is started by us, on loopback, with its own log file, and stopped by its own
PID at the end (terminate, then kill after a grace period).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _children_map() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(raw[raw.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    return children


def tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (a server that forks workers is measured whole)."""
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of the process tree, in seconds (all threads included)."""
    total = 0
    for p in tree(pid):
        try:
            raw = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15 of stat)
    return total / CLK_TCK


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of the process tree, KiB."""
    out = {"rss_kib": 0, "hwm_kib": 0}
    for p in tree(pid):
        try:
            lines = Path(f"/proc/{p}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmRSS:"):
                out["rss_kib"] += int(line.split()[1])
            elif line.startswith("VmHWM:"):
                out["hwm_kib"] += int(line.split()[1])
    return out


def http_get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


@dataclass
class Server:
    """One server process we started."""

    name: str
    argv: list[str]
    port: int
    health: str | None  # path answering 200 when ready; None = TCP connect suffices
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    #: where it starts: ``python -m gateway`` imports the ``gateway`` of its working directory
    #: first, so a tree under test is both this and ``PYTHONPATH``
    cwd: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = open(self.log_path, "wb")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            self.argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env}, cwd=self.cwd,
        )

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; see {self.log_path}")
            try:
                if self.health is None:
                    with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                        return
                else:
                    with urllib.request.urlopen(self.base + self.health, timeout=1.0) as resp:
                        if resp.status == 200:
                            return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"{self.name} not ready after {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)


class LoadGen:
    """The load generator process: one JSON command in, one JSON reply out."""

    def __init__(self, python: str, script: Path) -> None:
        self.proc = subprocess.Popen(
            [python, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"load generator died (exit {self.proc.poll()})")
        return json.loads(line)  # type: ignore[no-any-return]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write('{"op": "quit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=5)


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine spent in user+nice+system (all cores), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()
    user, nice, system = (int(x) for x in fields[1:4])
    return (user + nice + system) / CLK_TCK


def raise_nofile(want: int = 8192) -> None:
    """Servers inherit this limit: 1000 open streams need ~2000 sockets in a relay."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))


def before_after_main(doc: str, run: Any, name: str) -> int:
    """The command line of a bench that measures one source tree (``--repo``, so main and a
    branch can be compared; ``--label`` names the run): ``run(repo, label)`` -> a result
    written to ``results/<name>-<label>.json`` and printed."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="source tree whose gateway is measured")
    parser.add_argument("--label", default="current")
    args = parser.parse_args()
    result = run(args.repo.resolve(), args.label)
    results = Path(__file__).resolve().parent / "results"
    results.mkdir(exist_ok=True)
    (results / f"{name}-{args.label}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0
