"""The Gradio demo, served by `specla demo` on 127.0.0.1: its API through gradio_client, its page in Chromium."""
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tiny_checkpoints import greedy_text, save_tiny_checkpoints

# a system Chromium (Debian's chromium package, as CI installs it); without one, Playwright's own browser if
# `playwright install chromium` has downloaded it
SYSTEM_CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# without the background-networking flags Chromium keeps trying to reach Google's services, which on a machine
# without network floods it with failing connection attempts
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return save_tiny_checkpoints(tmp_path_factory.mktemp("ckpts"))


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("demo") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "specla_hf.app.cli", "demo", "--target", str(ckpts["target"]),
                                 "--drafter", str(ckpts["drafter"]), "--host", "127.0.0.1", "--port", str(port),
                                 "--max-new-tokens", "24", "--tree", "--confidence-threshold", "0"],
                                stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "0"})
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"the demo exited with {proc.returncode}:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"the demo did not come up:\n{log.read_text()}"
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_api_specla_text_is_plain_greedy_text(server, ckpts):
    from gradio_client import Client

    client = Client(server, verbose=False)
    expected = greedy_text(ckpts["target"], "def add(x, y):", 40)
    for tree in (True, False):
        out = client.predict("def add(x, y):", 40, 0.0, tree, 12, 0.0, api_name="/generate")
        assert out["specla"] == out["plain"] == expected and out["identical"] is True, tree
        assert out["tau"] >= 1.0 and out["plain_tokens_per_second"] > 0 and out["specla_tokens_per_second"] > 0
        assert out["speedup"] == pytest.approx(out["specla_tokens_per_second"] / out["plain_tokens_per_second"])
        assert out["mode"] in ("speculative", "autoregressive") and out["mode_reason"]      # the fallback is on


def test_api_rejects_a_tree_budget_one_verify_pass_cannot_take(server):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="tree budget must be between 1 and 127"):
        Client(server, verbose=False).predict("x", 8, 0.0, True, 1000, 0.0, api_name="/generate")


def test_api_rejects_an_empty_prompt(server):
    from gradio_client import Client
    from gradio_client.exceptions import AppError

    with pytest.raises(AppError, match="Enter a prompt"):
        Client(server, verbose=False).predict("   ", api_name="/generate")


def test_browser_fills_both_panes(server, ckpts, tmp_path):
    from playwright.sync_api import expect, sync_playwright

    prompt, n = "The quick brown fox", 24
    expected = greedy_text(ckpts["target"], prompt, n)
    with sync_playwright() as p:
        if SYSTEM_CHROMIUM is None and not Path(p.chromium.executable_path).exists():
            pytest.skip("no Chromium: apt-get install -y chromium (Debian, Ubuntu), or playwright install chromium")
        browser = p.chromium.launch(executable_path=SYSTEM_CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1300})
            page.goto(server)
            page.locator("#prompt textarea").fill(prompt)
            page.locator("#run").click()
            expect(page.locator("#summary")).to_contain_text("identical to plain greedy decoding", timeout=120_000)
            # the summary says which decoder was faster, and its ratio is that of the tokens/s under the panes
            summary = page.locator("#summary").inner_text()
            speedup = float(re.search(r"ran at ([\d.]+)× the tokens/s of plain decoding", summary).group(1))
            verdict = ("slower than" if speedup < 1 else "level with" if speedup == 1 else "faster than") + " plain decoding"
            assert f"{verdict} on this cpu" in summary, summary
            specla_tps, plain_tps = (float(re.search(r"([\d.]+) tokens/s", page.locator(pane).inner_text()).group(1))
                                     for pane in ("#specla-stats", "#plain-stats"))
            assert speedup == pytest.approx(specla_tps / plain_tps, rel=0.05, abs=0.01)
            assert page.locator("#plain-output .specla-text").inner_text() == expected
            # the SpecLA pane: the same text, in spans coloured by how each token came (the drafter agrees often)
            specla = page.locator("#specla-output .specla-text")
            assert specla.inner_text() == expected
            assert specla.locator("span.draft").count() > 0 and specla.locator("span.bonus").count() > 0
            expect(page.locator("#specla-stats")).to_contain_text(f"{n} tokens")
            expect(page.locator("#steps-plot img")).to_be_visible()
            expect(page.locator("#tree-plot img")).to_be_visible()
            page.screenshot(path=tmp_path / "demo.png", full_page=True)
        finally:
            browser.close()
    assert (tmp_path / "demo.png").stat().st_size > 20_000


# ---------------------------------------------------------------------------------------------------------------
# in process: how the panes and the tree drawing read a run
# ---------------------------------------------------------------------------------------------------------------
def test_accepted_path_and_bonus_from_the_emitted_tokens():
    from specla_hf.app.demo import accepted_path, tree_figure
    from specla_hf.drafters.base import DraftTree
    from tiny_checkpoints import char_tokenizer

    #            0:root  1:a  2:b  3:c (child of a)  4:d (child of c)
    tree = DraftTree(torch.tensor([9, 10, 11, 12, 13]), torch.tensor([-1, 0, 0, 1, 3]), torch.zeros(5))
    assert accepted_path(tree, [10, 12, 50]) == ([0, 1, 3], 50)        # a, c accepted; the target said 50, not d
    assert accepted_path(tree, [11, 10]) == ([0, 2], 10)               # b accepted; 10 under b is the bonus
    assert accepted_path(tree, [77]) == ([0], 77)                      # nothing accepted
    assert accepted_path(tree, [10, 12]) == ([0, 1, 3], None)          # stopped (EOS / length) inside the drafts
    fig = tree_figure(tree, [10, 12, 50], char_tokenizer())
    assert "4 draft nodes, 2 accepted, then the target's token" in fig.axes[0].get_title()


def test_segments_colour_drafts_and_the_targets_token():
    from specla_hf.loop.stats import SpecLAStats
    from specla_hf.app.demo import BONUS, DRAFT, _segments
    from specla_hf.app.runs import Run
    from tiny_checkpoints import char_tokenizer

    tok = char_tokenizer()
    ids = lambda text: tok(text).input_ids  # noqa: E731
    chunks = [ids("ab!"), ids("c"), ids("de")]
    assert _segments(tok, chunks, None) == [("ab", DRAFT), ("!", BONUS), ("c", BONUS), ("d", DRAFT), ("e", BONUS)]
    # finished run whose last step accepted 3 drafts but stopped after 2 tokens: no bonus token in that chunk
    run = Run(ids("ab!cde"), 1.0, SpecLAStats(steps=3, accepted=[2, 0, 3]))
    assert _segments(tok, chunks, run)[-1] == ("de", DRAFT)


def test_a_run_that_started_autoregressive_draws_no_tree():
    """After calls whose speculation lost, a call may decode autoregressively from its first step (the fallback's
    back-off): it verified no tree, and the SpecLA line says it never speculated."""
    from specla_hf.app.demo import _last_tree_figure, _specla_line
    from specla_hf.app.runs import DecodeSettings, Run
    from specla_hf.loop.stats import SpecLAStats

    stats = SpecLAStats(steps=3, new_tokens=3, draft_nodes=[0, 0, 0], accepted=[0, 0, 0], mode="autoregressive")
    run, chunks = Run([5, 6, 7], 0.1, stats), [[5], [6], [7]]
    assert _last_tree_figure(run, chunks, tokenizer=None) is None
    assert _specla_line(chunks, 0.1, run, DecodeSettings()).endswith(" · autoregressive from the start")


def test_page_draws_nothing_else_while_a_decoder_is_timed(ckpts, monkeypatch):
    """The streamed page times both decoders with the same ``compare`` as the API and the CLI, and while one runs it
    refreshes only that one's pane: no plot (matplotlib) and no other pane is sent during the timed runs, so that
    neither decoder pays for UI work the other does not. The final update shows compare's numbers."""
    import gradio as gr

    from specla_hf.app import demo
    from specla_hf.app.loading import load_models
    from specla_hf.app.runs import DecodeSettings, compare

    results = []

    def recording_compare(*args, **kwargs):
        results.append(compare(*args, **kwargs))
        return results[-1]

    monkeypatch.setattr(demo, "compare", recording_compare)
    monkeypatch.setattr(demo, "UPDATE_EVERY_S", 0.005)          # many refreshes during each run
    models = load_models(str(ckpts["target"]), str(ckpts["drafter"]))
    app = demo.build_app(models, DecodeSettings(tree=True, confidence_threshold=0.0))
    stream = next(f.fn for f in app.fns.values() if f.name == "stream")
    updates = list(stream("The quick brown fox", 96, 0.0, "tree", 16, 0.0, True))

    skip = gr.skip()
    *running, final = updates[1:]                               # updates[0] clears the page
    plain_updates = [u for u in running if u[0] != skip]
    specla_updates = [u for u in running if u[2] != skip]
    assert plain_updates and specla_updates                     # both panes streamed
    for update in running:
        assert update[4:] == (skip, skip, skip), "summary or plots sent while a decoder was being timed"
        assert (update[0] == skip) != (update[2] == skip), "both panes sent in one refresh"
    assert updates.index(plain_updates[0]) > updates.index(specla_updates[-1])      # SpecLA first, then plain
    (result,) = results
    assert f"ran at {result.speedup:.2f}× the tokens/s of plain decoding" in final[4]
    stats = result.specla.stats
    assert f"SpecLA's mode: **{stats.mode}** ({stats.mode_reason})" in final[4]      # the fallback's verdict
    assert all(hasattr(plot, "savefig") for plot in final[5:])  # the two matplotlib figures, at the end only
