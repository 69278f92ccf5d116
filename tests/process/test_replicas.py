"""Replicas behind a load balancer: ``deploy/replicas.py`` starts two real ``mlx-server``
processes on the demo model behind the real ``haproxy`` binary, with the shipped
``deploy/haproxy/haproxy.cfg``.

A conversation keeps reaching the replica that holds its prefix cache (its cached tokens
grow turn after turn), the affinity key is taken from the headers in the documented order,
streams pass through as they are generated, and when a replica is killed its conversations
move to the other one while the other replica's conversations stay where they are.

Without haproxy these tests are skipped, saying so; under ``.ci/run`` (which installs it
and sets ``MLX_SERVER_REQUIRE_HAPROXY=1``) they fail instead.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import REPO, ServerProcess, demo_model_dir, free_port

# Where deploy/replicas.py looks for it too (/usr/sbin is not on every user's PATH).
HAPROXY = shutil.which("haproxy", path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin"]))
if HAPROXY is None and os.environ.get("MLX_SERVER_REQUIRE_HAPROXY"):
    pytest.fail("haproxy is required here (.ci/run installs it with apt) but not found")
pytestmark = [
    pytest.mark.skipif(
        HAPROXY is None,
        reason="no haproxy on this machine (apt-get install haproxy): the replica tests need it",
    ),
    pytest.mark.timeout(420),  # the cluster of two servers and a balancer: up to 300 s to start
]


def _load_launcher():
    spec = importlib.util.spec_from_file_location("replicas", REPO / "deploy" / "replicas.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


launcher = _load_launcher()

REPLICA = "x-mlx-server-replica"
# The affinity headers, first one found wins (deploy/haproxy/haproxy.cfg).
KEY_HEADERS = (
    "x-session-id",
    "x-claude-code-session-id",
    "session-id",
    "authorization",
    "x-api-key",
)
SYSTEM = "You are a helpful assistant who answers in one short sentence. " * 4


@dataclass
class Cluster:
    launcher: ServerProcess
    url: str  # the balancer
    replicas: dict[str, str]  # name -> its own URL
    pids: dict[str, int]
    http: httpx.Client

    def replica_for(self, headers: dict[str, str]) -> str:
        """The replica the balancer picks for a request with these headers."""
        r = self.http.get(self.url + "/health", headers=headers)
        assert r.status_code == 200, r.text
        return r.headers[REPLICA]


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    lb, ports = free_port(), [free_port(), free_port()]
    cmd = [sys.executable, str(REPO / "deploy" / "replicas.py"), "--port", str(lb)]
    cmd += ["--replica-ports", ",".join(map(str, ports)), "--check-interval", "300ms", "--"]
    cmd += ["-m", str(demo_model_dir()), "--ctx-size", "1024"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    launcher = ServerProcess(proc, lb)
    launcher._pumping = threading.Thread(target=launcher._pump, daemon=True)
    launcher._pumping.start()
    pids: dict[str, int] = {}
    try:
        launcher.wait_for_line("[replicas] ready:", timeout=300)
        for name in ("r1", "r2"):
            pids[name] = int(launcher.wait_for_line(f"[replicas] {name}: pid ").split()[-1])
        replicas = {f"r{i}": f"http://127.0.0.1:{p}" for i, p in enumerate(ports, 1)}
        with httpx.Client(timeout=30) as http:
            yield Cluster(launcher, f"http://127.0.0.1:{lb}", replicas, pids, http)
    finally:
        launcher.stop()  # SIGTERM: the launcher stops the replicas and the balancer
        for pid in pids.values():  # and should it not have, they go here
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def values_on_each_replica(cluster: Cluster) -> dict[str, str]:
    """A session id that the balancer sends to each replica: r1's and r2's."""
    found: dict[str, str] = {}
    for i in range(32):
        value = f"session-{i}"
        found.setdefault(cluster.replica_for({"x-session-id": value}), value)
        if len(found) == 2:
            return found
    raise AssertionError(f"32 session ids all hashed to one replica: {found}")


def test_rendered_config_is_valid(tmp_path):
    template = launcher.CONFIG.read_text()
    backends = ["10.0.0.1:8081", "10.0.0.2:8081", "10.0.0.3:8081"]
    text = launcher.render(template, "0.0.0.0:9000", backends, "1s")
    servers = [line.split() for line in text.splitlines() if line.startswith("    server ")]
    assert servers == [["server", f"r{i}", b, "id", str(i)] for i, b in enumerate(backends, 1)]
    assert "    bind 0.0.0.0:9000\n" in text and " inter 1s " in text
    (tmp_path / "haproxy.cfg").write_text(text)
    check = subprocess.run(
        [HAPROXY, "-c", "-f", str(tmp_path / "haproxy.cfg")], capture_output=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    assert (
        launcher.render(template, "127.0.0.1:8080", ["127.0.0.1:8081", "127.0.0.1:8082"])
        == template
    )


def test_each_replica_gets_its_own_disk_tier(monkeypatch, tmp_path):
    names = ["r1", "r2"]
    given = launcher.own_cache_dirs(["-m", "x", "--prompt-cache-dir", "/d"], names)
    assert given == {n: ["-m", "x", "--prompt-cache-dir", f"/d/{n}"] for n in names}
    assert launcher.own_cache_dirs(["--prompt-cache-dir=/d"], names)["r2"][-1] == "/d/r2"
    off = launcher.own_cache_dirs(["--prompt-cache-dir", ""], names)
    assert off == {n: ["--prompt-cache-dir", ""] for n in names}  # no disk tier stays none
    monkeypatch.setenv("MLX_SERVER_PROMPT_CACHE_DIR", str(tmp_path))
    default = launcher.own_cache_dirs(["-m", "x"], names)
    assert default["r1"] == ["-m", "x", "--prompt-cache-dir", str(tmp_path / "r1")]


def test_replicas_answer_the_balancers_host():
    assert launcher.with_allowed_host(["-m", "x"], "127.0.0.1") == ["-m", "x"]
    assert launcher.with_allowed_host([], "10.0.0.5") == ["--allowed-hosts", "10.0.0.5"]
    given = launcher.with_allowed_host(["--allowed-hosts", "llm.lan"], "10.0.0.5")
    assert given == ["--allowed-hosts", "llm.lan,10.0.0.5"]


@pytest.mark.demo
def test_replicas_have_disk_tiers_of_their_own(cluster):
    prefix = "[mlx] Prompt cache disk tier: "
    lines = [cluster.launcher.wait_for_line(f"[{n}] {prefix}") for n in ("r1", "r2")]
    tiers = [Path(line.split(prefix, 1)[1].split(" (", 1)[0]) for line in lines]
    assert tiers[0].parent.name == "r1" and tiers[1].parent.name == "r2", tiers


@pytest.mark.demo
def test_affinity_key_order(cluster):
    # Without any key, requests are spread: both replicas answer.
    seen: set[str] = set()
    for _ in range(16):
        seen.add(cluster.replica_for({}))
        if len(seen) == 2:
            break
    assert seen == {"r1", "r2"}, seen
    on = values_on_each_replica(cluster)
    a, b = on["r1"], on["r2"]
    for header in KEY_HEADERS:  # each header alone sticks: same value, same replica
        for value, replica in ((a, "r1"), (b, "r2")):
            assert {cluster.replica_for({header: value}) for _ in range(2)} == {replica}, header
    for first, later in itertools.pairwise(KEY_HEADERS):  # the earlier header wins
        assert cluster.replica_for({first: a, later: b}) == "r1", (first, later)
        assert cluster.replica_for({first: b, later: a}) == "r2", (first, later)


def metric(http: httpx.Client, replica_url: str, name: str, **labels: str) -> float:
    """The sum of a replica's samples of ``name`` with these labels, from its own /metrics."""
    text = http.get(replica_url + "/metrics").text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    )


def chat_requests(http: httpx.Client, replica_url: str) -> float:
    return metric(http, replica_url, "mlx_server_requests_total", route="/v1/chat/completions")


def first_text(lines: Iterator[str]) -> None:
    """Read a chat stream up to its first text."""
    for line in lines:
        if line.startswith("data: {"):
            if json.loads(line[6:])["choices"][0]["delta"].get("content"):
                return
    raise AssertionError("the stream ended before any text")


class Conversation:
    """A multi-turn chat under one session id, through the official SDK (strict)."""

    def __init__(self, url: str, session: str):
        self.session = session
        self.client = openai.OpenAI(
            base_url=url + "/v1",
            api_key="unused",
            default_headers={"X-Session-Id": session},
            _strict_response_validation=True,
            max_retries=0,
            timeout=120,
        )
        self.messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]

    def turn(self, text: str) -> tuple[str, int, int]:
        """Send the next user message; the replica that answered, the prompt's tokens and
        how many of them came from the prefix cache."""
        asked = [*self.messages, {"role": "user", "content": text}]
        raw = self.client.chat.completions.with_raw_response.create(
            model="m", messages=asked, max_tokens=4, temperature=0
        )
        completion = raw.parse()
        answer = completion.choices[0].message.content or ""
        self.messages = [*asked, {"role": "assistant", "content": answer}]
        usage = completion.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        return (
            raw.headers[REPLICA],
            usage.prompt_tokens,
            usage.prompt_tokens_details.cached_tokens or 0,
        )

    def body(self, text: str, **kw) -> dict:
        return {"model": "m", "messages": [*self.messages, {"role": "user", "content": text}], **kw}


@pytest.mark.demo
def test_conversation_stays_then_moves_when_its_replica_dies(cluster):
    on = values_on_each_replica(cluster)
    conv, other = Conversation(cluster.url, on["r1"]), Conversation(cluster.url, on["r2"])
    before = {n: chat_requests(cluster.http, u) for n, u in cluster.replicas.items()}
    turns = [conv.turn(f"Question {i}: name a colour.") for i in range(3)]
    assert [replica for replica, _, _ in turns] == ["r1"] * 3
    for (_, prompt, _), (_, _, hit) in itertools.pairwise(turns):
        assert hit >= prompt, turns  # each turn reuses the whole turn before it
    # r1's own counters agree: it answered those three, r2 none.
    after = {n: chat_requests(cluster.http, u) for n, u in cluster.replicas.items()}
    assert (after["r1"] - before["r1"], after["r2"] - before["r2"]) == (3, 0)
    replica, other_prompt, _ = other.turn("Name a fruit.")
    assert replica == "r2"

    # A client that leaves a stream through the balancer frees its slot on the replica.
    cancelled = metric(cluster.http, cluster.replicas["r2"], "mlx_server_cancellations_total")
    body = other.body("Count to one thousand.", max_tokens=256, ignore_eos=True, stream=True)
    headers = {"X-Session-Id": other.session}
    with cluster.http.stream(
        "POST", cluster.url + "/v1/chat/completions", json=body, headers=headers
    ) as r:
        assert r.headers[REPLICA] == "r2"
        first_text(r.iter_lines())
    deadline = time.monotonic() + 30
    while (
        metric(cluster.http, cluster.replicas["r2"], "mlx_server_cancellations_total") == cancelled
    ):
        assert time.monotonic() < deadline, "the replica kept generating for a client that left"
        time.sleep(0.1)

    # A stream in flight on r1: its first text arrives while r1 is still generating (the
    # balancer does not hold the stream back), then r1 is killed and the stream breaks.
    body = conv.body("Count to one thousand.", max_tokens=256, ignore_eos=True, stream=True)
    headers = {"X-Session-Id": conv.session}
    with httpx.stream(
        "POST", cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=120
    ) as r:
        assert r.status_code == 200 and r.headers[REPLICA] == "r1"
        lines = r.iter_lines()
        first_text(lines)
        assert cluster.http.get(cluster.replicas["r1"] + "/health").json()["active"] == 1
        os.kill(cluster.pids["r1"], signal.SIGKILL)
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            for line in lines:
                assert line != "data: [DONE]", "the stream ended normally after its replica died"
    cluster.launcher.wait_for_line("[replicas] r1 exited (-9)")

    # The conversation continues on r2 (the next request succeeds within the deadline),
    # and r2 now keeps its prefix; r2's own conversation stays on r2, its cache intact.
    deadline = time.monotonic() + 30
    while True:
        try:
            moved = conv.turn("Question 3: name another colour.")
            break
        except openai.APIError:
            assert time.monotonic() < deadline, "no request succeeded after the replica died"
            time.sleep(0.2)
    assert moved[0] == "r2"
    replica, _, hit = conv.turn("Question 4: and one more.")
    assert replica == "r2" and hit >= moved[1], (moved, hit)
    replica, _, hit = other.turn("Name another fruit.")
    assert replica == "r2" and hit >= other_prompt, (other_prompt, hit)
