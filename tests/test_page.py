"""The chat page at ``/`` (server/page.py) in headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
which tools/install.sh installs), driven by selenium against a real server in process: the page loads and names
the model, a message gets a streamed reply and a stats line, Stop ends a long reply (the server stops generating:
the next message is answered at once), and a document attached from a file opens the first message."""

from __future__ import annotations

import shutil
import time

import pytest
from test_server_requests import _serving

import ktquest
from ktquest.server.app import create_app
from ktquest.server.guard import GuardConfig
from ktquest.server.worker import Worker

LONG = 6000  # the server's reply limit: a reply the test stops long before it ends


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.fail("the page's test needs Debian's chromium and chromium-driver: tools/install.sh installs them "
                    "(apt-get install chromium chromium-driver)")
    opts = webdriver.ChromeOptions()
    opts.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        opts.add_argument(flag)
    b = webdriver.Chrome(options=opts, service=Service(driver))
    yield b
    b.quit()


@pytest.fixture(scope="module")
def page(bundled_gguf):
    # SmolLM2 writes a story of several hundred tokens (a random tiny model soon samples its end of turn)
    engine = ktquest.load(bundled_gguf, max_seq_len=8192, threads=2, max_new_tokens=LONG, seed=1)
    # (the page's requests carry its origin, http://127.0.0.1:PORT: the guard allows the server's own)
    with _serving(make=lambda port: create_app(Worker(engine), "tiny-page", guard=GuardConfig(port=port))) as post:
        yield f"http://127.0.0.1:{post.port}/", post


def _wait(cond, timeout: float = 60, what: str = ""):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _send(b, text: str) -> None:
    from selenium.webdriver.common.by import By

    b.find_element(By.ID, "input").send_keys(text)
    b.find_element(By.ID, "send").click()


def _texts(b, cls: str) -> list[str]:
    from selenium.webdriver.common.by import By

    return [e.text for e in b.find_elements(By.CSS_SELECTOR, f"#log .{cls}")]


def test_page_streams_stops_and_takes_a_document(browser, page, tmp_path):
    from selenium.webdriver.common.by import By

    url, post = page
    b = browser
    b.get(url)
    _wait(lambda: b.find_element(By.ID, "model").text == "tiny-page", 20, "the model's name")

    # a message: its reply streams (it grows while the stop button is live), then Stop ends it
    _send(b, "Write a long story about a dragon who learns to bake bread.")
    _wait(lambda: len(_texts(b, "assistant")) == 1 and len(_texts(b, "assistant")[0]) > 20, 60, "reply text")
    early = len(_texts(b, "assistant")[0])
    _wait(lambda: len(_texts(b, "assistant")[0]) > early, 30, "the reply to grow (streamed)")
    assert b.find_element(By.ID, "stop").is_enabled() and not b.find_element(By.ID, "send").is_enabled()
    b.find_element(By.ID, "stop").click()
    stats = _wait(lambda: _texts(b, "stats"), 30, "the stats line")
    assert "stopped" in stats[0] and b.find_element(By.ID, "send").is_enabled()
    stopped_at = len(_texts(b, "assistant")[0])
    time.sleep(0.5)
    assert len(_texts(b, "assistant")[0]) == stopped_at  # nothing arrives after Stop
    _wait(lambda: post("/health")[1]["running_or_waiting"] == 0, 10, "the server to stop generating")
    h = post("/health")[1]
    assert h["cancelled"] == 1 and h["completion_tokens"] < LONG  # the server saw the page leave, and stopped

    # a document from a file: it opens the next conversation's first message
    b.find_element(By.ID, "reset").click()
    doc = tmp_path / "notes.txt"
    doc.write_text("The cat sat on the mat. " * 40)
    b.execute_script("document.getElementById('file').hidden = false;")
    b.find_element(By.ID, "file").send_keys(str(doc))
    _wait(lambda: "notes.txt" in b.find_element(By.ID, "docname").text, 10, "the document's name")
    assert b.find_element(By.ID, "doctext").get_attribute("value").startswith("The cat sat")
    _send(b, "summarize")
    _wait(lambda: len(_texts(b, "assistant")) == 1 and _texts(b, "assistant")[0], 60, "the reply")
    b.find_element(By.ID, "stop").click()
    _wait(lambda: _texts(b, "stats"), 30, "the stats line")
    _wait(lambda: post("/health")[1]["cancelled"] == 2, 10, "the second reply to stop")
    # the document's 240 words went in with the message
    assert post("/health")[1]["prompt_tokens"] - h["prompt_tokens"] > 240
