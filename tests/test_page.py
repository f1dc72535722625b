"""The chat page of `medusa serve` in a real browser (issue 73): Debian's Chromium, headless, driven by Playwright,
against `medusa serve` on the embedded default. The page's answer is `medusa generate`'s greedy answer, drawn pass by
pass with at least one pass of several tokens; the race view ends with the same text in both panes.
MEDUSA_SCREENSHOTS=DIR also saves the page after each (docs/chat_page.png, docs/race_page.png)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from serve_process import medusa_serve

PROMPT = "List the days of the week, one a line."
MAX_TOKENS = 48
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"  # Debian's package `chromium`
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]  # nothing reaches for the network


@pytest.fixture(scope="module")
def page():
    from playwright.sync_api import sync_playwright

    with medusa_serve() as (url, _), sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=FLAGS)
        page = browser.new_page(viewport={"width": 1100, "height": 800})
        page.goto(url)
        page.wait_for_function("document.getElementById('model').textContent.includes('SmolLM2')")
        yield page
        browser.close()


@pytest.fixture(scope="module")
def expected() -> str:
    """`medusa generate`'s greedy answer, from the command line, as the server runs (one torch thread)."""
    run = subprocess.run([sys.executable, "-m", "medusa_decoding.cli", "generate", "--prompt", PROMPT,
                          "--max-new-tokens", str(MAX_TOKENS), "--json"], capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600, check=True)
    return json.loads(run.stdout)["text"]


def screenshot(page, name: str) -> None:
    if directory := os.environ.get("MEDUSA_SCREENSHOTS"):
        page.screenshot(path=str(Path(directory) / name), full_page=True)


def test_the_chat_answers_as_medusa_generate_and_shows_each_forward_pass(page, expected):
    page.fill("#max-tokens", str(MAX_TOKENS))
    page.fill("#prompt", PROMPT)
    page.click("#send")
    answer = page.locator(".message.assistant").last
    page.wait_for_selector(".message.assistant[data-state=done]", timeout=120_000)
    assert answer.text_content() == expected
    passes = answer.locator(".pass")
    assert answer.locator(".pass.multi").count() >= 1  # one forward pass gave several tokens
    steps = [int(step) for step in passes.evaluate_all("spans => spans.map(s => s.dataset.step)")]
    assert steps[0] == 1 and steps == sorted(steps)
    assert int(page.inner_text("#passes")) == steps[-1] and float(page.inner_text("#tpp")) > 1
    screenshot(page, "chat_page.png")


def test_the_race_ends_with_the_same_text_in_both_panes(page, expected):
    page.click("#tab-race")
    page.fill("#race-prompt", PROMPT)
    page.fill("#race-max-tokens", str(MAX_TOKENS))
    page.click("#race-start")
    page.wait_for_selector("#pane-plain[data-state=done]", timeout=240_000)
    medusa, plain = (page.locator(f"#pane-{name} .text").text_content() for name in ("medusa", "plain"))
    assert medusa == plain == expected
    assert "the same text" in page.inner_text("#verdict")
    screenshot(page, "race_page.png")


def test_an_error_shows_as_a_message_not_a_hang(page):
    page.click("#tab-chat")
    page.fill("#prompt", "word " * 9000)  # past the model's context: the server answers 400
    page.click("#send")
    page.wait_for_selector("#error:not([hidden])", timeout=60_000)
    assert "context" in page.inner_text("#error")
    assert page.is_enabled("#send")  # ready for the next question
