"""The app in a real browser: Debian's Chromium driven by Playwright, on the tiny random model.

Playwright never downloads a browser here: it is pointed at /usr/bin/chromium (apt package `chromium`).
Without Chromium the tests skip, unless MOLORA_REQUIRE_BROWSER=1 (CI), where they fail.
Set MOLORA_SCREENSHOT=path to keep the screenshot of a finished generation (e.g. benchmarks/screenshots/app.png).
"""

from __future__ import annotations

import os
import shutil
import socket
import zipfile
from pathlib import Path

import pytest

from app.server import serve
from models import InterleavedPipeline

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
                 "--no-first-run", "--disable-component-update", "--disable-sync"]

MISSING = (f"{CHROMIUM} is missing: install Debian's chromium package (apt-get install chromium) to run the browser "
           "tests")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def url(tiny_assets: Path):
    pipe = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    port = free_port()
    demo = serve(pipe, host="127.0.0.1", port=port, block=False)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        if os.environ.get("MOLORA_REQUIRE_BROWSER") == "1":  # CI installs it, so there a missing browser is a failure
            pytest.fail(MISSING)
        pytest.skip(MISSING)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser, url):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.goto(url)
    page.locator("#generate").wait_for(timeout=60_000)
    yield page
    context.close()


def test_generate_streams_an_image_and_a_routing_map_into_the_page(page, tmp_path):
    page.locator("#prompt textarea").fill("Draw a red circle at the top left.")
    page.locator("#start-image input").check()
    page.locator("#generate").click()

    image = page.locator("#document img.molora-image").first
    image.wait_for(timeout=180_000)
    page.wait_for_function("document.querySelector('#stats')?.innerText.includes('done in')", timeout=180_000)
    assert image.evaluate("img => img.complete && img.naturalWidth") == 64
    tokens = page.locator("#routing-map .token")
    assert tokens.count() >= 273  # 256 image codes, 16 row markers, <eoi> (+ whatever text followed)
    legend = page.locator("#routing-map [data-testid='highlighted-text:category-legend']").inner_text()
    assert "image_style" in legend and "text_style" in legend
    assert "Hot-set cache" in page.locator("#stats").inner_text()

    shot = tmp_path / "app.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if keep := os.environ.get("MOLORA_SCREENSHOT"):
        Path(keep).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(shot, keep)


def test_a_bad_adapter_upload_shows_an_error_in_the_page(page, tmp_path):
    archive = tmp_path / "evil.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("../adapter_config.json", "{}")
        zf.writestr("adapter_model.safetensors", "x")
    page.get_by_text("Upload your own adapter").click()
    page.locator("input[type=file]").set_input_files(str(archive))
    page.get_by_text("evil.zip").first.wait_for(timeout=60_000)  # the upload reached the server
    page.get_by_role("button", name="Load adapter").click()
    toast = page.get_by_test_id("toast-text").filter(has_text="path traversal")
    toast.wait_for(timeout=60_000)
    assert "adapter upload refused" in toast.inner_text()
    page.wait_for_timeout(500)  # let the toast finish sliding in before the screenshot
    page.screenshot(path=str(tmp_path / "upload-error.png"))
    if keep := os.environ.get("MOLORA_SCREENSHOT"):
        shutil.copyfile(tmp_path / "upload-error.png", Path(keep).with_name("upload-error.png"))
    page.locator("#text-adapter input").click()  # the picker still offers only what it offered before
    options = page.get_by_role("option").all_inner_texts()
    assert options and not any("evil" in option or "uploaded" in option for option in options)
