"""Small pieces of the page that are not its layout: checked controls, refusals, what a visitor's download may
carry, and the script that shows learned routing's weights on hover (app/ui.py uses them)."""

from __future__ import annotations

import copy
import dataclasses
import logging
from pathlib import Path
from typing import Any

import gradio as gr

log = logging.getLogger("molora.app.ui")  # refusals are logged under the page's name, as before


def latest_of_each_name(files: list[str] | None) -> list[str] | None:
    """An upload list with one entry per file name, the one added last (where the first was)."""
    if not files:
        return files
    latest = {Path(f).name: f for f in files}
    return [latest[name] for name in dict.fromkeys(Path(f).name for f in files)]


def CheckedSlider(*args: Any, **kwargs: Any) -> gr.Slider:  # noqa: N802 (used like the class it makes)
    """A gr.Slider whose API value is checked like the page's: out of range, or a fraction where the slider takes
    whole numbers, is refused naming the control and logged as one line (Gradio's own check prints a traceback
    per bad value, and rounds 2.5 to 2 without a word). Patched on the instance: a subclass of a Gradio component
    makes Gradio write a .pyi stub beside this file."""
    slider = gr.Slider(*args, **kwargs)
    original = slider.preprocess

    def preprocess(payload: float) -> float:
        label = slider.label or "a slider"
        if isinstance(payload, bool) or not isinstance(payload, (int, float)) or payload != payload:
            raise user_error(f"{label} must be a number, got {payload!r}")
        if (slider.minimum is not None and payload < slider.minimum) or (slider.maximum is not None
                                                                          and payload > slider.maximum):
            raise user_error(f"{label} must be from {slider.minimum:g} to {slider.maximum:g}, got {payload:g}")
        if float(slider.step).is_integer() and not float(payload).is_integer():
            raise user_error(f"{label} takes whole numbers, got {payload:g}")
        return original(payload)

    slider.preprocess = preprocess
    return slider


def public_document(document, labels: dict[str, str], model_name: str):
    """A copy of `document` that carries only what its visitor may see: the session's internal adapter names
    ("mine@3f9a...", which hold part of the session's id) become the visitor's own names, and the model is named by
    its folder's name, not its path on the server."""
    public = copy.copy(document)
    public.routing = [dataclasses.replace(r, adapter=labels.get(r.adapter, r.adapter),
                                          mix=tuple((labels.get(n, n), w) for n, w in r.mix))
                      for r in document.routing]
    public.meta = copy.deepcopy(document.meta)
    for key in ("text_adapter", "image_adapter"):
        public.meta[key] = labels.get(public.meta.get(key), public.meta.get(key))
    if "model" in public.meta:
        public.meta["model"] = model_name
    return public


def quiet_refusals(component: Any) -> Any:
    """`component` with Gradio's own check of an API value (e.g. a choice not in a radio's list) refused as one
    log line naming the control, not a traceback per bad value."""
    original = component.preprocess

    def preprocess(payload: Any) -> Any:
        try:
            return original(payload)
        except gr.Error as err:
            raise user_error(f"{component.label or 'a control'}: {err.message}") from None

    component.preprocess = preprocess
    return component


def user_error(message: str, **kwargs) -> gr.Error:
    """A refusal the visitor reads in the page, logged as one line (nothing is broken: no traceback)."""
    log.info("refused a request: %s", message)
    return gr.Error(message, print_exception=False, **kwargs)


# Learned routing's weights as each routing-map token's hover text. The map (gr.HighlightedText) labels a token by its
# top-1 adapter, so its legend has one chip per adapter; the weights come as hidden data with each map
# (RunView.routing_tips_html), and this script sets them as the title of the token's span, walking the tokens as the
# component renders them (one span per non-blank line of a token).
ROUTING_TIPS_JS = """<script>
(() => {
  let queued = false;
  const apply = () => {
    queued = false;
    const holder = document.querySelector('#stats .molora-routing-tips');
    if (holder && holder.dataset.tips !== window.__moloraTipsRaw) {
      window.__moloraTipsRaw = holder.dataset.tips;
      window.__moloraTips = JSON.parse(holder.dataset.tips);
    }
    const tips = window.__moloraTips || [];
    const spans = document.querySelectorAll('#routing-map .token-container');
    let k = 0;
    for (const [piece, tip] of tips) {
      for (const line of piece.split('\\n')) {
        if (!line.trim()) continue;
        const span = spans[k++];
        if (span && span.title !== tip) span.title = tip;
      }
    }
    if (!tips.length) spans.forEach(span => { if (span.title) span.title = ''; });
  };
  new MutationObserver(() => { if (!queued) { queued = true; requestAnimationFrame(apply); } })
    .observe(document.documentElement, {childList: true, subtree: true});
})();
</script>"""
