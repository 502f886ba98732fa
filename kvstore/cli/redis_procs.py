"""Private Redis processes on loopback for tests, the demo and `kvstore up`: a redis-server (RedisProcess,
redis_server.py), a Sentinel group (SentinelGroup, redis_sentinel.py: a master, replicas and sentinels) and a
Redis Cluster (RedisClusterGroup, redis_cluster.py: masters, each with replicas), each child started on a free
port, ready only once the server on that port is provably ours, stopped by PID. This module names the three
where their users import them.

Every wait is bounded in time; `stop()` sends SIGTERM, waits, then SIGKILLs.
"""

from __future__ import annotations

from kvstore.cli.redis_cluster import RedisClusterGroup
from kvstore.cli.redis_sentinel import SentinelGroup, SentinelProcess
from kvstore.cli.redis_server import RedisProcess

__all__ = ["RedisClusterGroup", "RedisProcess", "SentinelGroup", "SentinelProcess"]
