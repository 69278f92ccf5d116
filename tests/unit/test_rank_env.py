"""Ranks started on one machine share the CPUs this process may use, not the machine's."""

from __future__ import annotations

import mlx_server.engine.core.cpus as cpus
from mlx_server.boot.ranks import rank_env


def test_each_rank_gets_its_share_of_the_cpus_this_process_may_use(monkeypatch):
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpus.os, "cpu_count", lambda: 192)
    monkeypatch.setattr(cpus.os, "sched_getaffinity", lambda pid: set(range(8)), False)
    env = rank_env(1, 2, "/tmp/hosts.json")
    assert env["OPENBLAS_NUM_THREADS"] == "4"
    assert env["MLX_RANK"] == "1" and env["MLX_HOSTFILE"] == "/tmp/hosts.json"
    assert rank_env(0, 16, "h")["OPENBLAS_NUM_THREADS"] == "1"  # never none


def test_a_thread_count_the_user_set_is_kept(monkeypatch):
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert rank_env(0, 2, "h")["OPENBLAS_NUM_THREADS"] == "3"
