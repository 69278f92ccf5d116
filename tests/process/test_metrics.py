"""GET /metrics: Prometheus text, scraped with prometheus-client's own parser."""

from __future__ import annotations

import json
import threading

import httpx
import pytest
from clients import wait_until
from prometheus_client.parser import text_string_to_metric_families
from support import serving
from tiny_model import build_tiny_model


def scrape(base_url: str, **headers: str) -> dict[tuple[str, tuple], float]:
    r = httpx.get(base_url + "/metrics", headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def test_metrics_need_the_key_and_count_requests(scripted_factory):
    srv = scripted_factory(api_key="k")
    assert httpx.get(srv.base_url + "/metrics").status_code == 401
    key = {"Authorization": "Bearer k"}
    srv.engine.push("a", "b", "c")
    r = httpx.post(srv.base_url + "/v1/chat/completions", json=CHAT, headers=key)
    assert r.status_code == 200
    httpx.post(srv.base_url + "/v1/chat/completions", json=CHAT)  # 401
    httpx.get(srv.base_url + "/v1/nowhere/123", headers=key)  # 404
    m = scrape(srv.base_url, **key)
    route = "/v1/chat/completions"
    assert value(m, "mlx_server_requests_total", route=route, method="POST", status="200") == 1
    assert value(m, "mlx_server_requests_total", route=route, method="POST", status="401") == 1
    assert value(m, "mlx_server_requests_total", route="other", method="GET", status="404") == 1
    usage = r.json()["usage"]
    assert value(m, "mlx_server_prompt_tokens_total") == usage["prompt_tokens"]
    assert value(m, "mlx_server_generation_tokens_total") == 3
    assert value(m, "mlx_server_generations_total", reason="stop") == 1
    assert value(m, "mlx_server_time_to_first_token_seconds_count") == 1
    assert value(m, "mlx_server_inter_token_latency_seconds_count") == 2
    assert value(m, "mlx_server_e2e_request_latency_seconds_count") == 1
    assert value(m, "mlx_server_queue_depth") == 0


def test_metrics_open_flag_and_separate_registries(scripted_factory):
    a = scripted_factory(api_key="k", app_kw={"metrics_open": True})
    b = scripted_factory(api_key="k", app_kw={"metrics_open": True})
    a.engine.push("x")
    httpx.post(a.base_url + "/v1/chat/completions", json=CHAT, headers={"x-api-key": "k"})
    ma, mb = scrape(a.base_url), scrape(b.base_url)
    assert value(ma, "mlx_server_generation_tokens_total") == 1
    assert value(mb, "mlx_server_generation_tokens_total") == 0


def test_disconnect_and_cancellation_are_counted(scripted):
    scripted.engine.push(*(["w"] * 1000), delay=0.02)
    body = {**CHAT, "stream": True}
    with httpx.stream("POST", scripted.base_url + "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if '"w"' in line:
                break  # leave mid-stream
    assert wait_until(
        lambda: value(scrape(scripted.base_url), "mlx_server_cancellations_total") == 1,
        "the cancellation to be counted",
        timeout=30,
    )
    m = scrape(scripted.base_url)
    assert value(m, "mlx_server_client_disconnects_total") == 1
    assert value(m, "mlx_server_generations_total", reason="cancelled") == 1


@pytest.fixture(scope="module")
def tiny_metrics_server(tmp_path_factory):
    model = build_tiny_model(tmp_path_factory.mktemp("srv") / "tiny-model")
    args = ["-m", str(model), "--ctx-size", "512"]
    flags = ["--api-key", "k", "--metrics-open", "--max-batch-size", "2"]
    flags += ["--allowed-hosts", "box.lan", "--allowed-origins", "https://app.example"]
    with serving([*args, *flags]) as sp:
        yield sp


def test_browser_flags_reach_the_process(tiny_metrics_server):
    url = tiny_metrics_server.base_url + "/metrics"
    ok = httpx.get(url, headers={"Host": "box.lan:80", "Origin": "https://app.example"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "https://app.example"
    assert httpx.get(url, headers={"Host": "other.lan"}).status_code == 403
    assert httpx.get(url, headers={"Origin": "https://other.example"}).status_code == 403


def test_counters_move_under_load(tiny_metrics_server):
    srv = tiny_metrics_server
    key = {"Authorization": "Bearer k"}
    before = scrape(srv.base_url)
    assert value(before, "mlx_server_kv_budget_bytes") > 0
    prompt = "Hello world! What is the capital of France? " * 4
    # ignore_eos: every request runs its 40 tokens (a random model may end one at once).
    body = {
        "prompt": prompt,
        "max_tokens": 40,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    usages: list[dict] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with httpx.stream(
                "POST", srv.base_url + "/v1/completions", json=body, headers=key, timeout=120
            ) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {") and '"usage"' in line:
                        usages.append(json.loads(line[6:])["usage"])
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    # During the load: sequences run, and with a batch of 2 the others wait in the queue.
    busy = []
    assert wait_until(
        lambda: (
            busy.append(scrape(srv.base_url))
            or value(busy[-1], "mlx_server_running_sequences") >= 1
        ),
        "a running sequence",
        timeout=30,
        interval=0.05,
    )
    assert value(busy[-1], "mlx_server_kv_bytes_in_use") > 0
    for t in threads:
        t.join(120)
    assert not errors and len(usages) == 4
    after = scrape(srv.base_url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert moved("mlx_server_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert moved("mlx_server_generation_tokens_total") == sum(
        u["completion_tokens"] for u in usages
    )
    cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
    assert moved("mlx_server_prompt_tokens_cached_total") == cached
    assert moved("mlx_server_time_to_first_token_seconds_count") == 4
    assert moved("mlx_server_client_disconnects_total") == 0  # every stream was read to the end
    assert moved("mlx_server_e2e_request_latency_seconds_count") == 4
    assert (
        moved("mlx_server_requests_total", route="/v1/completions", method="POST", status="200")
        == 4
    )
    lookups = moved("mlx_server_prefix_cache_hits_total") + moved(
        "mlx_server_prefix_cache_misses_total"
    )
    assert lookups == 4
    assert value(after, "mlx_server_prefix_cache_entries") >= 1
    assert value(after, "mlx_server_prefix_cache_bytes") > 0
    assert value(after, "mlx_server_running_sequences") == 0
    assert value(after, "mlx_server_kv_bytes_in_use") == 0
    # The same prompt again reuses the cached prefix.
    r = httpx.post(
        srv.base_url + "/v1/completions",
        json={**body, "stream": False, "max_tokens": 2},
        headers=key,
        timeout=60,
    )
    again = scrape(srv.base_url)
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert (
        value(again, "mlx_server_prefix_cache_hits_total")
        == value(after, "mlx_server_prefix_cache_hits_total") + 1
    )


def test_prefix_cache_evictions_reach_the_scrape():
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache
    from prometheus_client import generate_latest

    from mlx_server.engine.cache.prefix import PrefixCache
    from mlx_server.server.metrics import Metrics

    def kv(n: int) -> list[KVCache]:
        c = KVCache()
        pos = mx.arange(n, dtype=mx.float32).reshape(1, 1, n, 1)
        c.keys, c.values, c.offset = pos, pos, n
        return [c]

    pc = PrefixCache(2, 1 << 30)
    for start in (0, 100, 200):  # three unrelated prompts, room for two
        pc.insert(list(range(start, start + 8)), kv(8))
    pc.fetch(list(range(200, 208)))
    pc.fetch([999])

    class Engine:
        active_count = 0
        queue_depth = 0

        def stats(self) -> dict:
            return {"kv_in_use_bytes": 0, **pc.stats()}

    text = generate_latest(Metrics(Engine()).registry).decode()
    m = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert value(m, "mlx_server_prefix_cache_evictions_total") == 1
    assert value(m, "mlx_server_prefix_cache_entries") == 2
    assert value(m, "mlx_server_prefix_cache_hits_total") == 1
    assert value(m, "mlx_server_prefix_cache_misses_total") == 1
    assert value(m, "mlx_server_prefix_cache_bytes") == pc.nbytes > 0
