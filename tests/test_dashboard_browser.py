"""The dashboard in a real headless Chromium (Selenium + chromedriver) against a real
``mtplx serve`` with the default model and an API key: the page asks for the key (and says
when it is refused), shows a streamed completion sent through the API with its tok/s and MTP
acceptance, its Cancel button stops that request, and its settings form changes a default
(and says that a scheduler mode needs a restart).

Needs Debian's ``chromium`` and ``chromium-driver`` and the ``selenium`` package; without
them the test skips and says why. ``MTPLX_DASHBOARD_SCREENSHOTS=DIR`` saves the page under
load and idle as ``DIR/dashboard-load.png`` and ``DIR/dashboard-idle.png`` (docs/ holds them).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_process import COUNTING, MODEL

pytestmark = pytest.mark.slow

KEY = "browser-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WINDOW = (1280, 1480)


def chromium():
    """A headless Chromium driven by chromedriver, or a skip that says what is missing."""
    try:
        from selenium import webdriver
    except ImportError:
        pytest.skip("the browser test needs selenium: pip install -e '.[test]'")
    browser = next((shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome")
                    if shutil.which(name)), None)
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        pytest.skip("the browser test needs Chromium and chromedriver: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                f"--window-size={WINDOW[0]},{WINDOW[1]}", "--force-device-scale-factor=1"):
        options.add_argument(arg)
    try:
        return webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    except Exception as exc:  # a browser that cannot start here (sandbox, missing libraries)
        pytest.skip(f"Chromium did not start: {type(exc).__name__}: {str(exc).splitlines()[0]}")


class Completion(threading.Thread):
    """A streamed /v1/completions request through the API, in a thread."""

    def __init__(self, url: str, max_tokens: int, **extra):
        super().__init__(daemon=True)
        self.url = url
        self.body = {"model": MODEL, "prompt": COUNTING, "max_tokens": max_tokens, "temperature": 0,
                     "stream": True, "ignore_eos": True, **extra}
        self.id: str | None = None
        self.finish_reason: str | None = None
        self.started = threading.Event()
        self.start()

    def run(self) -> None:
        with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, headers=AUTH, timeout=180) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    self.id = chunk["id"]
                    self.started.set()
                    self.finish_reason = chunk["choices"][0]["finish_reason"] or self.finish_reason


def test_dashboard_in_chromium_shows_a_request_cancels_it_and_changes_a_default(serve):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    browser = chromium()
    shots = os.environ.get("MTPLX_DASHBOARD_SCREENSHOTS")
    server = serve("--api-key", KEY).wait_ready()
    try:
        wait = WebDriverWait(browser, 30, poll_frequency=0.1)
        text = lambda css: browser.find_element(By.CSS_SELECTOR, css).text  # noqa: E731

        browser.get(f"{server.url}/")  # redirects to /dashboard
        wait.until(lambda b: b.find_element(By.ID, "key-overlay").is_displayed())
        assert text("#key-reason") == "This server needs its API key."
        for key, reason in (("wrong-key", "The server refused that key."), (KEY, None)):
            browser.find_element(By.ID, "key-input").send_keys(key)
            browser.find_element(By.CSS_SELECTOR, "#key-form button").click()
            if reason:
                wait.until(lambda b: b.find_element(By.ID, "key-overlay").is_displayed()
                           and text("#key-reason") == reason)
        wait.until(lambda b: text("#status-text") == "live")
        assert text("#mode") == "serial" and MODEL in text("#model")
        assert KEY not in browser.current_url and KEY == browser.execute_script(
            "return sessionStorage.getItem('mtplx.apiKey')")

        first, second = Completion(server.url, 4000), None
        assert first.started.wait(60)
        second = Completion(server.url, 4000, generation_mode="ar")  # queued behind the first (serial)
        row = f'tr[data-request-id="{first.id}"]'

        def showing_load(b) -> bool:
            cells = b.find_elements(By.CSS_SELECTOR, f"{row}.running td")
            return (len(cells) == 9 and _number(cells[6].text) > 0 and _number(text("#tok-s")) > 0
                    and _number(text("#mean-acceptance-length")) >= 1 and "d1" in text("#acceptance-by-position")
                    and b.find_elements(By.CSS_SELECTOR, "tr.queued"))
        wait.until(showing_load)
        cells = browser.find_elements(By.CSS_SELECTOR, f"{row} td")
        assert cells[1].text == "running" and cells[2].text.startswith("mtp d")
        assert _number(cells[4].text) > 0 and _number(cells[5].text) > 0  # completion tokens, TTFT
        assert "%" in text("#acceptance-by-position")
        if shots:  # let the chart fill a little first
            time.sleep(15)
            browser.save_screenshot(str(Path(shots) / "dashboard-load.png"))

        browser.find_element(By.CSS_SELECTOR, f"{row} button.cancel").click()
        first.join(30)
        assert not first.is_alive() and first.finish_reason == "cancelled"
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, f"{row}.ended")
                   and b.find_element(By.CSS_SELECTOR, f"{row} td.state").text == "cancelled")
        assert second.started.wait(60)  # the queued one runs now (AR): cancel it from the page too
        wait.until(lambda b: b.find_elements(By.CSS_SELECTOR, f'tr.running[data-request-id="{second.id}"]'))
        browser.find_element(By.CSS_SELECTOR, f'tr[data-request-id="{second.id}"] button.cancel').click()
        second.join(30)
        assert second.finish_reason == "cancelled"

        # settings from the page: a scheduler mode needs a restart; a default temperature applies
        form = browser.find_element(By.ID, "settings")
        Select(form.find_element(By.NAME, "scheduler_mode")).select_by_visible_text("mtp_batch")
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda b: "restart with --scheduler-mode mtp_batch" in text("#settings-message"))
        Select(form.find_element(By.NAME, "scheduler_mode")).select_by_visible_text("serial")
        temperature = form.find_element(By.NAME, "temperature")
        temperature.clear()
        temperature.send_keys("0")
        form.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
        wait.until(lambda b: text("#settings-message") == "Applied to new requests.")
        assert httpx.get(f"{server.url}/v1/mtplx/settings", headers=AUTH).json()["live"]["temperature"] == 0

        if shots:  # a greedy MTP and AR request each, so the measured speed-up shows
            for mode in ("mtp", "ar"):
                done = Completion(server.url, 48, generation_mode=mode)
                done.join(60)
            wait.until(lambda b: _number(text("#speedup").rstrip("×")) > 0 and "greedy" in text("#speedup-sub"))
        wait.until(lambda b: text("#active") == "0 running" and _number(text("#tok-s")) == 0)
        if shots:
            browser.save_screenshot(str(Path(shots) / "dashboard-idle.png"))
    finally:
        if shots:
            browser.save_screenshot(str(Path(shots) / "dashboard-last.png"))
        browser.quit()
        server.kill()


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return -1.0
