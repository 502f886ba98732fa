"""A local serving stack on one machine: Redis, cache node(s), a local Ray cluster and the workers.

Ray 2.60 turns token authentication on by default and keeps the token in ~/.ray/auth_token. A
LocalStack keeps auth on (the cache plane and the workers are a secured pair) but gives its Ray cluster
a fresh token of its own in the stack's run directory (RAY_AUTH_TOKEN_PATH), so it neither depends on
nor writes a user's home, and two stacks never share a token.
"""

from __future__ import annotations

import os
import secrets
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import ray

from kvstore.cli.launch import NodeProcess
from kvstore.cli.redis_procs import RedisProcess
from kvstore.index.acl import CLIENT_RULES, CLIENT_USER, node_rules, node_user
from kvstore.integrations.hints import SessionHints
from workers.actors import DecodeWorker, PrefillWorker, RequestResult, Router
from workers.serving import WorkerConfig, namespace_for


@dataclass(slots=True)
class StackConfig:
    model_dir: str
    num_prefill: int = 1
    num_decode: int = 1
    dram_bytes: int | str = "64MiB"
    nvme_bytes: int | str = "512MiB"
    max_page_bytes: int | str | None = None  # default: the model's page size
    block_size: int = 16
    num_blocks: int = 1024  # per worker's KV cache
    dtype: str = "float32"
    num_cpus: int | None = None
    torch_threads: int | None = None
    max_inflight: int = 4
    run_dir: str | None = None
    kv_encoding: str = "raw"  # page encoding of the workers' Puts: raw, or fp8 (workers/page_codec.py)


@dataclass(slots=True)
class LocalStack:
    """Start with `start()`, serve with `generate()`, stop with `stop()` (also on context exit)."""

    config: StackConfig
    redis: RedisProcess | None = None
    node: NodeProcess | None = None
    router: object | None = None
    namespace: str = ""
    workers: list[object] = field(default_factory=list)  # the prefill and decode actors
    _index_url: str = ""
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    _env_before: dict[str, str | None] = field(default_factory=dict)
    _ray_started: bool = False

    def start(self) -> LocalStack:
        cfg = self.config
        if cfg.run_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvstore-stack-")
        run = Path(cfg.run_dir or self._tmp.name)  # type: ignore[union-attr]
        run.mkdir(parents=True, exist_ok=True)
        try:
            self._start(cfg, run)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, cfg: StackConfig, run: Path) -> None:
        # Redis with a password and ACL users, as `kvstore up` runs it: only node-0 writes its records,
        # the workers and the router only read (kvstore/index/acl.py), so no local user can redirect them.
        users = {
            CLIENT_USER: (secrets.token_hex(20), CLIENT_RULES),
            node_user("node-0"): (secrets.token_hex(20), node_rules("node-0")),
        }
        self.redis = RedisProcess(password=secrets.token_hex(20), users=users).start()
        self._index_url = self.redis.url_for(CLIENT_USER)
        page_bytes = self.page_bytes(cfg)
        self.node = NodeProcess(
            dram_bytes=cfg.dram_bytes,
            nvme_path=run / "nvme",
            nvme_bytes=cfg.nvme_bytes,
            max_page_bytes=cfg.max_page_bytes or page_bytes,
            node_id="node-0",
            redis_url=self.redis.url_for(node_user("node-0")),
            log_path=run / "node.log",
            extra_args=["--index-ttl", "5"],
        ).start()
        token_path = run / "ray_auth_token"
        token_path.write_text(secrets.token_hex(32))
        token_path.chmod(0o600)
        for k, v in {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_path)}.items():
            self._env_before[k] = os.environ.get(k)
            os.environ[k] = v
        _refresh_ray_auth()
        ray.init(
            num_cpus=cfg.num_cpus or max(2, os.cpu_count() or 2),
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
        self._ray_started = True
        self._start_workers(cfg)

    def _start_workers(self, cfg: StackConfig) -> None:
        self.namespace = namespace_for(cfg.model_dir, cfg.dtype, encoding=cfg.kv_encoding, block_size=cfg.block_size)
        gpus = 1 if ray.cluster_resources().get("GPU", 0) >= cfg.num_prefill + cfg.num_decode else 0
        wcfg = WorkerConfig(
            model_dir=cfg.model_dir,
            redis_url=self._index_url,
            namespace=self.namespace,
            num_blocks=cfg.num_blocks,
            block_size=cfg.block_size,
            dtype=cfg.dtype,
            local_node="node-0",
            torch_threads=cfg.torch_threads,
            kv_encoding=cfg.kv_encoding,
        )
        # Actors take no CPU reservation: on a 2-core host prefill, decode and the router must coexist.
        prefill = [PrefillWorker.options(num_cpus=0, num_gpus=gpus).remote(wcfg) for _ in range(cfg.num_prefill)]
        decode = [DecodeWorker.options(num_cpus=0, num_gpus=gpus).remote(wcfg) for _ in range(cfg.num_decode)]
        self.workers = [*prefill, *decode]
        ray.get([w.info.remote() for w in prefill])  # fail fast if a worker cannot load the model
        self.router = Router.remote(
            prefill,
            decode,
            self._index_url,
            self.namespace,
            cfg.block_size,
            local_nodes=["node-0"] * cfg.num_prefill,
            max_inflight=cfg.max_inflight,
        )

    def restart_workers(self, *, block_size: int | None = None, dtype: str | None = None) -> None:
        """Replace the prefill and decode workers and the router with fresh actors (new processes: empty KV
        caches, the model loaded again), optionally with another block size or dtype; Redis and the node keep
        running. The namespace follows the new settings (`namespace_for`)."""
        assert self.router is not None, "stack not started"
        for actor in [*self.workers, self.router]:
            ray.kill(actor)  # type: ignore[arg-type]
        self.workers, self.router = [], None
        if block_size is not None:
            self.config.block_size = block_size
        if dtype is not None:
            self.config.dtype = dtype
        self._start_workers(self.config)

    @staticmethod
    def page_bytes(cfg: StackConfig) -> int:
        """Bytes of one stored KV page of the stack's model at its block size, dtype and encoding."""
        import torch

        from kvstore.layout import PageEncoding, PageLayout
        from workers.loader import read_config
        from workers.paged_cache import kv_dtype

        mc = read_config(cfg.model_dir)
        layout = PageLayout(
            kv_dtype(getattr(torch, cfg.dtype)),
            mc.num_layers,
            mc.num_kv_heads,
            mc.head_dim,
            cfg.block_size,
            PageEncoding.parse(cfg.kv_encoding),
        )
        return layout.page_bytes

    def generate(
        self, request_id: str, prompt: list[int], max_new_tokens: int, session: SessionHints | None = None
    ) -> RequestResult:
        """One request through the router; `session`: the conversation it belongs to (DESIGN.md §6.5)."""
        assert self.router is not None, "stack not started"
        return ray.get(self.router.generate.remote(request_id, prompt, max_new_tokens, session))  # type: ignore[attr-defined]

    def end_session(self, session: str) -> list[str]:
        """The conversation ended: the nodes retaining its pages release them; returns those nodes."""
        assert self.router is not None, "stack not started"
        return ray.get(self.router.end_session.remote(session))  # type: ignore[attr-defined]

    def stop(self) -> None:
        if self._ray_started:
            ray.shutdown()
            self._ray_started = False
        for k, v in self._env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if self._env_before:
            _refresh_ray_auth()
        self._env_before.clear()
        if self.node is not None:
            self.node.close()
            self.node = None
        if self.redis is not None:
            self.redis.close()
            self.redis = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> LocalStack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _refresh_ray_auth() -> None:
    """Make this process see RAY_AUTH_MODE / RAY_AUTH_TOKEN_PATH as they are now.

    NOTE: Ray reads them into a cached config and a cached token loader when it is imported; its own
    ray.init refreshes both the same way (ray._private.authentication.authentication_token_setup).
    These are private names of the pinned ray==2.60.0; child processes read the environment afresh.
    """
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()
