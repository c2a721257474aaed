"""Replicas of a variant behind vLLM's router (vllm-router, PyPI): what `make serve-replicas` runs.

    python -m scripts.serve.replicas smollm2-bf16 --replicas 2                         # cache_aware, router on :8000
    python -m scripts.serve.replicas smollm2-bf16 --replicas 2 --policy round_robin --port 8000
    python -m scripts.serve.replicas qwen35-4b-proxy-bf16 --replicas 2                 # one GPU each (TP x DP of the variant)
    python -m scripts.serve.replicas smollm2-bf16 --replicas 2 --share-gpu             # both on GPU 0 (router plumbing, not scale)
    python -m scripts.serve.replicas smollm2-bf16 --replicas 2 --dry-run               # the exact commands only

Each replica is the variant's own server (scripts.serve.launch.make_server: the same flags, guards and key) on
port+1, port+2, ..., placed so replicas never share a device: on a GPU machine each gets TP x DP devices of its own
(CUDA_VISIBLE_DEVICES; refused when the machine has fewer), on a CPU the cores are split evenly
(VLLM_CPU_OMP_THREADS_BIND and OMP_NUM_THREADS; llama.cpp engines: their thread flag). The router starts once every
replica answers /health; its health checks drop a replica that stops answering and its retries move a failed
request to another. Every process is started in its own process group and stopped by PID (router first), on Ctrl-C,
SIGTERM or when any of them exits.

While they run, .cache/replicas/<variant>.json holds the topology (router, policy, the replicas' URLs, PIDs and
placement) that `make eval-latency TOPOLOGY=…` records and reads each replica's /metrics from; it is removed at stop.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field, replace
from importlib import metadata
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.engines import engine_of
from scripts.common.hardware import hardware
from scripts.common.server import (
    Server,
    ServerError,
    free_port,
    is_healthy,
    local_base_url,
    port_in_use,
    stop_on_signals,
)
from scripts.common.variants import Variant, VariantError, load_variant, parse_overrides
from scripts.serve.command import DEFAULT_HOST, DEFAULT_PORT, printable
from scripts.serve.launch import make_server
from scripts.serve.plan import parallel_size, parallelism

ROUTERS = ("vllm-router",)
# vllm-router 0.1.17's policies (vllm_router/router_args.py); kv_aware needs KV events from the engines, not wired here
POLICIES = ("round_robin", "cache_aware", "power_of_two", "random", "consistent_hash", "sticky_least_loaded")
TOPOLOGY_DIR = paths.CACHE / "replicas"
# Router settings the project picks over vllm-router's defaults: a replica that stops answering leaves the rotation
# after 2 failed checks 2 s apart (default: 3 checks 60 s apart, a minute of errors), and a request that fails on one
# replica is retried on another at most twice. Its circuit breaker opens on a replica's second failure, for 5 s: the
# router's retries otherwise went back to the replica just killed, and requests sent in the 20 ms after the kill got
# a 500 (2 of 48 at c=8, experiments/smollm2-gguf-q8-0-server/failover_20261128-192012.json; none lost with it).
ROUTER_DEFAULTS = {"--health-check-interval-secs": "2", "--health-failure-threshold": "2",
                   "--health-check-timeout-secs": "2", "--retry-max-retries": "3", "--request-timeout-secs": "600",
                   "--cb-failure-threshold": "2", "--cb-timeout-duration-secs": "5"}


class ReplicaError(ValueError):
    pass


def placements(variant: Variant, replicas: int, *, gpus: int, cpus: int, share_gpu: bool = False) -> list[dict[str, str]]:
    """Settings that place replica i: its own GPUs (CUDA_VISIBLE_DEVICES), the GPU shared with a 1/N memory budget
    (share_gpu), or its own slice of the CPU cores. One-line ReplicaError when the machine has too few."""
    if replicas < 1:
        raise ReplicaError(f"--replicas {replicas}: at least 1")
    size = parallel_size(variant)
    engine = engine_of(variant).name
    if variant.target != "cpu":
        if share_gpu:
            if size != 1:
                raise ReplicaError(f"--share-gpu: {variant.name} spans {size} GPUs per server")
            util = float(variant.resolved.get("SERVE_GPU_MEMORY_UTILIZATION", "0.9")) / replicas
            return [{"ENV_CUDA_VISIBLE_DEVICES": "0", "SERVE_GPU_MEMORY_UTILIZATION": f"{util:.3f}"}] * replicas
        if replicas * size > gpus:
            raise ReplicaError(f"{replicas} replicas of {variant.name} need {replicas * size} GPUs ({size} each); "
                               f"this machine has {gpus} (--share-gpu puts them all on GPU 0)")
        return [{"ENV_CUDA_VISIBLE_DEVICES": ",".join(str(i * size + j) for j in range(size))} for i in range(replicas)]
    if replicas > cpus:
        raise ReplicaError(f"{replicas} replicas need at least {replicas} CPU cores; this machine has {cpus}")
    per = cpus // replicas
    out = []
    for i in range(replicas):
        first, last = i * per, i * per + per - 1
        cores = str(first) if per == 1 else f"{first}-{last}"
        if engine == "vllm":
            out.append({"ENV_VLLM_CPU_OMP_THREADS_BIND": cores, "ENV_OMP_NUM_THREADS": str(per),
                        "ENV_VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
        elif engine == "llamaserver":  # its --cpu-range takes only <start>-<end>, one core too ("1-1")
            out.append({"LLAMASERVER_THREADS": str(per), "LLAMASERVER_THREADS_BATCH": str(per),
                        "LLAMASERVER_CPU_RANGE": f"{first}-{last}"})
        else:
            raise ReplicaError(f"{variant.name}: replicas of ENGINE={engine} are not placed on CPU cores here "
                               f"(vllm and llamaserver are)")
    return out


def router_argv(urls: list[str], *, policy: str, host: str, port: int, metrics_port: int,
                extra: list[str] | None = None) -> list[str]:
    if policy not in POLICIES:
        raise ReplicaError(f"--policy {policy!r}: one of {', '.join(POLICIES)}")
    exe = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
    if exe is None:
        raise ReplicaError("vllm-router is not installed in this environment (`make install`: requirements/cpu.txt)")
    argv = [exe, "--worker-urls", *urls, "--policy", policy, "--host", host, "--port", str(port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)]
    for flag, value in ROUTER_DEFAULTS.items():
        if flag not in (extra or []):
            argv += [flag, value]
    return argv + list(extra or [])


@dataclass
class Replicas:
    """The replicas and the router of one variant, not started until start()."""
    variant: Variant
    servers: list[Server]
    placement: list[dict[str, str]]
    router: Server
    policy: str
    topology_path: Path
    started: list[Server] = field(default_factory=list)
    workers: list[int] = field(default_factory=list)  # the replicas the router sends to (indices; set by route)

    @property
    def shared_gpu(self) -> bool:
        return self.variant.target != "cpu" and len(self.servers) > 1 and self.placement[0] == self.placement[-1]

    @property
    def base_url(self) -> str:
        return self.router.base_url

    def topology(self) -> dict:
        par = parallelism(self.variant)
        return {"router": "vllm-router", "router_version": metadata.version("vllm-router"), "policy": self.policy,
                "base_url": self.router.base_url, "router_pid": self.router.pid,
                "router_metrics_url": f"http://127.0.0.1:{self.router.argv[self.router.argv.index('--prometheus-port') + 1]}/metrics",
                "replicas": [{"url": self.servers[k].base_url, "pid": self.servers[k].pid, "placement": self.placement[k],
                              "startup_s": self.servers[k].startup_s} for k in self.workers],
                "tensor_parallel": par["tensor_parallel"], "data_parallel": par["data_parallel"],
                "gpus": 0 if self.variant.target == "cpu" else (1 if self.shared_gpu
                                                               else math.prod(par.values()) * len(self.servers)),
                "shared_gpu": self.shared_gpu}

    def start(self, timeout_s: float = 900.0) -> tuple[float, dict[int, str]]:
        """Start every replica at once, wait for all, then the router; the topology file is written last. Returns the
        seconds taken and the replicas that did not answer ({index: why}: the router starts over every replica, its
        health checks keep them out of rotation until they answer); ServerError when none did."""
        for server in self.servers:
            server.start()
            self.started.append(server)
        t0 = time.monotonic()
        down: dict[int, str] = {}
        for i, server in enumerate(self.servers):
            try:
                server.wait_healthy(timeout_s)  # its deadline counts from its own start
            except ServerError as e:
                down[i] = str(e)
        if len(down) == len(self.servers):
            raise ServerError(f"no replica answered: {down[0]}")
        self.route(self.policy)
        return time.monotonic() - t0, down

    def route(self, policy: str, workers: list[int] | None = None) -> None:
        """(Re)start the router with `policy` over `workers` (replica indices; default every replica) while the
        replicas keep running: one start of the replicas serves every policy. Rewrites the topology file."""
        if self.router in self.started:
            self.router.stop()
            self.started.remove(self.router)
        self.workers = list(range(len(self.servers))) if workers is None else list(workers)
        argv = list(self.router.argv)
        argv[argv.index("--worker-urls") + 1:argv.index("--policy")] = [self.servers[k].base_url for k in self.workers]
        argv[argv.index("--policy") + 1] = policy
        self.router = replace(self.router, argv=argv, proc=None, startup_s=None)
        self.policy = policy
        self.router.start()
        self.started.append(self.router)
        self.router.wait_healthy(120.0)
        self.write_topology()

    def write_topology(self) -> None:
        paths.write_text_atomic(self.topology_path, json.dumps(self.topology(), indent=1) + "\n")

    def restart(self, i: int) -> Server:
        """Replica i started again on its own port and placement (what is left of its process group stopped first);
        the router's health checks admit it once it answers. The topology file names its new PID."""
        old = self.servers[i]
        old.stop()
        new = replace(old, proc=None, startup_s=None)
        new.start()  # the lists name it only once it runs: a failed start leaves the old, stopped entry
        self.servers[i] = new
        self.started = [new if s is old else s for s in self.started]
        self.write_topology()
        return new

    def stop(self) -> None:
        """Router first (no new requests reach a stopping replica), then every replica; the topology file goes."""
        self.topology_path.unlink(missing_ok=True)
        for server in reversed(self.started):
            server.stop()
        self.started.clear()


def make_replicas(name: str, replicas: int, *, policy: str = "cache_aware", host: str = DEFAULT_HOST,
                  port: int = DEFAULT_PORT, api_key: str | None = None, overrides: dict[str, str] | None = None,
                  share_gpu: bool = False, router_args: list[str] | None = None, log_dir: Path | None = None,
                  topology_path: Path | None = None, front: bool = False) -> Replicas:
    """Replicas of a variant and their router, each checked (weights, flags, ports) but none started. With `front`,
    the router listens on a loopback port of its own behind the lab's streaming front (scripts/serve/front.py
    --relay-only) on `port`: a stream cut by a replica's death ends with an error event."""
    base = load_variant(name, overrides=overrides)
    gpus = (hardware()["gpu"] or {}).get("count", 0)
    place = placements(base, replicas, gpus=gpus, cpus=os.cpu_count() or 1, share_gpu=share_gpu)
    log_dir = log_dir or paths.CACHE / "replicas"
    log_dir.mkdir(parents=True, exist_ok=True)
    servers = []
    for i, extra in enumerate(place):
        variant = load_variant(name, overrides={**(overrides or {}), **extra})
        servers.append(make_server(variant, host=host, port=port + 1 + i, api_key=api_key,
                                   log_path=log_dir / f"{name}-replica{i}.log"))
    metrics_port = port + 1 + replicas
    for url in [f"http://127.0.0.1:{port}", *(s.base_url for s in servers), f"http://127.0.0.1:{metrics_port}"]:
        if port_in_use(url):
            raise ReplicaError(f"{url} is already in use (another server still running?); pick another --port")
    extra_args = list(router_args or [])
    inner = free_port() if front else port
    argv = router_argv([s.base_url for s in servers], policy=policy, host="127.0.0.1" if front else host, port=inner,
                       metrics_port=metrics_port, extra=extra_args)
    if front:  # its child, in its process group: stopping the router's PID group stops both
        argv = [sys.executable, "-m", "scripts.serve.front", "--host", host, "--port", str(port), "--engine-port",
                str(inner), "--relay-only", "--", *argv]
    router = Server(argv=argv, base_url=local_base_url(host, port), log_path=log_dir / f"{name}-router.log",
                    health_path="/health")
    return Replicas(variant=base, servers=servers, placement=place, router=router, policy=policy,
                    topology_path=topology_path or TOPOLOGY_DIR / f"{name}.json")


def read_topology(path: Path) -> dict:
    """A running topology's file (make serve-replicas); one-line error when missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ReplicaError(f"{path}: no such topology (is `make serve-replicas` running?)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ReplicaError(f"{path}: unreadable topology ({e})") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                allow_abbrev=False)
    p.add_argument("variant", nargs="?", default=paths.DEFAULT_VARIANT)
    p.add_argument("--replicas", type=int, default=int(os.environ.get("REPLICAS", "2")))
    p.add_argument("--router", default=os.environ.get("ROUTER", "vllm-router"), choices=ROUTERS)
    p.add_argument("--policy", default=os.environ.get("POLICY", "cache_aware"), choices=POLICIES)
    p.add_argument("--host", default=os.environ.get("HOST", DEFAULT_HOST))
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", DEFAULT_PORT)),
                   help="the router's port; replicas take the next ports, the router's Prometheus port the one after")
    p.add_argument("--share-gpu", action="store_true", help="every replica on GPU 0, each with 1/N of its memory budget")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--router-arg", action="append", default=[], metavar="ARG",
                   help="one more vllm-router argument (repeat; e.g. --router-arg=--cache-threshold --router-arg=0.5)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for the replicas' /health")
    p.add_argument("--restarts", type=int, default=int(os.environ.get("RESTARTS", "3")),
                   help="times a replica that exits is started again (RESTARTS; 0: never; a crash loop stops there)")
    p.add_argument("--topology", type=Path, help="write the topology here (default .cache/replicas/<variant>.json)")
    p.add_argument("--log-dir", type=Path, help="the servers' logs (default .cache/replicas/)")
    p.add_argument("--front", action="store_true",
                   help="the lab's streaming front before the router (make serve-replicas FRONT=1): a stream a dying "
                        "replica cuts ends with an error event")
    p.add_argument("--dry-run", action="store_true", help="print the commands and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        group = make_replicas(args.variant, args.replicas, policy=args.policy, host=args.host, port=args.port,
                              api_key=os.environ.get("API_KEY") or None, overrides=parse_overrides(args.set),
                              share_gpu=args.share_gpu, router_args=args.router_arg, log_dir=args.log_dir,
                              topology_path=args.topology, front=args.front)
    except (VariantError, CheckpointError, ServerError, ReplicaError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for i, server in enumerate(group.servers):
        print(f"replica {i}: {printable(server.argv, server.env)}", flush=True)
    print(f"router: {printable(group.router.argv)}", flush=True)
    if args.dry_run:
        return 0
    stopping = stop_on_signals(group.stop, lambda: f"the router and {len(group.servers)} replicas")
    try:
        took, down = group.start(args.timeout)
    except ServerError as e:
        group.stop()
        if stopping():
            return 130
        print(f"error: {e}", file=sys.stderr)
        return 1
    pids = ", ".join(str(s.pid) for s in group.servers)
    print(f"ready: {group.base_url}/v1 routes {args.variant!r} over {len(group.servers)} replicas ({args.policy}; "
          f"replica pids {pids}; router pid {group.router.pid}; {took:.1f} s); topology {paths.shown(group.topology_path)}; "
          f"a replica that exits is restarted up to {args.restarts} times; Ctrl-C stops them", flush=True)
    for i, why in down.items():  # the router serves on the others; a replica that exited is started again below
        print(f"warning: replica {i} ({group.servers[i].base_url}) is down: {why}; the router serves on the others",
              file=sys.stderr, flush=True)
    lost: set[int] = set()
    restarts = [0] * len(group.servers)
    back: dict[int, float] = {}  # replica -> when its restart began, until it answers /health again
    try:
        while True:
            time.sleep(0.5)
            if stopping():
                break
            if group.router.proc.poll() is not None:
                print(f"error: the router (pid {group.router.pid}) exited with code {group.router.proc.returncode}; "
                      "stopping the replicas", file=sys.stderr)
                break
            for i, server in enumerate(group.servers):
                if i in lost:
                    continue
                if server.proc.poll() is None:
                    if i in back and is_healthy(server.base_url, path=server.health_path, api_key=server.api_key):
                        print(f"replica {i} is back (pid {server.pid}) after {time.monotonic() - back.pop(i):.1f} s; the "
                              f"router admits it after its health checks", flush=True)
                    continue
                code = server.proc.returncode
                back.pop(i, None)
                if restarts[i] < args.restarts:
                    restarts[i] += 1
                    print(f"warning: replica {i} (pid {server.pid}, {server.base_url}) exited with code {code}; the "
                          f"router's health checks take it out of rotation; restarting it ({restarts[i]} of "
                          f"{args.restarts})", file=sys.stderr, flush=True)
                    if stopping():
                        break
                    try:
                        group.restart(i)
                        back[i] = time.monotonic()
                        continue
                    except Exception as e:  # noqa: BLE001 - any failed start is that replica lost, not the others
                        print(f"warning: replica {i} could not be restarted: {e}", file=sys.stderr, flush=True)
                lost.add(i)
                print(f"warning: replica {i} (pid {server.pid}, {server.base_url}) exited with code {code} and is not "
                      f"restarted ({len(group.servers) - len(lost)} left)", file=sys.stderr, flush=True)
            if len(lost) == len(group.servers):
                print("error: every replica has exited; stopping the router", file=sys.stderr)
                break
    finally:
        group.stop()
    return 0 if stopping() else 1


if __name__ == "__main__":
    sys.exit(main())
