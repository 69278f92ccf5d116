"""The chat page at ``/`` in a real headless Chromium (Playwright drives the system browser).

Deterministic content (Markdown, reasoning, tool calls, hostile HTML in model output, errors)
comes from the scripted engine behind the real server stack; streaming and Stop also run
against a real server process on the tiny model. Screenshots of the main states go to
``$MLX_SERVER_SCREENSHOTS`` (default: the test's temporary directory).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright
from support import ServerProcess, serving
from tiny_model import build_tiny_model

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None and os.environ.get("MLX_SERVER_REQUIRE_BROWSER"):
    pytest.fail("Chromium is required here (.ci/run installs it with apt) but not found")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no Chromium on this machine (apt-get install chromium): the chat page's browser tests need it",
)
WAIT_MS = 15_000


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    # The test script preloads OpenBLAS for MLX (LD_PRELOAD); in Playwright's node driver and
    # in Chromium it makes thread creation fail, so neither inherits it.
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        with sync_playwright() as p:
            # No sandbox: CI runs as root, where Chromium's sandbox cannot start.
            b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            yield b
            b.close()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload


class Console:
    """Console errors and uncaught exceptions a page produced."""

    def __init__(self, page: Page):
        self.errors: list[str] = []
        page.on("console", self._on_console)
        page.on("pageerror", lambda exc: self.errors.append(f"uncaught: {exc}"))

    def _on_console(self, msg: ConsoleMessage) -> None:
        if msg.type == "error":
            self.errors.append(msg.text)

    def unexpected(self) -> list[str]:
        """Errors other than Chromium's own line for an HTTP error answer the test asked for."""
        return [e for e in self.errors if "Failed to load resource" not in e]


@pytest.fixture
def open_page(browser: Browser, tmp_path: Path):
    contexts = []

    def make(url: str, width: int = 1200, height: int = 800) -> tuple[Page, Console]:
        ctx = browser.new_context(
            viewport={"width": width, "height": height},
            permissions=["clipboard-read", "clipboard-write"],
            accept_downloads=True,
        )
        contexts.append(ctx)
        page = ctx.new_page()
        console = Console(page)
        page.goto(url)
        return page, console

    yield make
    for ctx in contexts:
        ctx.close()


def shot(page: Page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("MLX_SERVER_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / f"{name}.png"))


def send(page: Page, text: str) -> None:
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")


def last_answer(page: Page):
    return page.locator(".msg.assistant").last


def wait_done(page: Page) -> None:
    expect(page.locator("#send")).to_be_visible(timeout=WAIT_MS)


def set_setting(page: Page, selector: str, value: str) -> None:
    if page.locator("#settings").is_hidden():
        page.click("#toggle-settings")
    page.fill(selector, value)
    page.click("#toggle-settings")


# ---- the files and headers ----------------------------------------------------------------


def test_page_and_assets_carry_a_strict_policy(scripted_factory):
    srv = scripted_factory(api_key="sekrit")
    page = httpx.get(srv.base_url + "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp and "unsafe" not in csp
    assert page.headers["x-content-type-options"] == "nosniff"
    # Nothing inline that the policy would have to block: no script bodies, handlers, styles.
    assert re.search(r"<script(?![^>]*\bsrc=)", page.text) is None
    assert re.search(r"\son[a-z]+=|\sstyle=|<style", page.text) is None
    js = httpx.get(srv.base_url + "/webui/app.js")
    assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
    assert js.headers["x-content-type-options"] == "nosniff"
    for name in ("vendor/marked/LICENSE", "vendor/dompurify/LICENSE", "vendor/highlight/LICENSE"):
        assert httpx.get(f"{srv.base_url}/webui/{name}").status_code == 200, name
    # The page needs no key; the API still does.
    assert httpx.get(srv.base_url + "/v1/models").status_code == 401


@pytest.mark.parametrize(
    "name", ["../__init__.py", "..%2F__init__.py", ".hidden", "vendor/", "nothing.js", ""]
)
def test_only_the_page_files_are_served(scripted, name):
    r = httpx.get(f"{scripted.base_url}/webui/{name}")
    assert r.status_code == 404 and "error" in r.json()


def test_no_webui_turns_the_page_off(scripted_factory):
    srv = scripted_factory(app_kw={"webui": False})
    assert httpx.get(srv.base_url + "/").status_code == 404
    assert httpx.get(srv.base_url + "/webui/app.js").status_code == 404


def test_browser_guard_still_keeps_other_origins_out(scripted):
    url = scripted.base_url + "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}]}
    evil = httpx.post(url, json=body, headers={"Origin": "http://evil.test"})
    assert evil.status_code == 403 and "access-control-allow-origin" not in evil.headers
    form = httpx.post(
        url,
        content="{}",
        headers={
            "Origin": f"http://127.0.0.1:{scripted.base_url.rsplit(':', 1)[1]}",
            "Content-Type": "text/plain",
        },
    )
    assert form.status_code == 415
    rebound = httpx.get(scripted.base_url + "/", headers={"Host": "attacker.test"})
    assert rebound.status_code == 403
    # The page's own origin, by either loopback name, is allowed.
    port = scripted.base_url.rsplit(":", 1)[1]
    for origin in (f"http://127.0.0.1:{port}", f"http://localhost:{port}"):
        ok = httpx.post(url, json=body, headers={"Origin": origin})
        assert ok.status_code == 200, (origin, ok.text)


# ---- deterministic content over the scripted engine ---------------------------------------

MARKDOWN = [
    "## Plan\n\nSome **bold** text.\n\n",
    "```python\ndef add(a, b):\n    return a + b\n```\n\n",
    "| a | b |\n|---|---|\n| 1 | 2 |\n",
]


def test_streamed_markdown_with_highlighted_code_and_copy(scripted, open_page, tmp_path):
    # The answer is held until the Stop button has been seen: a stream that ends between two
    # looks would otherwise hide it first.
    first_piece = threading.Event()
    scripted.engine.push(*MARKDOWN, delay=0.05, gate=first_piece)
    page, console = open_page(scripted.base_url + "/")
    expect(page.locator("#model-name")).to_have_text("scripted-model", timeout=WAIT_MS)
    send(page, "Write a function")
    try:
        expect(page.locator("#stop")).to_be_visible()
    finally:
        first_piece.set()
    answer = last_answer(page)
    expect(answer.locator("h2")).to_have_text("Plan", timeout=WAIT_MS)
    wait_done(page)
    expect(answer.locator("strong")).to_have_text("bold")
    expect(answer.locator("table td").first).to_have_text("1")
    code = answer.locator(".code-block code")
    expect(code.locator(".hljs-keyword").first).to_have_text("def")
    answer.locator(".code-block .copy").click()
    expect(answer.locator(".code-block .copy")).to_have_text("Copied")
    copied = page.evaluate("navigator.clipboard.readText()")
    assert copied == "def add(a, b):\n    return a + b\n"
    expect(answer.locator(".meta")).to_contain_text("tok/s")
    expect(answer.locator(".meta")).to_contain_text("cached")
    shot(page, "webui-light", tmp_path)
    assert console.errors == []


HOSTILE = [
    'Look: <img src=x onerror="window.__xss=1"> <script>window.__xss=2</script>',
    '<iframe src="javascript:window.__xss=3"></iframe> [click](javascript:window.__xss=4) ',
    '<a href="javascript:window.__xss=5" onclick="window.__xss=6">a</a> ',
    '<div style="position:fixed;inset:0" class="error-text" id="prompt">styled</div> ',
    '<svg onload="window.__xss=7"></svg><form action="/v1/cancel"><button>go</button></form>',
]


def test_hostile_html_in_model_output_does_not_run(scripted, open_page):
    scripted.engine.push(
        "<think><img src=y onerror=\"window.__xss='reasoning'\"></think>", *HOSTILE
    )
    page, console = open_page(scripted.base_url + "/")
    send(page, "hello")
    wait_done(page)
    answer = last_answer(page)
    content = answer.locator(".content")
    expect(content).to_contain_text("styled")
    expect(content).to_contain_text("<script>window.__xss=2</script>")  # shown as text
    content.locator("a").first.click()  # a javascript: link must not run
    page.locator("details.reasoning summary").click()
    assert page.evaluate("window.__xss") is None
    for tag in (
        "img",
        "script",
        "iframe",
        "svg",
        "form",
        "button",
        "[style]",
        "[onclick]",
        "#prompt",
    ):
        assert content.locator(tag).count() == 0, tag
    hrefs = content.locator("a").evaluate_all("els => els.map(a => a.getAttribute('href'))")
    assert all(h is None or not h.lower().startswith("javascript") for h in hrefs), hrefs
    assert content.locator(".error-text").count() == 0  # the page's own classes are dropped
    # Reasoning is text, never markup.
    expect(answer.locator(".reasoning-body")).to_contain_text("<img src=y")
    assert page.locator("#prompt").count() == 1
    assert console.errors == []  # not even a handler the policy had to block


def test_reasoning_collapsed_apart_from_the_answer_and_tool_calls_shown(scripted, open_page):
    scripted.engine.push(
        "<think>The user wants the weather.</think>",
        "Checking. ",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    )
    page, console = open_page(scripted.base_url + "/")
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    set_setting(page, "#set-tools", json.dumps(tools))
    send(page, "Weather in Paris?")
    wait_done(page)
    answer = last_answer(page)
    details = answer.locator("details.reasoning")
    expect(details).to_have_count(1)
    assert details.get_attribute("open") is None
    expect(answer.locator(".reasoning-body")).not_to_be_visible()
    details.locator("summary").click()
    expect(answer.locator(".reasoning-body")).to_have_text("The user wants the weather.")
    expect(answer.locator(".content")).to_have_text("Checking.")
    expect(answer.locator(".tool-call code").first).to_have_text("get_weather")
    args = json.loads(answer.locator(".tool-args").inner_text())
    assert args == {"city": "Paris"}
    prompt = scripted.service.tokenizer.decode(scripted.engine.requests[-1].prompt_tokens)
    assert "get_weather" in prompt  # the tools reached the template
    assert console.errors == []


def test_schema_answer_rendered_as_json(scripted_factory, tiny_tokenizer, open_page):
    from mlx_server.engine.grammar.constraints import ConstraintCompiler

    # The scripted engine replays its text; the grammar is compiled and handed to it.
    scripted = scripted_factory(constraints=ConstraintCompiler(tiny_tokenizer))
    scripted.engine.push('{"name": "Ada", ', '"age": 36}')
    page, console = open_page(scripted.base_url + "/")
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    set_setting(page, "#set-schema", json.dumps(schema))
    send(page, "A person")
    wait_done(page)
    block = last_answer(page).locator(".code-block")
    expect(block.locator(".code-head span")).to_have_text("json")
    assert json.loads(block.locator("code").inner_text()) == {"name": "Ada", "age": 36}
    assert "\n" in block.locator("code").inner_text()  # pretty-printed
    assert scripted.engine.requests[-1].logits_processors  # the schema became a grammar
    assert console.errors == []


def test_bad_schema_is_shown_and_nothing_is_sent(scripted, open_page):
    page, _ = open_page(scripted.base_url + "/")
    set_setting(page, "#set-schema", "{not json")
    send(page, "hi")
    expect(page.locator("#settings-error")).to_contain_text("not valid JSON")
    assert scripted.engine.requests == []
    expect(page.locator(".msg")).to_have_count(0)


def test_errors_shown_plainly(scripted_factory, open_page):
    busy = scripted_factory()
    busy.engine.max_queue = 0
    page, console = open_page(busy.base_url + "/")
    send(page, "hi")
    expect(last_answer(page).locator(".error-text")).to_contain_text("Server busy (503)")
    tight = scripted_factory(ctx_size=64)
    page, _ = open_page(tight.base_url + "/")
    send(page, "word " * 200)
    expect(last_answer(page).locator(".error-text")).to_contain_text("too long")
    failing = scripted_factory()
    failing.engine.push("partial ", "answer", finish="error")
    page, _ = open_page(failing.base_url + "/")
    send(page, "hi")
    answer = last_answer(page)
    expect(answer.locator(".error-text")).to_have_text("The generation failed: scripted failure")
    expect(answer.locator(".content")).to_have_text("partial answer")
    failing.stop()  # the server goes away under the open page
    send(page, "still there?")
    expect(last_answer(page).locator(".error-text")).to_contain_text("Cannot reach the server")
    assert console.unexpected() == []


def test_api_key_flow(scripted_factory, open_page):
    srv = scripted_factory(api_key="sekrit")
    page, console = open_page(srv.base_url + "/")
    expect(page.locator("#key-panel")).to_be_visible(timeout=WAIT_MS)
    page.fill("#api-key", "wrong")
    page.press("#api-key", "Enter")
    expect(page.locator("#key-error")).to_have_text("That key was refused.")
    page.fill("#api-key", "sekrit")
    page.press("#api-key", "Enter")
    expect(page.locator("#key-panel")).to_be_hidden()
    expect(page.locator("#model-name")).to_have_text("scripted-model")
    send(page, "hi")
    wait_done(page)
    expect(last_answer(page).locator(".content")).to_have_text("Hello there!")
    page.reload()  # the key is remembered
    expect(page.locator("#model-name")).to_have_text("scripted-model", timeout=WAIT_MS)
    expect(page.locator("#key-panel")).to_be_hidden()
    page.click("#toggle-settings")
    page.click("#forget-key")
    expect(page.locator("#key-panel")).to_be_visible()
    assert console.unexpected() == []


def test_conversations_persist_rename_delete_export(scripted, open_page):
    page, console = open_page(scripted.base_url + "/")
    send(page, "first question")
    wait_done(page)
    page.click("#new-chat")
    send(page, "second question")
    wait_done(page)
    page.reload()
    items = page.locator("#conversations li")
    expect(items).to_have_count(2)
    expect(items.nth(0).locator(".conv-title")).to_have_text("second question")
    items.nth(1).locator(".conv-title").click()
    expect(page.locator(".msg.user .text")).to_have_text("first question")
    expect(last_answer(page).locator(".content")).to_have_text("Hello there!")
    items.nth(1).get_by_label("Rename").click()
    page.fill("input.rename", "Renamed chat")
    page.press("input.rename", "Enter")
    expect(page.locator("#title")).to_have_text("Renamed chat")
    page.reload()
    expect(page.locator("#conversations li .conv-title").nth(1)).to_have_text("Renamed chat")
    with page.expect_download() as dl:
        page.click("#export")
    doc = json.loads(Path(dl.value.path()).read_text())
    titles = [c["title"] for c in doc["conversations"]]
    assert titles[:2] == ["second question", "Renamed chat"]
    assert doc["conversations"][1]["messages"][0]["content"] == "first question"
    page.locator("#conversations li").nth(0).get_by_label("Delete").click()
    expect(page.locator("#conversations li")).to_have_count(1)
    page.reload()
    expect(page.locator("#conversations li .conv-title")).to_have_text(["Renamed chat"])
    assert console.errors == []


def test_theme_persists_and_narrow_layout(scripted, open_page, tmp_path):
    scripted.engine.push(*MARKDOWN)
    page, console = open_page(scripted.base_url + "/")
    send(page, "Write a function")
    wait_done(page)
    page.click("#toggle-theme")
    page.reload()
    expect(page.locator("html")).to_have_attribute("data-theme", "dark")
    assert page.evaluate("document.getElementById('hl-light').disabled") is True
    bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert bg != "rgb(255, 255, 255)"
    page.click("#toggle-status")
    expect(page.locator("#status-list")).to_contain_text("scripted-model")
    expect(page.locator("#status-list")).to_contain_text("Requests")
    shot(page, "webui-dark", tmp_path)
    page.click("#toggle-status")
    page.set_viewport_size({"width": 390, "height": 780})
    sidebar = page.locator("#sidebar")
    expect(page.locator("#open-sidebar")).to_be_visible()
    # The list slides off-screen (a short transition).
    page.wait_for_function(
        "() => document.getElementById('sidebar').getBoundingClientRect().right <= 0"
    )
    composer = page.locator("#composer").bounding_box()
    assert composer["x"] >= 0 and composer["x"] + composer["width"] <= 390
    shot(page, "webui-narrow", tmp_path)
    page.click("#open-sidebar")
    expect(sidebar).to_have_class("open")
    page.wait_for_function(
        "() => document.getElementById('sidebar').getBoundingClientRect().x >= 0"
    )
    page.locator("#conversations .conv-title").first.click()
    page.wait_for_function(
        "() => document.getElementById('sidebar').getBoundingClientRect().right <= 0"
    )
    assert console.errors == []


def test_images_attached_when_the_model_has_vision(scripted_factory, open_page, tmp_path):
    srv = scripted_factory(capabilities=["vision"])
    page, console = open_page(srv.base_url + "/")
    expect(page.locator("#attach-label")).to_be_visible(timeout=WAIT_MS)
    png = _png(tmp_path)
    page.set_input_files("#attach", str(png))
    expect(page.locator("#attachments img")).to_have_count(1)
    # Drag and drop: a File built in the page, dropped on the composer.
    page.evaluate(
        """(b64) => {
          const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
          const file = new File([bytes], 'd.png', {type: 'image/png'});
          const dt = new DataTransfer();
          dt.items.add(file);
          const drop = new DragEvent('drop', {dataTransfer: dt, bubbles: true, cancelable: true});
          document.getElementById('composer').dispatchEvent(drop);
        }""",
        base64.b64encode(png.read_bytes()).decode(),
    )
    expect(page.locator("#attachments img")).to_have_count(2)
    page.locator("#attachments button").first.click()
    expect(page.locator("#attachments img")).to_have_count(1)
    send(page, "What is this?")
    expect(page.locator(".msg.user img.thumb")).to_have_count(1)
    expect(page.locator("#attachments img")).to_have_count(0)
    assert console.unexpected() == []


def test_no_attach_without_vision_and_model_picker_hidden_for_one_model(scripted, open_page):
    page, _ = open_page(scripted.base_url + "/")
    expect(page.locator("#model-name")).to_have_text("scripted-model", timeout=WAIT_MS)
    expect(page.locator("#attach-label")).to_be_hidden()
    expect(page.locator("#model-picker")).to_be_hidden()


def _png(folder: Path) -> Path:
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    raw = b"".join(b"\x00" + b"\xff\x00\x00" * 4 for _ in range(4))
    data = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    path = folder / "red.png"
    path.write_bytes(data)
    return path


# ---- a real server process on the tiny model ----------------------------------------------


@pytest.fixture(scope="module")
def real_server(tmp_path_factory) -> Iterator[ServerProcess]:
    model = build_tiny_model(tmp_path_factory.mktemp("webui") / "tiny-model")
    with serving(["-m", str(model), "--ctx-size", "2048"]) as sp:
        yield sp


def test_real_server_streams_and_stop_cancels(real_server, open_page):
    # localhost here, 127.0.0.1 below: the page works by either loopback name.
    page, console = open_page(f"http://localhost:{real_server.port}/")
    set_setting(page, "#set-extra", '{"ignore_eos": true}')
    set_setting(page, "#set-max-tokens", "6")
    send(page, "Say something")
    wait_done(page)
    answer = last_answer(page)
    expect(answer.locator(".meta")).to_contain_text("6 generated")
    expect(answer.locator(".meta")).to_contain_text("tok/s")
    set_setting(page, "#set-max-tokens", "1500")
    since = len(real_server.lines)
    send(page, "Go on")
    answer = last_answer(page)
    expect(answer.locator(".content")).not_to_be_empty(timeout=WAIT_MS)
    page.click("#stop")
    real_server.wait_for_line("Cancel requested: 1 active generation(s) cancelled", since)
    wait_done(page)
    expect(answer.locator(".meta")).to_contain_text("stopped")
    generated = int(answer.locator(".meta").inner_text().split(" generated")[0].split()[-1])
    assert 0 < generated < 1500
    assert console.errors == []


def test_real_server_page_from_127(real_server, open_page):
    page, console = open_page(f"http://127.0.0.1:{real_server.port}/")
    expect(page.locator("#model-name")).to_have_text("tiny-model", timeout=WAIT_MS)
    page.click("#toggle-status")
    expect(page.locator("#status-list")).to_contain_text("prompt cache", timeout=WAIT_MS)
    assert console.errors == []


def test_model_picker_and_context_size_when_several_models(scripted, open_page):
    # This server has one model; the page is shown a list of two (as a many-model server
    # answers) to check what it does with it. Chat requests still go to the real server.
    listing = {
        "object": "list",
        "data": [
            {"id": "scripted-model", "object": "model", "owned_by": "mlx", "context_length": 512},
            {"id": "other-model", "object": "model", "owned_by": "mlx", "capabilities": ["vision"]},
        ],
    }
    page, console = open_page("about:blank")
    page.route("**/v1/models", lambda route: route.fulfill(json=listing))
    page.goto(scripted.base_url + "/")
    picker = page.locator("#model-picker")
    expect(picker).to_be_visible(timeout=WAIT_MS)
    expect(page.locator("#attach-label")).to_be_hidden()
    page.click("#toggle-status")
    expect(page.locator("#status-list")).to_contain_text("512 tokens")
    picker.select_option("other-model")
    expect(page.locator("#attach-label")).to_be_visible()  # that one has vision
    send(page, "hi")
    wait_done(page)
    page.reload()  # the choice is remembered
    expect(page.locator("#model-picker")).to_have_value("other-model", timeout=WAIT_MS)
    assert console.errors == []
