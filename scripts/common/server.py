"""Start, wait for and stop an OpenAI-compatible server process, by PID only.

The server runs in its own process group (start_new_session), so stopping it reaches vLLM's engine-core and worker
processes too without ever matching processes by name.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


class ServerError(RuntimeError):
    pass


def http_get(url: str, timeout: float = 5.0, api_key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url)
    if api_key:
        req.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def http_post(url: str, timeout: float = 600.0) -> int:
    """POST with an empty body; the status code (an HTTP error's too)."""
    req = urllib.request.Request(url, data=b"", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def http_post_json(url: str, body: dict, timeout: float = 60.0) -> tuple[int, dict | None]:
    """POST a JSON body; (status, the JSON answer or None)."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, raw = resp.status, resp.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, None


def is_healthy(base_url: str, timeout: float = 2.0, path: str = "/health", api_key: str | None = None) -> bool:
    """GET base_url+path answers 200 (vLLM's and SGLang's /health; an engine without one: its /v1/models, which a
    server started with a key answers only to that key)."""
    try:
        return http_get(f"{base_url}{path}", timeout=timeout, api_key=api_key)[0] == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
        return False


def stays_healthy(base_url: str, path: str = "/health", checks: int = 3, gap_s: float = 1.0) -> bool:
    """Healthy at each of `checks` looks `gap_s` apart: a server going down after failed requests can still answer
    one health check while it shuts down (llama.cpp's did, 2026-11-24)."""
    for i in range(checks):
        if i:
            time.sleep(gap_s)
        if not is_healthy(base_url, path=path):
            return False
    return True


def local_base_url(host: str, port: int) -> str:
    """The URL this machine reaches a server bound to host:port at (a wildcard bind is reached on loopback)."""
    return f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


PORT_RANGE_ENV = "LAB_PORT_RANGE"  # "LOW-HIGH": where free_port draws (each test lane its own, tests/conftest.py)


def port_range() -> tuple[int, int]:
    """(low, high) free_port draws from: 20000 up to the kernel's ephemeral range, or LAB_PORT_RANGE within it."""
    low, high = 20000, _ephemeral_low()
    text = os.environ.get(PORT_RANGE_ENV)
    if text:
        try:
            a, b = (int(x) for x in text.split("-"))
        except ValueError:
            raise ServerError(f"{PORT_RANGE_ENV}={text!r}: expected LOW-HIGH, e.g. 20000-26000") from None
        if not 1024 <= a < b:
            raise ServerError(f"{PORT_RANGE_ENV}={text!r}: expected 1024 <= LOW < HIGH")
        low, high = a, min(b, high)
    return low, high


def free_port(count: int = 1) -> int:
    """The first of `count` consecutive free ports on 127.0.0.1, drawn below the kernel's ephemeral range: a port
    bind(0) hands out is also the source port of some client connection, and a server that binds it a moment later
    fails with 'Address already in use' (seen with replica ports while another test lane ran). Two test lanes draw
    from halves of the range (LAB_PORT_RANGE): a port one lane checked free could be taken by the other's server
    before its own bound it (2026-12-07, the replicas' router port)."""
    low, high = port_range()
    high -= count
    for _ in range(200):
        base = low + int.from_bytes(os.urandom(4), "big") % max(1, high - low)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise ServerError(f"no {count} consecutive free ports in {low}..{high}")


def port_in_use(base_url: str) -> bool:
    """Whether something accepts TCP connections at base_url's host and port."""
    u = urllib.parse.urlsplit(base_url)
    with socket.socket() as sock:
        sock.settimeout(1.0)
        return sock.connect_ex((u.hostname or "127.0.0.1", u.port or 80)) == 0


def listeners(port: int) -> set[int]:
    """The PIDs of the processes holding a TCP socket that listens on `port` (any address, IPv4 or IPv6), read from
    /proc/net/tcp{,6} and each process's open files (a process of another user may hide its files: it is then not
    named, and the caller sees fewer listeners than sockets)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    pids = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:
            continue
        if any(fd.startswith("socket:[") and fd[8:-1] in inodes for fd in fds):
            pids.add(int(proc.name))
    return pids


def group_pids(pgid: int) -> list[int]:
    """PIDs still alive in a process group (Linux /proc)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # field 5 (pgrp) comes after the parenthesised command name, which may contain spaces
        fields = stat[stat.rindex(")") + 2:].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def group_rss_mib(pgid: int) -> float | None:
    """Resident memory of a process group (the vLLM server and its engine/worker processes), MiB; None when gone.
    Shared pages (the weights mapped by more than one process) count once per process: an upper bound."""
    total = 0
    for pid in group_pids(pgid):
        try:
            total += next(int(ln.split()[1]) for ln in Path(f"/proc/{pid}/status").read_text().splitlines()
                          if ln.startswith("VmRSS:"))
        except (OSError, StopIteration):
            continue
    return round(total / 1024, 1) if total else None


def last_error(log: Path | None) -> str:
    """A log's last error line (a script's one-line `error:`, an exception's `SomethingError: …`), else its last line:
    why a step or a server stopped, for a report or a pool's failed entry."""
    text = log.read_text(errors="replace") if log and log.exists() else ""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errs = [ln for ln in lines if ln.startswith("error:") or "Error" in ln.split(":")[0]]
    return (errs or lines or ["(no output)"])[-1][:300]


@dataclass
class Server:
    argv: list[str]
    base_url: str
    env: dict[str, str] = field(default_factory=dict)
    log_path: Path | None = None
    health_path: str = "/health"
    api_key: str | None = None  # the key it was started with (in its environment, never argv): the health check sends it
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    startup_s: float | None = None
    log_offset: int = 0  # where this start's output begins in log_path (the log is appended to across starts)
    attached_pid: int | None = None  # a server someone else started and stops (a pool's): its process group

    @classmethod
    def attached(cls, argv: list[str], base_url: str, pid: int, *, env: dict[str, str], log_path: Path | None,
                 health_path: str = "/health") -> Server:
        """A running server started by another process (scripts/serve/pool.py): measured as if started here, never
        stopped here; no startup time (its start shared the machine with the pool's other starts)."""
        return cls(argv=argv, base_url=base_url, env=env, log_path=log_path, health_path=health_path, attached_pid=pid)

    def start(self) -> Server:
        """Start the process in its own session. Refused while something listens on its port: health checks would be
        answered by that other server (a server orphaned by a killed run once stood in for a new one that could not
        bind)."""
        if port_in_use(self.base_url):
            raise ServerError(f"{self.base_url} is already in use (another server still running?); stop it or pick "
                              f"another port")
        full_env = {**os.environ, **self.env}
        self.log_offset = self.log_path.stat().st_size if self.log_path and self.log_path.exists() else 0
        out = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 - lives as long as the server
        self.started_at = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv, env=full_env, stdout=out, stderr=subprocess.STDOUT if out else None, start_new_session=True
        )
        return self

    @property
    def pid(self) -> int:
        if self.attached_pid is not None:
            return self.attached_pid
        assert self.proc is not None
        return self.proc.pid

    def wait_healthy(self, timeout_s: float = 900.0) -> float:
        """Block until the health path answers 200; returns seconds from process start. Raises if the process dies."""
        assert self.proc is not None
        deadline = self.started_at + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerError(f"server exited with code {self.proc.returncode} before it was healthy{self._log_hint()}")
            if is_healthy(self.base_url, path=self.health_path, api_key=self.api_key):
                self.startup_s = time.monotonic() - self.started_at
                return self.startup_s
            time.sleep(0.5)
        self.stop()
        raise ServerError(f"server not healthy after {timeout_s:.0f} s{self._log_hint()}")

    def check_own_port(self) -> None:
        """ServerError unless every process listening on this server's port is one of its own (its process group):
        another server sharing the port (SO_REUSEPORT) would answer some of the requests meant for this one."""
        port = urllib.parse.urlsplit(self.base_url).port
        mine = set(group_pids(self.pid))
        others = sorted(listeners(port) - mine) if port else []
        if others:
            self.stop()
            raise ServerError(f"port {port} is also held by process {', '.join(map(str, others))}, not this server: "
                              f"stop it or pick another port")

    def log_text(self) -> str:
        """What this start of the server wrote to its log (not earlier starts' output)."""
        if not self.log_path or not self.log_path.exists():
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            return f.read().decode(errors="replace")

    def _log_hint(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        tail = self.log_path.read_text(errors="replace").strip().splitlines()[-3:]
        return f"; log {self.log_path}: " + " | ".join(tail)

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever is left of it."""
        if self.proc is None:
            return
        pgid = self.proc.pid
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                self.proc.poll()
                if not group_pids(pgid):
                    break
                time.sleep(0.2)
            if not group_pids(pgid):
                break
        self.proc.wait(timeout=10)


def stop_on_signals(stop: Callable[[], None], describe: Callable[[], str]) -> Callable[[], bool]:
    """SIGINT and SIGTERM call stop() once, after printing "<SIGNAL>: stopping <describe()>"; the function returned
    tells whether a signal came (what `make serve` and `make serve-replicas` wait on)."""
    came: list[bool] = []

    def on_signal(signum, _frame):
        if not came:
            came.append(True)
            print(f"\n{signal.Signals(signum).name}: stopping {describe()}", flush=True)
            stop()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return lambda: bool(came)
