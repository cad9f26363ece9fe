"""The chat page at `/`: its files and headers over plain HTTP, then the page itself in headless
Chromium (Debian's `chromium`, driven by Playwright) against a live server on the bundled model.

Oracles: the figures the page shows beside each answer are the server's own (their sum equals what
/metrics counted for those requests); a delete in the panel is checked against GET /v1/files; a
fidelity check shows what the server answers the same request; no console error (a CSP violation
is one) happens on the page.

Set MMKV_CHAT_SCREENSHOT=docs/chat-page.png to refresh the screenshot the docs show.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from html.parser import HTMLParser
from importlib.resources import files
from pathlib import Path

import httpx
import pytest

import mmkv
from mmkv.engine import BUNDLED_MODEL, REPO_ROOT
from mmkv.server.app import ServerSettings, create_app
from mmkv.server.routes_page import CONTENT_SECURITY_POLICY
from test_server import LiveServer, png_bytes

KEY = "sk-page-test"
CHROMIUM = shutil.which("chromium")  # Debian's package; Playwright's own browsers are never downloaded
IMAGE = REPO_ROOT / "samples" / "vqa" / "images" / "color-000.png"  # a green triangle
STATIC = files("mmkv.server").joinpath("static")
# What the browser logs for the statuses this test provokes: the 401 before the key is given, a
# fidelity refusal's 400.
PROVOKED = re.compile(r"Failed to load resource: the server responded with a status of (400|401) ")

pytestmark = pytest.mark.skipif(not BUNDLED_MODEL.is_dir(), reason="the bundled sample model is not in samples/")


@pytest.fixture(scope="module")
def live():
    settings = ServerSettings(api_keys=(KEY,), default_max_tokens=16)
    server = LiveServer(create_app(mmkv.Engine.from_pretrained(BUNDLED_MODEL), settings))
    yield server
    server.close()


def v1(live, method: str, path: str, **kw) -> httpx.Response:
    return httpx.request(method, f"{live.base_url}/v1{path}", headers={"Authorization": f"Bearer {KEY}"}, **kw)


# ------------------------------------------------------------------ plain HTTP


class _Markup(HTMLParser):
    """What index.html loads and whether it carries anything a strict CSP would block."""

    def __init__(self):
        super().__init__()
        self.scripts, self.styles, self.inline = [], [], []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.inline += [f"{tag}[{name}]" for name in attrs if name.startswith("on") or name == "style"]
        if tag == "script":
            self.scripts.append(attrs.get("src"))
            self._in_script = True
        if tag == "link" and attrs.get("rel") == "stylesheet":
            self.styles.append(attrs["href"])
        if tag == "style":
            self.inline.append("<style>")

    def handle_endtag(self, tag):
        self._in_script = self._in_script and tag != "script"

    def handle_data(self, data):
        if self._in_script and data.strip():
            self.inline.append("<script> body")


def _directives(policy: str) -> dict[str, list[str]]:
    return {d.split()[0]: d.split()[1:] for d in (part.strip() for part in policy.split(";")) if d}


def test_page_is_served_with_a_strict_csp_and_typed_static_files(live):
    """GET / is open (API keys guard only /v1), carries a CSP that loads scripts and styles from this
    origin only, and names exactly the files /static serves, each under its own type."""
    page = httpx.get(f"{live.base_url}/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert httpx.get(f"{live.base_url}/v1/models").status_code == 401
    policy = _directives(page.headers["content-security-policy"])
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert policy["default-src"] == ["'none'"]
    assert policy["script-src"] == policy["style-src"] == policy["connect-src"] == ["'self'"]
    assert policy["img-src"] == ["'self'", "blob:"]  # an upload's bytes, fetched with the key
    assert policy["frame-ancestors"] == policy["base-uri"] == policy["form-action"] == ["'none'"]
    assert not any("unsafe" in s or s == "*" or s.startswith("http") for v in policy.values() for s in v)

    markup = _Markup()
    markup.feed(page.text)
    assert markup.inline == [], "inline script or style: the CSP would block it"
    assert (markup.scripts, markup.styles) == (["/static/app.js"], ["/static/style.css"])
    types = {"/static/app.js": "text/javascript; charset=utf-8", "/static/style.css": "text/css; charset=utf-8",
             "/static/favicon.svg": "image/svg+xml"}
    for path, content_type in types.items():
        got = httpx.get(f"{live.base_url}{path}")
        assert (got.status_code, got.headers["content-type"]) == (200, content_type)
        assert got.content == STATIC.joinpath(Path(path).name).read_bytes()
        assert got.headers["x-content-type-options"] == "nosniff"
    missing = httpx.get(f"{live.base_url}/static/../app.py")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{live.base_url}/static/routes_page.py").status_code == 404


def test_app_js_never_writes_markup():
    """Server and user text enter the DOM as text: app.js has no HTML sink at all."""
    source = STATIC.joinpath("app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert sink not in source, sink


# ------------------------------------------------------------------ the page in a browser


@pytest.fixture(scope="module")
def browser():
    playwright_api = pytest.importorskip("playwright.sync_api",
                                         reason="playwright is not installed (pip install -e '.[test]')")
    if CHROMIUM is None:
        pytest.skip("no chromium on PATH: Debian's chromium is not installed (apt-get install chromium; .ci/run "
                    "installs it where it can)")
    with playwright_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=CHROMIUM)
        yield chromium
        chromium.close()


def _stat(page, index: int, name: str) -> float:
    value = page.locator(f'.message.assistant[data-index="{index}"] [data-stat="{name}"]').get_attribute("data-value")
    return float(value)


def _ask(page, question: str, answer_index: int) -> dict[str, float]:
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    page.locator(f'.message.assistant[data-index="{answer_index}"] .reuse').wait_for(timeout=15_000)
    return {name: _stat(page, answer_index, name) for name in
            ("cached_tokens", "image_tokens_reused", "vision_tower_runs", "lm_tokens_computed", "ttft_ms")}


def _drop_file(page, name: str, data: bytes) -> None:
    """What a drag from the desktop delivers: a drop event whose DataTransfer holds the file."""
    page.evaluate("""([name, bytes]) => {
        const transfer = new DataTransfer();
        transfer.items.add(new File([new Uint8Array(bytes)], name, {type: "image/png"}));
        for (const type of ["dragenter", "dragover", "drop"]) {
            document.querySelector("#messages").dispatchEvent(
                new DragEvent(type, {dataTransfer: transfer, bubbles: true, cancelable: true}));
        }
    }""", [name, list(data)])


def _metric_totals(live) -> dict[str, float]:
    m = live.metrics()
    return {k: m[f"mmkv:{k}_total"] for k in ("cached_prompt_tokens", "prompt_tokens", "image_cache_hits_tokens")}


def test_chat_page_upload_ask_twice_fidelity_and_delete(live, browser, tmp_path):
    """Load /, give the key, drop an image (uploaded once), ask about it twice: the page streams the
    answers and shows the reuse figures rising; a fidelity check shows the server's verdict and a
    refusal its message; the conversation survives a reload; Delete in the panel deletes the file."""
    v1(live, "POST", "/skills", json={"name": "house style", "text": "Answer in one short sentence."})
    page = browser.new_page(viewport={"width": 1280, "height": 800})
    problems = []  # console errors: a CSP violation is one; the statuses the test provokes are not
    page.on("console", lambda msg: msg.type == "error" and not PROVOKED.match(msg.text) and problems.append(msg.text))
    page.on("pageerror", lambda exc: problems.append(str(exc)))

    page.goto(live.base_url)
    page.wait_for_selector("#server-status.bad")
    assert "API key" in page.text_content("#server-status")
    page.fill("#api-key", KEY)
    page.press("#api-key", "Tab")
    page.wait_for_selector("#server-status.ok")
    assert page.text_content("#model-name") == BUNDLED_MODEL.name
    assert page.text_content("#skills .item-name") == "house style"

    before = _metric_totals(live)
    _drop_file(page, IMAGE.name, IMAGE.read_bytes())
    page.wait_for_selector('.attachment[data-status="ready"]')
    uploaded = v1(live, "GET", "/files").json()["data"]
    assert [f["filename"] for f in uploaded] == [IMAGE.name]
    assert page.locator(f'#uploads [data-file-id="{uploaded[0]["id"]}"]').count() == 1

    first = _ask(page, "what color is the shape ?", 1)
    second = _ask(page, "what shape is it ?", 3)
    after = _metric_totals(live)
    for shown in (first, second):
        assert shown["vision_tower_runs"] == 0 and shown["ttft_ms"] > 0, "the upload ran the vision tower"
        assert shown["image_tokens_reused"] == uploaded[0]["image_tokens"]
    assert second["cached_tokens"] > first["cached_tokens"] >= uploaded[0]["image_tokens"] > 0
    counted = {k: after[k] - before[k] for k in after}
    assert first["cached_tokens"] + second["cached_tokens"] == counted["cached_prompt_tokens"]
    assert 2 * uploaded[0]["image_tokens"] == counted["image_cache_hits_tokens"]
    prompts = [page.locator(f'.message.assistant[data-index="{i}"] .stat.cached').text_content() for i in (1, 3)]
    prompt_tokens = sum(int(p.split("/")[1].split()[0].replace(",", "")) for p in prompts)
    assert prompt_tokens == counted["prompt_tokens"]
    assert all(page.text_content(f'.message.assistant[data-index="{i}"] .message-text').strip() for i in (1, 3))

    # The fidelity check shows what the server answers that request: a report, or its refusal.
    history = [{"role": "user", "content": [{"type": "image_file", "image_file": {"file_id": uploaded[0]["id"]}},
                                            {"type": "text", "text": "what color is the shape ?"}]},
               {"role": "assistant", "content": page.text_content('[data-index="1"] .message-text')},
               {"role": "user", "content": "what shape is it ?"}]
    direct = v1(live, "POST", "/chat/completions", json={"model": BUNDLED_MODEL.name, "messages": history,
                                                          "max_tokens": 1, "mmkv": {"fidelity": True}})
    page.click('[data-index="3"] .fidelity-button')
    page.wait_for_selector('[data-index="3"] .fidelity')
    if direct.status_code == 200:
        report = direct.json()["mmkv"]["fidelity"]
        assert _stat(page, 3, "logit_cosine") == pytest.approx(report["logit_cosine"], abs=1e-4)
        assert page.get_attribute('[data-index="3"] [data-stat="same_argmax"]', "data-value") == \
            json.dumps(report["same_argmax"])
    else:
        assert page.text_content('[data-index="3"] .fidelity .error-message') == direct.json()["error"]["message"]

    screenshot = tmp_path / "chat-page.png"
    page.screenshot(path=screenshot)
    if target := os.environ.get("MMKV_CHAT_SCREENSHOT"):
        shutil.copyfile(screenshot, target)

    # A refusal (a server that does not allow fidelity checks) is shown as the server wrote it, as text.
    refusal = {"error": {"message": "mmkv.fidelity is off on this server <b>ask the operator</b>",
                         "type": "invalid_request_error", "param": "mmkv.fidelity", "code": "unsupported_parameter"}}
    page.route("**/v1/chat/completions", lambda route: route.fulfill(status=400, json=refusal))
    page.click('[data-index="1"] .fidelity-button')
    shown = page.locator('[data-index="1"] .fidelity .error')
    shown.wait_for()
    assert shown.locator(".error-message").text_content() == refusal["error"]["message"]
    assert "param mmkv.fidelity" in shown.locator(".error-where").text_content()
    assert shown.locator("b").count() == 0
    page.unroute("**/v1/chat/completions")

    # The conversation is kept in the browser: a reload shows it again, figures included.
    page.reload()
    page.wait_for_selector("#server-status.ok")
    assert page.locator("#conversations .conversation").count() == 1
    page.click("#conversations .conversation-open")
    assert _stat(page, 3, "cached_tokens") == second["cached_tokens"]

    # Delete from the panel: a second upload (picked, not dropped) goes, the first stays.
    page.set_input_files("#file-input", files=[{"name": "red.png", "mimeType": "image/png",
                                               "buffer": png_bytes((220, 30, 30))}])
    page.wait_for_selector('.attachment[data-status="ready"]')
    red = next(f for f in v1(live, "GET", "/files").json()["data"] if f["filename"] == "red.png")
    page.click(f'#uploads [data-file-id="{red["id"]}"] .item-delete')
    page.locator(f'#uploads [data-file-id="{red["id"]}"]').wait_for(state="detached")
    assert [f["id"] for f in v1(live, "GET", "/files").json()["data"]] == [uploaded[0]["id"]]
    skill_id = v1(live, "GET", "/skills").json()["data"][0]["id"]
    page.click(f'#skills [data-skill-id="{skill_id}"] .item-delete')
    page.locator(f'#skills [data-skill-id="{skill_id}"]').wait_for(state="detached")
    assert v1(live, "GET", "/skills").json()["data"] == []
    assert problems == []
    page.close()
