"""The app in a real browser: Debian's Chromium driven by Playwright, on the tiny random model.

Playwright never downloads a browser here: it is pointed at /usr/bin/chromium (apt package `chromium`).
Without Chromium the tests skip, unless MOLORA_REQUIRE_BROWSER=1 (CI), where they fail.
Set MOLORA_SCREENSHOT=path to keep the screenshot of a finished generation (e.g. benchmarks/screenshots/app.png).
"""

from __future__ import annotations

import os
import re
import shutil
import time
import zipfile
from pathlib import Path

import pytest

from molora.app.server import serve
from molora.models import InterleavedPipeline
from molora.models.families.shapes.testing import write_tiny_adapter
from tests.app_process import free_port

try:
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
except ImportError:  # (no playwright: the browser fixture skips, or fails under MOLORA_REQUIRE_BROWSER)
    PlaywrightTimeout = TimeoutError

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-quic",
                 "--no-first-run", "--disable-component-update", "--disable-sync"]

MISSING = (f"{CHROMIUM} is missing: install Debian's chromium package (apt-get install chromium) to run the browser "
           "tests")


@pytest.fixture(scope="module")
def pipe(tiny_assets: Path) -> InterleavedPipeline:
    return InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")


@pytest.fixture(scope="module")
def url(pipe: InterleavedPipeline):
    port = free_port()
    demo = serve(pipe, host="127.0.0.1", port=port, block=False)
    yield f"http://127.0.0.1:{port}/"
    demo.close()


@pytest.fixture(scope="module")
def adapter_zip(tiny_assets: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("browser-upload")
    folder = write_tiny_adapter(tiny_assets / "model", root / "secret", modality="text", seed=11)
    archive = root / "secret.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            zf.write(folder / name, f"secret/{name}")
    return archive


def open_page(browser, url: str):
    context = browser.new_context(viewport={"width": 1280, "height": 1000})
    page = context.new_page()
    page.goto(url)
    page.locator("#generate").wait_for(timeout=60_000)
    return context, page


def run(page) -> None:
    """Start with an image (the tiny random model then surely draws one), press Generate, wait for the end."""
    page.locator("#start-image input").check()
    page.evaluate("""() => { window.__busy = false; clearInterval(window.__busyWatch);
        window.__busyWatch = setInterval(() => {
            if (!(document.querySelector('#stats')?.innerText || '').includes('done in')) window.__busy = true; }, 5);
    }""")
    page.locator("#generate").click()
    page.wait_for_function("window.__busy && document.querySelector('#stats')?.innerText.includes('done in')",
                           timeout=180_000)


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
    context, page = open_page(browser, url)
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
    choose_file(page, archive)
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


def choose_file(page, archive: Path, tries: int = 4) -> None:
    """Open the upload panel and choose `archive`, until the page lists it (the upload reached the server). On busy
    cores it took up to minutes, and once never came within 180 s: a choice made while the panel was still being
    drawn can be lost, so after 45 s it is made again (a file chosen again replaces its earlier copy)."""
    page.get_by_text("Upload your own adapter").click()
    for attempt in range(tries):
        page.locator("input[type=file]").set_input_files(str(archive))
        try:
            page.get_by_text(archive.name).first.wait_for(timeout=45_000)
            return
        except PlaywrightTimeout:
            if attempt == tries - 1:
                raise


def upload(page, archive: Path, name: str) -> None:
    choose_file(page, archive)
    page.get_by_label("Name").fill(name)
    page.get_by_role("button", name="Load adapter").click()
    page.get_by_text(f"Loaded {name}").wait_for(timeout=180_000)


def test_an_upload_leaves_no_trace_in_another_session_and_goes_when_its_tab_closes(browser, url, pipe, adapter_zip):
    owner_context, owner = open_page(browser, url)
    upload(owner, adapter_zip, "secret")
    owner.locator("#routing-map").scroll_into_view_if_needed()
    run(owner)  # the text picker now holds "secret": it takes a hot-set slot
    internal = next(name for name in pipe.adapters if name.startswith("secret@"))
    assert internal in pipe.cache_stats()["slots"]
    assert "secret" in owner.locator("#stats").inner_text()

    other_context, other = open_page(browser, url)
    run(other)
    page_text = other.locator("body").inner_text()
    assert "secret" not in page_text and "@" not in other.locator("#stats").inner_text()
    other.locator("#text-adapter input").click()
    assert not any("secret" in option for option in other.get_by_role("option").all_inner_texts())
    other_context.close()

    owner_context.close()  # the tab closes: Gradio's unload event ends the session now
    deadline = time.monotonic() + 180  # the server notices the closed tab when its heartbeat stream drops
    while internal in pipe.adapters and time.monotonic() < deadline:
        time.sleep(0.5)
    assert internal not in pipe.adapters and internal not in pipe.cache_stats()["slots"]


def legend_colors(page) -> dict[str, str]:
    """The routing map's legend: adapter label -> its colour as #rrggbb."""
    return page.evaluate("""() => {
        const out = {};
        for (const el of document.querySelectorAll("#routing-map [data-testid='highlighted-text:category-legend'] > *")) {
            const rgb = getComputedStyle(el).backgroundColor.match(/\\d+/g).slice(0, 3).map(Number);
            out[el.innerText.trim()] = "#" + rgb.map(v => v.toString(16).padStart(2, "0")).join("");
        }
        return out;
    }""")


def test_the_download_has_the_pages_colours_and_a_new_run_clears_it_at_once(page, tmp_path):
    run(page)
    colors = legend_colors(page)
    with page.expect_download() as download:
        page.locator("#html-file a").first.click()
    saved = tmp_path / "doc.html"
    download.value.save_as(saved)
    html = saved.read_text()
    assert f"border-color:{colors['image_style']}" in html  # the picture is framed in the image adapter's colour
    for label, color in colors.items():
        if f">{label}</span>" in html:  # the document's legend names the adapters it used
            assert f'background:{color}">{label}</span>' in html

    # a second run: the old download disappears as soon as it starts, not when it ends
    page.evaluate("""() => { window.__cleared = false;
        window.__watch = setInterval(() => { if (!document.querySelector('#html-file a')) window.__cleared = true; },
                                     10); }""")
    run(page)
    assert page.evaluate("window.__cleared")
    assert page.locator("#html-file a").count() >= 1  # and the new document is offered when it is done


def test_stop_shows_the_document_so_far_with_its_routing_map_and_download(page, pipe, monkeypatch, tmp_path):
    decode = pipe.engine._decode

    def slow_decode(*args, **kwargs):  # ~20 s for the whole budget: Stop surely lands mid-picture
        time.sleep(0.04)
        return decode(*args, **kwargs)

    monkeypatch.setattr(pipe.engine, "_decode", slow_decode)
    page.locator("#start-image input").check()
    page.locator("#generate").click()
    page.get_by_text("drawing image 1").wait_for(timeout=180_000)
    page.wait_for_timeout(1500)
    page.locator("#stop").click()
    page.wait_for_function("document.querySelector('#stats')?.innerText.includes('stopped after')", timeout=60_000)
    stats = page.locator("#stats").inner_text()
    assert "generating" not in stats and "was cut off" in stats and "when the generation was stopped" in stats
    assert page.locator("#document progress").count() == 0  # no progress bar frozen at "drawing image 1: 222/274"
    assert page.locator("#routing-map .token").count() > 10  # the tokens made before Stop, each with its adapter
    with page.expect_download() as download:
        page.locator("#html-file a").first.click()
    saved = tmp_path / "stopped.html"
    download.value.save_as(saved)
    assert "stopped after" in saved.read_text()
    assert not pipe.engine.stats()["running"] and not pipe.cache_stats()["pinned"]


def test_an_upload_whose_molora_json_says_image_loads_as_image_by_default(page, tiny_assets, tmp_path):
    folder = write_tiny_adapter(tiny_assets / "model", tmp_path / "pic", modality="image", seed=12)
    archive = tmp_path / "pic.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name in ("adapter_config.json", "adapter_model.safetensors", "molora.json"):
            zf.write(folder / name, f"pic/{name}")
    upload(page, archive, "pic")  # "Use for" left at its default
    assert "(image, as its molora.json says)" in page.locator("body").inner_text()
    assert page.locator("#image-adapter input").input_value() == "pic (uploaded)"
    assert "pic" not in page.locator("#text-adapter input").input_value()


def test_adding_a_file_again_after_a_refused_upload_lists_it_once(page, tmp_path):
    archive = tmp_path / "half.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("adapter_config.json", "{}")
    files = page.locator("#upload-files")
    page.get_by_text("Upload your own adapter").click()
    files.locator("input[type=file]").first.set_input_files(str(archive))
    page.wait_for_function("document.querySelector('#upload-files').innerText.includes('138')", timeout=180_000)
    page.wait_for_timeout(1000)
    page.get_by_role("button", name="Load adapter").click()
    page.get_by_test_id("toast-text").filter(has_text="adapter upload refused").wait_for(timeout=60_000)
    files.locator("input[type=file]").first.set_input_files(str(archive))  # the visitor adds it again
    page.wait_for_timeout(3000)
    listed = files.inner_text()
    assert listed.count("half") == 1, listed


def slow_engine(pipe, monkeypatch, seconds: float) -> None:
    decode = pipe.engine._decode

    def slow_decode(*args, **kwargs):
        time.sleep(seconds)
        return decode(*args, **kwargs)

    monkeypatch.setattr(pipe.engine, "_decode", slow_decode)


def test_the_routing_map_grows_while_a_picture_is_drawn(page, pipe, monkeypatch):
    slow_engine(pipe, monkeypatch, 0.02)  # ~6 s a picture: several refreshes while it is drawn
    page.locator("#start-image input").check()
    page.locator("#generate").click()
    page.wait_for_function("document.querySelector('#document progress') && "
                           "document.querySelectorAll('#routing-map .token').length >= 17", timeout=120_000)
    page.wait_for_function("document.querySelector('#stats')?.innerText.includes('done in')", timeout=180_000)


def test_learned_routing_has_one_legend_chip_per_adapter_and_weights_on_hover(browser, tiny_assets, tmp_path):
    from molora.routing import LearnedGates

    learned = InterleavedPipeline.from_pretrained(tiny_assets / "model", device="cpu")
    LearnedGates.for_model(learned.routed, ["text_style", "image_style"]).save(tmp_path / "gates.safetensors")
    learned.load_learned_router(tmp_path / "gates.safetensors")
    port = free_port()
    demo = serve(learned, host="127.0.0.1", port=port, block=False)
    try:
        context, page = open_page(browser, f"http://127.0.0.1:{port}/")
        page.get_by_label("learned router (top-k gate over domain adapters)").check()
        page.locator("#generate").click()
        page.wait_for_function("document.querySelector('#stats')?.innerText.includes('done in')", timeout=180_000)
        chips = set(legend_colors(page))
        assert chips and chips <= {"text_style", "image_style", "base (no adapter)"}, chips
        page.wait_for_function("document.querySelector('#routing-map .token-container[title*=\" · \"]')",
                               timeout=10_000)
        tip = page.locator("#routing-map .token-container[title*=' · ']").first.get_attribute("title")
        assert re.fullmatch(r"(text_style|image_style) \.\d\d · (text_style|image_style) \.\d\d", tip), tip
        context.close()
    finally:
        demo.close()


def test_a_shipped_picture_example_sets_every_control_and_draws_the_picture_alone(browser):
    """The shipped model's learned picture example, clicked in the page: routing, start image and the picture's
    budget are set by the click (and the next example click sets them back), and the page shows one picture and
    no text fragment after it."""
    from molora.app.ui import EXAMPLES, LEARNED_PICTURE_EXAMPLES

    shipped = InterleavedPipeline.from_pretrained(device="cpu")
    port = free_port()
    demo = serve(shipped, host="127.0.0.1", port=port, block=False)
    try:
        context, page = open_page(browser, f"http://127.0.0.1:{port}/")
        page.get_by_text("Sampling", exact=True).click()  # open the accordion that holds the budget
        prompt = LEARNED_PICTURE_EXAMPLES[1][0]
        page.get_by_text(prompt, exact=True).first.click()
        page.wait_for_function(f"document.querySelector('#prompt textarea').value === {prompt!r}", timeout=30_000)
        budget = shipped.vocab.tokens_per_image + 1
        assert page.get_by_label("learned router (top-k gate over domain adapters)").is_checked()
        assert page.locator("#start-image input").is_checked()
        assert page.locator("#max-new-tokens input[type=number]").input_value() == str(budget)
        page.locator("#generate").click()
        page.wait_for_function("document.querySelector('#stats')?.innerText.includes('done in')", timeout=180_000)
        assert page.locator("#document img.molora-image").count() == 1
        assert page.locator("#document .molora-text").count() == 0  # no "Then a small." after the picture
        page.get_by_text(EXAMPLES[0][0], exact=True).first.click()  # the next example resets what this one set
        page.wait_for_function("!document.querySelector('#start-image input').checked", timeout=30_000)
        assert page.get_by_label("vocabulary: text tokens -> text adapter, image tokens -> image adapter").is_checked()
        context.close()
    finally:
        demo.close()
