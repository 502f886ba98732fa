"""`kvstore pd-serve`: the driver that puts prefill/decode workers and the router on a running Ray cluster.

In Kubernetes it runs beside the Ray head (the `router` container of the chart's RayCluster); `kvstore
up --values` starts it against a local `ray start --head`. Same command line in both places.

Placement: every Ray node advertises `kvstore_prefill` or `kvstore_decode` slots (custom resources, one
per GPU; the chart's worker groups set them). The driver places one actor per slot, pinned to that Ray
node, and tells it which cache node is local to it: the value of KVSTORE_LOCAL_NODE in that node's
environment (the chart sets it to the Kubernetes host name, which is also the cache node's id).
Then it creates the cache-aware `Router` as the named actor `router` in Ray namespace `kvstore`; engines
call `ray.get_actor("router", namespace="kvstore").generate.remote(request_id, prompt_ids, n)`.

The driver owns every actor: when it stops, they stop. It checks them every `--check-every` seconds
and exits non-zero when one died or the set of slots changed (pods came or went), so Kubernetes
restarts it and it places actors on the pods as they are now.
"""

from __future__ import annotations

import enum
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from kvstore.cli.common import friendly_errors, setup_logging
from workers.cli import KV_ENCODING_HELP, KVEncodingFlag

log = logging.getLogger(__name__)

RAY_NAMESPACE = "kvstore"
ROUTER_NAME = "router"
LOCAL_NODE_ENV = "KVSTORE_LOCAL_NODE"
ROUTER_NAME_WAIT_S = 60.0


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def resource(self) -> str:
        """The Ray custom resource whose units are this role's slots on a node."""
        return f"kvstore_{self.value}"


@dataclass(frozen=True, slots=True)
class Slot:
    """One actor's place: a role, a Ray node, an index among that node's slots, and its GPU share."""

    role: Role
    ray_node: str
    index: int
    gpus: float

    def __lt__(self, other: Slot) -> bool:  # Role is an Enum: order by its value
        return (self.role.value, self.ray_node, self.index) < (other.role.value, other.ray_node, other.index)


def plan_slots(nodes: Sequence[Mapping[str, Any]]) -> list[Slot]:
    """Slots of every alive Ray node (as `ray.nodes()` lists them), sorted. Pure.

    A node with n units of a role's resource gets n slots; its GPUs are split evenly between them
    (0 on a CPU node). A node offering both roles splits its GPUs over all of its slots."""
    slots: list[Slot] = []
    for node in nodes:
        if not node.get("Alive", False):
            continue
        res = node.get("Resources", {})
        counts = {role: int(res.get(role.resource, 0)) for role in Role}
        total = sum(counts.values())
        gpus = float(res.get("GPU", 0.0)) / total if total else 0.0
        for role, n in counts.items():
            slots.extend(Slot(role, str(node["NodeID"]), i, gpus) for i in range(n))
    return sorted(slots)


def count(slots: Sequence[Slot], role: Role) -> int:
    return sum(1 for s in slots if s.role is role)


def _local_node_of(ray_node: str) -> str | None:
    """KVSTORE_LOCAL_NODE as the processes on that Ray node see it (one tiny task pinned there)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0)
    def read_env() -> str | None:
        return os.environ.get(LOCAL_NODE_ENV) or None

    strategy = NodeAffinitySchedulingStrategy(ray_node, soft=False)
    return ray.get(read_env.options(scheduling_strategy=strategy).remote(), timeout=120)


@dataclass(slots=True)
class ServingSet:
    slots: list[Slot]
    actors: list[Any]  # one per slot
    router: Any
    namespace: str


def start_serving(slots: Sequence[Slot], cfg: Any, max_inflight: int) -> ServingSet:
    """Create the actors of `slots` (cfg: a WorkerConfig without local_node) and the named router."""
    import dataclasses

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from workers.actors import DecodeWorker, PrefillWorker, Router

    local = {n: _local_node_of(n) for n in sorted({s.ray_node for s in slots})}
    actors = []
    for s in slots:
        cls = PrefillWorker if s.role is Role.PREFILL else DecodeWorker
        actors.append(
            cls.options(
                name=f"{s.role.value}-{s.ray_node[:8]}-{s.index}",
                num_cpus=0,
                num_gpus=s.gpus,
                resources={s.role.resource: 1},
                scheduling_strategy=NodeAffinitySchedulingStrategy(s.ray_node, soft=False),
            ).remote(dataclasses.replace(cfg, local_node=local[s.ray_node]))
        )
    prefill = [(a, local[s.ray_node]) for a, s in zip(actors, slots, strict=True) if s.role is Role.PREFILL]
    decode = [a for a, s in zip(actors, slots, strict=True) if s.role is Role.DECODE]
    ray.get([a.info.remote() for a, _ in prefill], timeout=600)  # fail fast if a worker cannot load the model
    _wait_name_free(ROUTER_NAME, ROUTER_NAME_WAIT_S)
    router = Router.options(name=ROUTER_NAME, num_cpus=0).remote(
        [a for a, _ in prefill],
        decode,
        cfg.redis_url,
        cfg.namespace,
        cfg.block_size,
        local_nodes=[n for _, n in prefill],
        max_inflight=max_inflight,
    )
    return ServingSet(list(slots), actors, router, cfg.namespace)


def _wait_name_free(name: str, timeout: float) -> None:
    """A restarted driver may start before the GCS has reaped the previous driver's router: wait
    (bounded) for the name to be free instead of failing on "already exists"."""
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=RAY_NAMESPACE)
        except ValueError:
            return
        time.sleep(1.0)
    raise RuntimeError(f"a Ray actor named {name!r} in namespace {RAY_NAMESPACE!r} still exists after {timeout:.0f}s")


def _alive(serving: ServingSet, timeout: float) -> bool:
    import ray

    checks = [a.info.remote() for a, s in zip(serving.actors, serving.slots, strict=True) if s.role is Role.PREFILL]
    try:
        ray.get(checks, timeout=timeout)
        ray.get_actor(ROUTER_NAME, namespace=RAY_NAMESPACE)
        return True
    except Exception as exc:  # any failure of an actor means: rebuild from scratch
        log.error("a worker or the router is gone: %s", exc)
        return False


@friendly_errors
# one parameter per CLI option (typer)
def pd_serve(  # noqa: PLR0913, PLR0917
    ray_address: Annotated[str, typer.Option(help="Ray GCS address host:port of the running cluster")],
    model: Annotated[Path, typer.Option(help="checkpoint directory (config.json + safetensors) on every worker")],
    redis_url: Annotated[str, typer.Option(envvar="KVSTORE_REDIS_URL", help="Redis index URL")],
    dtype: Annotated[str, typer.Option(help="model and KV dtype: float32, float16, bfloat16")] = "bfloat16",
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block / cache page")] = 16,
    num_blocks: Annotated[int, typer.Option(min=1, help="KV cache blocks per worker")] = 4096,
    max_inflight: Annotated[int, typer.Option(min=1, help="requests in flight per worker")] = 4,
    min_prefill: Annotated[int, typer.Option(min=0, help="wait for at least this many prefill slots")] = 1,
    min_decode: Annotated[int, typer.Option(min=0, help="wait for at least this many decode slots")] = 1,
    worker_wait: Annotated[float, typer.Option(min=0, help="seconds to wait for those slots")] = 600.0,
    check_every: Annotated[float, typer.Option(min=0.5, help="seconds between checks of the actors")] = 10.0,
    ready_file: Annotated[Path | None, typer.Option(help="write {router, prefill, decode} JSON once serving")] = None,
    log_level: Annotated[str, typer.Option(help="DEBUG, INFO, WARNING")] = "INFO",
    kv_encoding: Annotated[KVEncodingFlag, typer.Option(help=KV_ENCODING_HELP)] = KVEncodingFlag.RAW,
) -> None:
    """Place prefill/decode workers on the slots of a running Ray cluster and start the named router."""
    import json

    import ray

    from workers.serving import WorkerConfig, namespace_for

    setup_logging(log_level)
    if not (model / "config.json").is_file():
        raise ValueError(f"--model {model}: no config.json (a Hugging Face checkpoint directory)")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    ray.init(address=ray_address, namespace=RAY_NAMESPACE, log_to_driver=False, configure_logging=False)
    try:
        deadline = time.monotonic() + worker_wait
        slots = plan_slots(ray.nodes())
        while count(slots, Role.PREFILL) < min_prefill or count(slots, Role.DECODE) < min_decode:
            if time.monotonic() > deadline or stop.is_set():
                raise RuntimeError(
                    f"after {worker_wait:.0f}s the cluster offers {count(slots, Role.PREFILL)} "
                    f"prefill and {count(slots, Role.DECODE)} decode slots; need {min_prefill} "
                    f"and {min_decode} (Ray resources {Role.PREFILL.resource}, {Role.DECODE.resource})"
                )
            stop.wait(2.0)
            slots = plan_slots(ray.nodes())
        cfg = WorkerConfig(
            model_dir=str(model),
            redis_url=redis_url,
            namespace=namespace_for(model, dtype, encoding=kv_encoding.value, block_size=block_size),
            num_blocks=num_blocks,
            block_size=block_size,
            dtype=dtype,
            kv_encoding=kv_encoding.value,
        )
        serving = start_serving(slots, cfg, max_inflight)
        log.info(
            "serving: %d prefill, %d decode workers; router %r in Ray namespace %r; cache namespace %s (pages %s)",
            count(slots, Role.PREFILL),
            count(slots, Role.DECODE),
            ROUTER_NAME,
            RAY_NAMESPACE,
            cfg.namespace,
            kv_encoding.value,
        )
        if ready_file is not None:
            tmp = ready_file.with_suffix(".tmp")
            tmp.write_text(
                json.dumps(
                    {
                        "router": ROUTER_NAME,
                        "ray_namespace": RAY_NAMESPACE,
                        "namespace": cfg.namespace,
                        "kv_encoding": kv_encoding.value,
                        "prefill": count(slots, Role.PREFILL),
                        "decode": count(slots, Role.DECODE),
                        "pid": os.getpid(),
                    }
                )
            )
            os.replace(tmp, ready_file)
        while not stop.wait(check_every):
            now = plan_slots(ray.nodes())
            if now != serving.slots:
                raise RuntimeError(
                    f"the worker slots changed ({len(serving.slots)} -> {len(now)}): restarting to re-place"
                )
            if not _alive(serving, timeout=max(30.0, check_every)):
                raise RuntimeError("a worker or the router died: restarting to re-place")
    finally:
        ray.shutdown()
