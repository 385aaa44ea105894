"""The live page (`GET /` from a browser) in a real headless Chromium: it loads from the server alone (no
other host), draws its charts, and after requests shows the figures the server's /metrics says; API clients
still get the JSON at `/`; behind the API key as /metrics is."""

import pytest

from browser import Browser, chromium
from serving import MODEL, client, raw, running
from test_serve_metrics import scrape

BROWSER = chromium()
needs_browser = pytest.mark.skipif(BROWSER is None, reason="no Chromium here (Debian: apt-get install chromium)")


@pytest.fixture(scope="module")
def pair(tiny_chat_pair):
    target, tokenizer, drafter = tiny_chat_pair
    return target, drafter, tokenizer


def test_root_answers_a_browser_the_page_and_a_client_the_json(pair):
    with running(pair, api_keys=("k",)) as (url, _):
        assert raw(url, "/", headers={"Accept": "text/html"}, parse=False)[0] == 401
        key = {"Authorization": "Bearer k"}
        status, headers, page = raw(url, "/", headers={**key, "Accept": "text/html,application/xhtml+xml"},
                                    parse=False)
        assert status == 200 and headers["content-type"].startswith("text/html")
        assert b'fetch("/metrics"' in page and b"http" not in page.split(b"<script>")[1]  # nothing from elsewhere
        status, _, about = raw(url, "/", headers=key)
        assert status == 200 and about["model"] == MODEL and "/metrics" in about["endpoints"]
        assert isinstance(about["mode"], list) and about["max_batch"] >= 1 and about["drafter"] == "a DFlash drafter"


@pytest.mark.slow  # a real headless Chromium (seconds)
@needs_browser
def test_the_page_draws_the_servers_figures_in_chromium(pair):
    with running(pair) as (url, _):
        browser = Browser(BROWSER)
        try:
            browser.open(url + "/")
            browser.wait_for("Number(document.getElementById('load').dataset.points) >= 2")  # polled twice
            assert browser.evaluate("document.getElementById('generated').textContent") == "0"
            c = client(url)
            for question in ("What is the sea?", "Name a colour.", "Count to five."):
                c.chat.completions.create(model=MODEL, max_tokens=12, messages=[{"role": "user", "content": question}])
            shown = browser.wait_for(  # the figures of the first poll after the requests
                "document.getElementById('requests').textContent === '3' && {"
                "generated: document.getElementById('generated').textContent,"
                "tau: document.getElementById('tau').textContent}")
            drawn = browser.wait_for("series.speed.some(p => p.values[0] > 0)")  # the requests' speed, drawn
            title = browser.evaluate("document.getElementById('model').textContent")
            drafter = browser.evaluate("document.getElementById('drafter').textContent")
        finally:
            browser.close()
        server = scrape(url)
    generated = server[("mlx_dflash_generated_tokens_total", ())]
    rounds = server[("mlx_dflash_tokens_per_round_count", ())]
    assert shown["generated"] == str(int(generated)) and generated > 0 and drawn
    assert title == f"mlx-dflash serve: {MODEL}" and drafter == "drafter: a DFlash drafter"
    assert shown["tau"] == f"{server[('mlx_dflash_tokens_per_round_sum', ())] / rounds:.2f}"
