"""The SpecLA Gradio demo: SpecLA and plain decoding stream the same prompt side by side, speculation made visible.

The SpecLA pane colours each token by how it came, from the streamer alone: SpecLA's loop hands it one chunk per
verify step (the drafts the target accepted, then the target's own bonus token), plain decoding one token per step.
Below are the tokens emitted per verify step and the last draft tree the target verified, with the accepted path.

Both decoders are timed by ``specla_hf.app.runs.compare``, as in the CLI and the API: the same warm-up, SpecLA then
plain decoding, never both at once. While one runs, the page refreshes only that one's pane, a few times a second;
the plots are drawn after both have finished (drawn during plain decoding, they slowed it several-fold).

API: ``gradio_client.Client(url).predict(prompt, max_new_tokens, temperature, tree, tree_budget,
confidence_threshold, fallback, api_name="/generate")`` returns both texts and the numbers, without streaming.
"""
from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable, Iterator

import gradio as gr
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from transformers.generation.streamers import BaseStreamer

from specla_hf.app.loading import Models
from specla_hf.app.prompts import SHIPPED
from specla_hf.app.runs import Comparison, DecodeSettings, Run, compare, encode
from specla_hf.drafters.base import DraftTree
from specla_hf.drafters.options import MAX_TREE_BUDGET, TREE_DEFAULTS, default_threshold

DRAFT, BONUS = "draft", "bonus"
COLORS = {DRAFT: "#a5dea8", BONUS: "#f9c98f"}
UPDATE_EVERY_S = 0.2            # streamed UI refreshes at most this often
CSS = f"""
.specla-text {{font-family: ui-monospace, SFMono-Regular, Menlo, monospace; font-size: 13px; line-height: 1.45;
  white-space: pre-wrap; tab-size: 4; min-height: 16em; max-height: 40em; overflow-y: auto; padding: 8px 10px;
  border: 1px solid var(--border-color-primary); border-radius: 6px}}
.{DRAFT} {{background: {COLORS[DRAFT]}; color: #111}}
.{BONUS} {{background: {COLORS[BONUS]}; color: #111}}
.legend span {{padding: 1px 6px; border-radius: 3px; font-size: 12px}}
"""
LEGEND = (f'<b>SpecLA</b> <span class="legend"><span class="{DRAFT}">draft accepted by the target</span> '
          f'<span class="{BONUS}">the target\'s own token (one per step)</span></span>')


def build_app(models: Models, settings: DecodeSettings) -> gr.Blocks:
    budget = settings.tree_budget or TREE_DEFAULTS.budget
    threshold = settings.confidence_threshold if settings.confidence_threshold is not None else \
        (TREE_DEFAULTS.threshold if settings.tree else default_threshold(models.target.device.type))
    device = str(models.target.device)

    def stream(prompt: str, max_new_tokens: float, temperature: float, mode: str, tree_budget: float,
               confidence_threshold: float, fallback: bool) -> Iterator[tuple]:
        s = _settings(max_new_tokens, temperature, mode == "tree", tree_budget, confidence_threshold, fallback,
                      settings)
        ids = _encode(models, prompt)
        skip = gr.skip()
        yield (_plain_html(""), "", _specla_html([]), "", "", None, None)
        specla, plain = _Collector(), _Collector()
        for result in _in_background(lambda: compare(models, ids, s, specla, plain)):
            if result is not None:
                spec_run, plain_run = result.specla, result.plain
                yield (_plain_html(_decode(models.tokenizer, plain_run.tokens)),
                       _plain_line(len(plain_run.tokens), plain_run.seconds),
                       _specla_html(_segments(models.tokenizer, specla.chunks, spec_run)),
                       _specla_line(specla.chunks, spec_run.seconds, spec_run, s), _summary(result, s, device),
                       steps_figure(spec_run), _last_tree_figure(spec_run, specla.chunks, models.tokenizer))
            elif plain.started is not None:
                tokens = [t for chunk in list(plain.chunks) for t in chunk]
                yield (_plain_html(_decode(models.tokenizer, tokens)), _plain_line(len(tokens), plain.elapsed()),
                       skip, skip, skip, skip, skip)
            elif specla.started is not None:
                chunks = list(specla.chunks)
                yield (skip, skip, _specla_html(_segments(models.tokenizer, chunks, None)),
                       _specla_line(chunks, specla.elapsed(), None, s), skip, skip, skip)

    def generate(prompt: str, max_new_tokens: int = 64, temperature: float = 0.0, tree: bool = False,
                 tree_budget: int = TREE_DEFAULTS.budget,
                 confidence_threshold: float | None = None, fallback: bool = True) -> dict:
        """SpecLA and plain decoding on one prompt: both texts, tokens/s, tau, speedup, whether they match, and
        whether SpecLA speculated to the end ("mode": "speculative") or fell back ("autoregressive", and why)."""
        s = _settings(max_new_tokens, temperature, tree, tree_budget, confidence_threshold, fallback, settings)
        result = compare(models, _encode(models, prompt), s)
        return {"plain": _decode(models.tokenizer, result.plain.tokens),
                "specla": _decode(models.tokenizer, result.specla.tokens),
                "plain_tokens_per_second": result.plain.tokens_per_second,
                "specla_tokens_per_second": result.specla.tokens_per_second, "tau": result.specla.stats.tau,
                "speedup": result.speedup, "identical": result.identical, "mode": result.specla.stats.mode,
                "mode_reason": result.specla.stats.mode_reason}

    with gr.Blocks(title="SpecLA-HF", analytics_enabled=False) as app:
        gr.Markdown(f"## SpecLA: lossless speculative decoding for Gated DeltaNet\n"
                    f"Target **{models.target_name}** ({device}, {str(models.target.dtype).removeprefix('torch.')}), "
                    f"drafter **{models.drafter_name}**. SpecLA runs first, then plain decoding, each after the same "
                    "warm-up and with the whole machine; the line under the panes says which was faster here.")
        with gr.Row():
            prompt = gr.Textbox(label="Prompt", lines=4, scale=5, elem_id="prompt")
            run = gr.Button("Generate", variant="primary", scale=1, elem_id="run")
        gr.Examples([[text] for _, text in SHIPPED], inputs=[prompt], label="Prompts from MT-Bench and HumanEval")
        with gr.Row():
            temperature = gr.Slider(0.0, 1.5, value=settings.temperature, step=0.05, label="Temperature (0 = greedy)")
            max_new = gr.Slider(8, 512, value=settings.max_new_tokens, step=8, label="Max new tokens")
            mode = gr.Radio(["tree", "chain"], value="tree" if settings.tree else "chain", label="Drafts")
            tree_budget = gr.Slider(1, MAX_TREE_BUDGET, value=budget, step=1,
                                    label="Tree budget (draft nodes per step)", interactive=settings.tree)
            conf = gr.Slider(0.0, 0.5, value=threshold, step=0.01, label="Confidence threshold")
            fallback = gr.Checkbox(settings.fallback, label="Fall back to autoregressive decoding when speculation "
                                                            "does not pay (as generate() does)")
        with gr.Row(equal_height=True):
            with gr.Column():
                gr.HTML("<b>Plain decoding</b>: one target pass per token")
                plain_text = gr.HTML(_plain_html(""), elem_id="plain-output")
                plain_stats = gr.Markdown(elem_id="plain-stats")
            with gr.Column():
                gr.HTML(LEGEND)
                specla_text = gr.HTML(_specla_html([]), elem_id="specla-output")
                specla_stats = gr.Markdown(elem_id="specla-stats")
        summary = gr.Markdown(elem_id="summary")
        with gr.Row():
            steps_plot = gr.Plot(show_label=False, elem_id="steps-plot")
            tree_plot = gr.Plot(show_label=False, elem_id="tree-plot")
        mode.change(lambda m: gr.update(interactive=m == "tree"), mode, tree_budget, api_visibility="private")
        controls = [prompt, max_new, temperature, mode, tree_budget, conf, fallback]
        outputs = [plain_text, plain_stats, specla_text, specla_stats, summary, steps_plot, tree_plot]
        for event in (run.click, prompt.submit):
            # one model, one run at a time: the API endpoint below queues behind the same limit
            event(stream, controls, outputs, api_visibility="private", concurrency_id="model", concurrency_limit=1)
        gr.api(generate, api_name="generate", concurrency_id="model", concurrency_limit=1)
    return app


def launch(models: Models, settings: DecodeSettings, host: str = "127.0.0.1", port: int = 7860) -> None:
    build_app(models, settings).launch(server_name=host, server_port=port, ssr_mode=False, css=CSS)


# ------------------------------------------------------------------------------------------------------------------
# streaming
# ------------------------------------------------------------------------------------------------------------------
class _Collector(BaseStreamer):
    """Keeps every chunk that generate() streams, prompt excepted, and when the run started and ended."""

    def __init__(self):
        self.chunks: list[list[int]] = []
        self.started: float | None = None
        self.ended: float | None = None

    def put(self, value) -> None:
        if self.started is None:            # generate() streams the prompt first
            self.started = time.perf_counter()
        else:
            self.chunks.append(value.flatten().tolist())

    def end(self) -> None:
        self.ended = time.perf_counter()

    def elapsed(self) -> float:
        return (self.ended or time.perf_counter()) - self.started


def _in_background(work: Callable[[], Comparison]) -> Iterator[Comparison | None]:
    """Run ``work`` in a thread; yield None every ``UPDATE_EVERY_S`` while it runs, then its result. The caller
    polls rather than waking on each chunk: a consumer woken on every token of plain decoding contends for the GIL
    with the decoding loop and slows it several-fold."""
    done, result = threading.Event(), {}

    def run():
        try:
            result["value"] = work()
        except Exception as e:     # re-raised in the caller's thread, where gradio reports it
            result["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    while not done.wait(UPDATE_EVERY_S):
        yield None
    if "error" in result:
        raise result["error"]
    yield result["value"]


def _settings(max_new_tokens, temperature, tree, tree_budget, confidence_threshold, fallback,
              base: DecodeSettings) -> DecodeSettings:
    s = DecodeSettings(max_new_tokens=int(max_new_tokens), temperature=float(temperature), tree=bool(tree),
                       fallback=bool(fallback), tree_budget=int(tree_budget),
                       confidence_threshold=None if confidence_threshold is None else float(confidence_threshold),
                       draft_depth=base.draft_depth)
    try:
        s.check()
    except ValueError as e:
        raise gr.Error(str(e)) from None
    return s


def _encode(models: Models, prompt: str):
    if not prompt.strip():
        raise gr.Error("Enter a prompt (or pick an example).")
    return encode(models, prompt)


# ------------------------------------------------------------------------------------------------------------------
# what the panes show
# ------------------------------------------------------------------------------------------------------------------
def _decode(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode(tokens, skip_special_tokens=True)


def _segments(tokenizer, chunks: list[list[int]], run: Run | None) -> list[tuple[str, str]]:
    """(text, DRAFT or BONUS) segments: per verify step the accepted drafts, then the target's bonus token.

    The last chunk of a finished run may stop inside the accepted drafts (EOS or the length limit hit there); then
    it has no bonus token, which the run's stats tell: fewer tokens than accepted drafts + 1.
    """
    segments, tokens, shown = [], [], ""
    for i, chunk in enumerate(chunks):
        cut = len(chunk) - 1
        if run is not None and i == len(chunks) - 1 and len(chunk) < run.stats.accepted[-1] + 1:
            cut = len(chunk)
        for part, kind in ((chunk[:cut], DRAFT), (chunk[cut:], BONUS)):
            if not part:
                continue
            tokens += part
            # a byte-level BPE token may end inside a UTF-8 character: hold it back until it is complete
            text = _decode(tokenizer, tokens).rstrip("\ufffd")
            segments.append((text[len(shown):], kind))
            shown = text
    return segments


def _specla_html(segments: list[tuple[str, str]]) -> str:
    spans = "".join(f'<span class="{kind}">{html.escape(text)}</span>' for text, kind in segments if text)
    return f'<div class="specla-text">{spans}</div>'


def _plain_html(text: str) -> str:
    return f'<div class="specla-text">{html.escape(text)}</div>'


def _specla_line(chunks: list[list[int]], seconds: float, run: Run | None, s: DecodeSettings) -> str:
    n, steps = sum(map(len, chunks)), len(chunks)
    line = (f"**{n / seconds if seconds else 0:.1f} tokens/s** · τ = {n / steps if steps else 0:.2f} tokens per "
            f"step · {steps} steps · {n} tokens · {'tree' if s.tree else 'chain'} drafts")
    if run is not None:
        line += f" · draft {run.stats.draft_time:.2f}s, verify {run.stats.verify_time:.2f}s"
        if run.stats.mode == "autoregressive":
            speculated = run.stats.speculative_steps
            line += (f" · autoregressive after {speculated} speculative steps" if speculated else
                     " · autoregressive from the start")
    return line


def _plain_line(n: int, seconds: float) -> str:
    return f"**{n / seconds if seconds else 0:.1f} tokens/s** · {n} tokens · one target pass per token"


def _summary(result: Comparison, s: DecodeSettings, device: str) -> str:
    speedup = result.speedup
    pace = {"slower": "slower than", "level": "level with", "faster": "faster than"}[result.pace] + " plain decoding"
    line = (f"### SpecLA ran at {speedup:.2f}× the tokens/s of plain decoding: {pace} on this {device}, "
            f"τ = {result.specla.stats.tau:.2f}")
    if s.greedy:
        line += (" — output identical to plain greedy decoding" if result.identical else
                 " — output DIFFERS from plain greedy decoding")
    stats = result.specla.stats
    if stats.mode_reason:           # with the fallback on: did speculation pay, or when did it stop, and why
        line += f"\n\nSpecLA's mode: **{stats.mode}** ({stats.mode_reason})"
    return line


def steps_figure(run: Run) -> Figure:
    """Per target step: accepted drafts and the target's own token, stacked, against the draft nodes verified (none
    for autoregressive steps after a fallback)."""
    stats = run.stats
    fig = Figure(figsize=(6.4, 3.2), layout="constrained")
    ax = fig.add_subplot()
    steps = range(1, stats.steps + 1)
    ax.bar(steps, stats.draft_nodes, color="none", edgecolor="#999999", label="draft nodes verified")
    ax.bar(steps, stats.accepted, color=COLORS[DRAFT], label="accepted drafts")
    ax.bar(steps, [1] * stats.steps, bottom=stats.accepted, color=COLORS[BONUS], label="target's token")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("target step (a verify pass, or an autoregressive step after a fallback)")
    ax.set_ylabel("tokens")
    ax.set_title(f"tokens per target step (τ = {stats.tau:.2f})")
    ax.legend(loc="upper right", fontsize=8)
    return fig


def _last_tree_figure(run: Run, chunks: list[list[int]], tokenizer) -> Figure | None:
    """The last verified tree with what its step emitted: the speculative steps come first, one chunk each, and
    autoregressive steps after a fallback verify no tree (none at all when the call started autoregressively)."""
    if not run.stats.speculative_steps:
        return None
    return tree_figure(run.tree, chunks[run.stats.speculative_steps - 1], tokenizer)


def accepted_path(tree: DraftTree, emitted: list[int]) -> tuple[list[int], int | None]:
    """The tree nodes a verify step accepted (root first) and its bonus token (None if the step stopped inside the
    accepted drafts), recovered from the step's emitted tokens: from the root, follow the child holding the next
    emitted token (siblings hold distinct tokens); the first emitted token that no child holds is the bonus."""
    tokens = tree.tokens.tolist()
    path = [0]
    for tok in emitted:
        node = next((c for c in tree.children[path[-1]] if tokens[c] == tok), None)
        if node is None:
            return path, tok
        path.append(node)
    return path, None


def tree_figure(tree: DraftTree, emitted: list[int], tokenizer) -> Figure:
    """The draft tree of the last verify step: the accepted path, the target's bonus token, the rejected nodes."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    path, bonus = accepted_path(tree, emitted)
    depth = [0] * len(tokens)
    for i in range(1, len(tokens)):
        depth[i] = depth[parents[i]] + 1
    y = _leaf_layout(tree.children)
    rows = max(y) + 1 + (bonus is not None)            # the bonus token gets a row of its own, below the tree
    fig = Figure(figsize=(6.4, max(2.4, 0.32 * (rows + 1))), layout="constrained")
    ax = fig.add_subplot()
    on_path = set(path)
    for i in range(1, len(tokens)):
        ax.plot([depth[parents[i]], depth[i]], [y[parents[i]], y[i]], color="#2e7d32" if i in on_path else "#bbbbbb",
                lw=2.5 if i in on_path else 1, zorder=1)
    for i, tok in enumerate(tokens):
        color = "#90caf9" if i == 0 else COLORS[DRAFT] if i in on_path else "#eeeeee"
        _node(ax, depth[i], y[i], _token_label(tokenizer, tok), color)
    if bonus is not None:
        end = path[-1]
        ax.plot([depth[end], depth[end] + 1], [y[end], rows - 1], color=COLORS[BONUS], lw=2.5, ls="--", zorder=1)
        _node(ax, depth[end] + 1, rows - 1, _token_label(tokenizer, bonus), COLORS[BONUS])
    ax.set_xlim(-0.6, max(depth + [depth[path[-1]] + 1]) + 0.6)
    ax.set_ylim(rows - 0.2, -0.8)
    ax.set_xticks(range(int(ax.get_xlim()[1]) + 1))
    ax.set_xlabel("depth (0: the pending token)")
    ax.set_yticks([])
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.set_title(f"last verified tree: {len(tokens) - 1} draft nodes, {len(path) - 1} accepted"
                 + (", then the target's token" if bonus is not None else ""), fontsize=10)
    return fig


def _leaf_layout(children: list[list[int]]) -> list[float]:
    """Vertical positions: leaves one row apart in depth-first order, a parent centred on its children."""
    y = [0.0] * len(children)
    next_row = 0

    def place(n: int) -> None:
        nonlocal next_row
        for c in children[n]:
            place(c)
        if children[n]:
            y[n] = (y[children[n][0]] + y[children[n][-1]]) / 2
        else:
            y[n], next_row = next_row, next_row + 1

    place(0)
    return y


def _node(ax, x: float, y: float, label: str, color: str) -> None:
    ax.text(x, y, label, ha="center", va="center", fontsize=8, family="monospace", zorder=2,
            bbox=dict(boxstyle="round,pad=0.25", facecolor=color, edgecolor="#555555", lw=0.6))


def _token_label(tokenizer, token: int) -> str:
    text = tokenizer.decode([token]).replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")
    return text if len(text) <= 10 else text[:9] + "…"
