"""The live dashboard in headless Chromium (Debian's /usr/bin/chromium, see scripts/install_chromium.sh)."""
import re
import threading

import httpx
import pytest
import transformers
from playwright.sync_api import sync_playwright

from conftest import VOCAB, save_random_model, save_tokenizer
from server_utils import API_KEY, HEADERS, MODEL, serve, server, wait_all_blocks_free  # noqa: F401  (fixture)

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run"]
TOP_K = 2


@pytest.fixture(scope="module")
def browser():
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-moe-text")
    tokenizer = save_tokenizer(path)
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                                      intermediate_size=128, moe_intermediate_size=48, num_experts=8,
                                      num_experts_per_tok=TOP_K, norm_topk_prob=True, decoder_sparse_step=1,
                                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
                                      pad_token_id=0)
    save_random_model(cfg, path, seed=2)
    with serve(str(path), num_kv_blocks=256) as running:
        yield running


class BackgroundStreams:
    """Long streaming requests that keep KV blocks busy until stop(); n > 1 ones share prompt blocks."""

    def __init__(self, url: str, count: int):
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self._stream, args=(url, i), daemon=True) for i in range(count)]
        for thread in self.threads:
            thread.start()

    def _stream(self, url: str, index: int):
        body = {"model": MODEL, "prompt": "ROMEO: But soft, what light " * (1 + index % 3), "max_tokens": 440,
                "ignore_eos": True, "stream": True, "n": 1 + index % 2, "temperature": 1.0}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=HEADERS, timeout=60) as response:
            for _ in response.iter_lines():
                if self.stopping.is_set():
                    break

    def stop(self):
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)


def _count(page, element_id: str) -> int:
    return int(page.inner_text(f"#{element_id}"))


def test_dashboard_shows_the_live_block_map(server, browser, tmp_path):
    streams = BackgroundStreams(server.url, 8)
    try:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{server.url}/dashboard?api_key={API_KEY}")
        page.wait_for_function("Number(document.getElementById('blocks').dataset.painted) > 40"
                               " && Number(document.getElementById('n-shared').textContent) > 0"
                               " && document.getElementById('tps').textContent !== '–'"
                               " && Number(document.getElementById('n-used').textContent) > 0"
                               " && Number(document.getElementById('running').textContent) > 0", timeout=20000)
        assert sum(_count(page, f"n-{state}") for state in ("free", "used", "shared", "cached")) == 512
        assert re.fullmatch(r"\d+\.\d", page.inner_text("#tps"))
        assert page.is_visible("#experts-empty") and not page.is_visible("#experts")
        path = tmp_path / "dashboard.png"
        page.screenshot(path=str(path), full_page=True)
        print(f"\ndashboard screenshot: {path}")
    finally:
        streams.stop()
    wait_all_blocks_free(server)
    page.wait_for_function("Number(document.getElementById('n-used').textContent) === 0", timeout=10000)
    for latency in ("ttft", "itl"):
        assert re.fullmatch(r"[\d.]+ / [\d.]+", page.inner_text(f"#{latency}"))


def test_moe_server_exports_expert_load_and_draws_the_heatmap(moe_server, browser, tmp_path):
    client = moe_server.openai()
    for prompt in ("ROMEO: But soft", "JULIET: O Romeo, Romeo, wherefore art thou Romeo?"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=8)
    metrics = httpx.get(f"{moe_server.url}/metrics", headers=HEADERS).text
    routed = [(int(dict(re.findall(r'(\w+)="([^"]*)"', labels))["layer"]), float(value))
              for labels, value in re.findall(r"^pagedmoe:expert_tokens_total\{(.*)\} (\S+)$", metrics, re.M)]
    assert len(routed) == 3 * 8
    for layer in range(3):
        total = sum(value for l, value in routed if l == layer)
        assert total > 0 and total % TOP_K == 0, "every token goes to exactly top_k experts"
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.goto(f"{moe_server.url}/dashboard?api_key={API_KEY}")
    page.wait_for_selector("#experts", state="visible", timeout=10000)
    assert not page.is_visible("#experts-empty")
    painted = page.evaluate("""() => { const c = document.getElementById('experts');
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }""")
    assert painted > 1000
    path = tmp_path / "dashboard-moe.png"
    page.screenshot(path=str(path), full_page=True)
    print(f"\nMoE dashboard screenshot: {path}")


def test_dashboard_shows_the_acceptance_length_with_speculation(text_model, browser):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}'
    with serve(text_model[0], num_kv_blocks=256, speculative_config=spec) as running:
        streams = BackgroundStreams(running.url, 4)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 900})
            page.goto(f"{running.url}/dashboard?api_key={API_KEY}")
            page.wait_for_function("document.getElementById('spec').textContent !== '–'", timeout=20000)
            assert 1.0 <= float(page.inner_text("#spec")) <= 4.0
            assert re.fullmatch(r"\d+ of \d+ draft tokens accepted", page.inner_text("#spec-tokens"))
            stats = httpx.get(f"{running.url}/dashboard/stats", headers=HEADERS).json()["spec_decode"]
            assert stats["draft_tokens"] >= stats["accepted_tokens"] and stats["drafts"] > 0
        finally:
            streams.stop()
        wait_all_blocks_free(running)
