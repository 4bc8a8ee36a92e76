"""The web page in a real headless Chromium (Debian's ``chromium``, driven by playwright) against a real server.

The served tiny Llama is planned with part of it on disk, so the page has two devices to colour. The server
needs an API key: the page must ask for it and send it. Every request the page makes is recorded; anything
not to the test server is refused and fails the test (the page must work with no network).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.ui.plan_picture import device_colour
from tests.service.conftest import LiveServer, settings_for

CHROMIUM = os.environ.get("LOADMASTER_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
KEY = "ui-test-key-5f2a"
IMAGES = Path(__file__).resolve().parents[3] / "docs" / "images"
ROOT = Path(__file__).resolve().parents[3]


def _need_browser() -> Any:
    """playwright's sync API, or the reason the browser tests cannot run (a failure under CI, else a skip)."""
    missing = []
    if not (shutil.which(CHROMIUM) or Path(CHROMIUM).exists()):
        missing.append(f"no Chromium at {CHROMIUM}")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing.append("the playwright package is not installed")
        sync_playwright = None
    if missing:
        message = "; ".join(missing) + ": run scripts/install-browser"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return sync_playwright


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    sync_playwright = _need_browser()
    IMAGES.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


def _ui_settings(model: Path, folder: Path, cpu: int) -> Any:
    return settings_for(
        model,
        api_key=[KEY],
        max_memory=[f"cpu={cpu}", "disk=1GiB"],
        offload_folder=str(folder),
        batch_size=4,
        max_batch_size=4,
        max_concurrent_requests=32,
    )


def _cpu_budget_splitting(model: Path, folder: Path) -> int:
    """A RAM budget (bytes) under which the server's plan of the tiny model keeps some layers on cpu and the rest on
    disk. Planned as the server plans (its served shape picks the prefill step, so the split moves with it)."""
    from planner.api import plan_inputs
    from planner.errors import PlanError
    from service.model.background_load import served_inputs

    for cpu in range(1 << 20, 16 << 20, 64 << 10):
        try:
            inputs, _ = served_inputs(_ui_settings(model, folder, cpu), model)
            placed = set(plan_inputs(str(model), inputs, advise=False).placement.values())
        except PlanError:  # too small for any placement
            continue
        if placed == {"cpu", "disk"}:
            return cpu
    raise AssertionError("no RAM budget splits the tiny model between cpu and disk")


@pytest.fixture(scope="module")
def ui_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("offload")
    cpu = _cpu_budget_splitting(tiny_llama, folder)
    s = LiveServer(_ui_settings(tiny_llama, folder, cpu)).start()
    yield s
    s.stop()


class PageSession:
    """A page with its console errors, the requests it made, and the external ones it was refused."""

    def __init__(self, browser: Any, width: int, height: int, base: str | None):
        self.context = browser.new_context(viewport={"width": width, "height": height})
        self.context.set_default_timeout(120_000)  # a shared 2-core machine can be slow; failures still show
        self.errors: list[str] = []
        self.requests: list[Any] = []
        self.external: list[str] = []

        def route(r: Any) -> None:
            url = r.request.url
            if (base and url.startswith(base)) or url.startswith(("file://", "data:", "about:")):
                r.continue_()
            else:
                self.external.append(url)
                r.abort()

        self.context.route("**/*", route)
        self.page = self.context.new_page()
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on("request", lambda r: self.requests.append(r))

    def unlock(self) -> None:
        """Answer the page's API-key dialog."""
        self.page.wait_for_selector("#key-dialog[open]")
        self.page.fill("#key-input", KEY)
        self.page.keyboard.press("Enter")

    def close(self) -> None:
        self.context.close()


@pytest.fixture()
def session(browser: Any, ui_server: LiveServer) -> Iterator[PageSession]:
    s = PageSession(browser, 1280, 800, ui_server.url)
    s.page.goto(ui_server.url + "/ui")
    s.unlock()
    s.page.wait_for_selector("#plan-picture svg rect.layer")
    yield s
    assert s.external == [], f"the page tried to reach the network: {s.external}"
    s.close()


def _served_plan(server: LiveServer) -> dict[str, Any]:
    r = httpx.get(server.url + "/info", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    r.raise_for_status()
    return r.json()["plan"]


def test_page_draws_the_served_plan_and_sends_the_key(session: PageSession, ui_server: LiveServer) -> None:
    plan = _served_plan(ui_server)
    page = session.page
    layers = page.eval_on_selector_all(
        "#plan-picture rect.layer",
        "els => els.map(e => ({name: e.dataset.name, device: e.dataset.device, layer: e.dataset.layer ?? null, "
        "fill: e.getAttribute('fill')}))",
    )
    assert [x["name"] for x in layers] == list(plan["placement"]), "one block per placed module, in order"
    for x in layers:
        dev = plan["placement"][x["name"]]
        assert x["device"] == str(dev) and x["fill"] == device_colour(dev)
    assert sum(1 for x in layers if x["layer"] is not None) == 4, "one block per decoder layer of the tiny Llama"
    devices = {x["device"] for x in layers}
    assert devices == {"cpu", "disk"}, devices
    assert device_colour("cpu") != device_colour("disk")

    bars = page.eval_on_selector_all(
        "#plan-picture g.device-bar",
        "els => els.map(e => [e.dataset.device, Number(e.dataset.total), Number(e.dataset.capacity)])",
    )
    assert bars == [[str(b["device"]), b["total"], b["capacity"]] for b in plan["budgets"]]
    hops = page.locator("#plan-picture path.hop").count()
    assert hops == sum(1 for a, b in zip(layers, layers[1:]) if a["device"] != b["device"])
    assert page.locator("#budget-table tbody tr").count() == len(plan["budgets"])
    assert page.locator("#reasons li").count() == len(plan["reasons"])
    desc = page.text_content("#plan-picture svg desc") or ""
    assert "blocks" in desc and "tokens/s" in desc, "the chart has a text alternative"
    # the what-if form suggests the context the server plans for (the plan in force, as /info and /plan state it)
    assert page.get_attribute("#wi-context", "placeholder") == str(plan["workload"]["context"])

    # The page's shell is open; the data is not, and GET / from a non-browser client still needs the key.
    assert httpx.get(ui_server.url + "/ui", timeout=30).status_code == 200
    assert httpx.get(ui_server.url + "/info", timeout=30).status_code == 401
    assert httpx.get(ui_server.url + "/", headers={"Accept": "application/json"}, timeout=30).status_code == 401
    assert (
        httpx.post(ui_server.url + "/", json={"inputs": "x"}, headers={"Accept": "text/html"}, timeout=30).status_code
        == 401
    )

    api_calls = [
        r for r in session.requests if r.url.startswith(ui_server.url) and "/ui" != r.url[len(ui_server.url) :]
    ]
    assert api_calls, "the page called the API"
    for r in api_calls:
        if r.url.endswith(("/info", "/metrics", "/ui/picture")):
            assert r.headers.get("authorization") == f"Bearer {KEY}", r.url
    assert session.errors == []


def test_what_if_redraws_and_gives_advice(session: PageSession) -> None:
    page = session.page
    page.fill("#wi-gpus", "2x24GiB")
    page.click("#wi-submit")
    page.wait_for_selector("#whatif-result[data-state=plan]")
    bars = page.eval_on_selector_all("#whatif-picture g.device-bar", "els => els.map(e => e.dataset.device)")
    assert bars[:2] == ["0", "1"]
    gpu_layers = page.eval_on_selector_all("#whatif-picture rect.layer", "els => els.map(e => e.dataset.device)")
    assert set(gpu_layers) <= {"0", "1"} and gpu_layers
    text = page.text_content("#whatif-result") or ""
    assert "tokens/s" in text and "load" in text
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(IMAGES / "ui-1280x800.png"), full_page=False)
    assert session.errors == []

    page.fill("#wi-gpus", "1x64KiB")
    page.fill("#wi-cpu", "1KiB")
    page.click("#wi-submit")
    page.wait_for_selector("#whatif-result[data-state=no-fit]")
    advice = page.text_content("#whatif-result .advice") or ""
    assert "does not fit" in advice and "would fit" in advice, advice
    assert page.locator("#whatif-picture svg").count() == 0
    # The one console error allowed: Chromium's own log line for /plan's 422.
    assert all("status of 422" in e for e in session.errors), session.errors


def _figures(page: Any) -> dict[str, str]:
    return page.evaluate(
        "() => Object.fromEntries(['tps','batch','queue','inflight','generated','ttft']"
        ".map(k => [k, document.getElementById('live-' + k).textContent]))"
    )


def test_live_figures_change_while_requests_run(session: PageSession, ui_server: LiveServer) -> None:
    page = session.page
    page.wait_for_function("document.getElementById('live-generated').textContent !== '–'")
    before = _figures(page)
    seen: list[dict[str, str]] = []
    done = threading.Event()

    # The page polls once a second; on a fast machine one round of requests can end between two polls, so each
    # client keeps sending for a few seconds (at least one request each).
    load_until = time.monotonic() + 4.0

    def load() -> None:
        with httpx.Client(base_url=ui_server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:

            def client() -> None:
                while True:
                    c.post("/generate", json={"inputs": "the plan is", "parameters": {"max_new_tokens": 120}})
                    if time.monotonic() > load_until:
                        return

            threads = [threading.Thread(target=client) for _ in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        done.set()

    threading.Thread(target=load, daemon=True).start()
    deadline = time.monotonic() + 120
    while not done.is_set() and time.monotonic() < deadline:
        seen.append(_figures(page))
        page.wait_for_timeout(150)
    assert done.is_set()
    page.wait_for_timeout(1500)
    after = _figures(page)
    assert int(after["generated"]) >= int(before["generated"]) + 6 * 120
    assert any(int(s["inflight"]) > 0 for s in seen), "in-flight requests showed while they ran"
    assert any(int(s["batch"]) > 0 for s in seen), "the running batch showed while requests ran"
    assert float(after["tps"]) > 0 and after["ttft"].endswith("ms")
    rows = page.eval_on_selector_all("#memory-table tbody tr", "els => els.map(e => e.cells[0].textContent)")
    assert set(rows) >= {"cpu", "disk"}
    assert session.errors == []


def test_playground_streams(session: PageSession, ui_server: LiveServer) -> None:
    page = session.page
    # Record the token count at every change of the output: a stream shows tokens as they come (in as many
    # pieces as the network delivers them), not all at the end.
    # The tiny model streams its 48 tokens in about 0.2 s; a renderer busy for that long (a loaded 2-core machine)
    # would read them as one piece. Chromium's own throttling paces the ~6 KB of events over about two seconds, so
    # a page that draws as it reads must show several counts, and one that waits for the end still shows one.
    cdp = page.context.new_cdp_session(page)
    cdp.send("Network.enable")
    cdp.send(
        "Network.emulateNetworkConditions",
        {"offline": False, "latency": 0, "downloadThroughput": 3000, "uploadThroughput": -1},
    )
    page.evaluate("""() => { window.__counts = [];
        const out = document.getElementById('play-output');
        new MutationObserver(() => window.__counts.push(Number(out.dataset.tokens)))
          .observe(out, {attributes: true, attributeFilter: ['data-tokens']}); }""")
    page.fill("#play-prompt", "Once upon a time")
    page.fill("#play-max", "48")
    page.click("#play-submit")
    page.wait_for_function("!document.getElementById('play-submit').disabled", timeout=180_000)
    assert "tokens in" in (page.text_content("#play-stats") or ""), page.text_content("#play-stats")
    counts = [c for c in page.evaluate("window.__counts") if c > 0]
    text = page.text_content("#play-output")
    assert page.get_attribute("#play-output", "data-tokens") == "48"
    assert len(set(counts)) >= 2 and counts[0] < 48, f"token counts as shown: {counts}"
    expected = httpx.post(
        ui_server.url + "/generate",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=60,
        json={"inputs": "Once upon a time", "parameters": {"max_new_tokens": 48}},
    ).json()
    assert text == expected["generated_text"], "the streamed text is the server's greedy text"
    gen = [r for r in session.requests if r.url.endswith("/generate_stream")]
    assert gen and gen[-1].headers.get("authorization") == f"Bearer {KEY}"
    assert session.errors == []


def test_keyboard_and_phone_width(browser: Any, ui_server: LiveServer) -> None:
    s = PageSession(browser, 390, 844, ui_server.url)
    try:
        page = s.page
        page.goto(ui_server.url + "/")  # a browser's GET / is the page too
        s.unlock()
        page.wait_for_selector("#plan-picture svg rect.layer")
        width = page.evaluate("document.documentElement.scrollWidth")
        assert width <= 390, f"the page scrolls sideways at phone width ({width}px)"
        # The what-if form works from the keyboard alone.
        page.focus("#wi-gpus")
        page.keyboard.type("2x24GiB")
        page.keyboard.press("Enter")
        page.wait_for_selector("#whatif-result[data-state=plan]")
        page.evaluate("window.scrollTo(0, 0)")
        page.screenshot(path=str(IMAGES / "ui-390x844.png"), full_page=False)
        assert s.errors == [] and s.external == []
    finally:
        s.close()


def test_plan_html_works_offline_from_a_file(browser: Any, tiny_llama: Path, tmp_path: Path) -> None:
    from service.cli.main import main

    out = tmp_path / "plan.html"
    assert main(["plan", str(tiny_llama), "--max-memory", "cpu=1GiB", "--html", str(out)]) == 0
    s = PageSession(browser, 1280, 800, None)
    try:
        s.page.goto(out.as_uri())
        s.page.wait_for_selector("#plan-picture svg rect.layer")
        plan = json.loads(s.page.text_content("#boot") or "{}")["plan"]
        assert s.page.locator("#plan-picture rect.layer").count() == len(plan["placement"])
        assert s.page.is_visible("#offline-note") and not s.page.is_visible("#live")
        assert s.errors == [] and s.external == []
        assert [r.url for r in s.requests] == [out.as_uri()], "an offline copy makes no other request"
    finally:
        s.close()
