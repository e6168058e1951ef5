"""Loading the pipeline and serving the page (`python app.py` calls `main`).

Host and port come from --host/--port, else Gradio's GRADIO_SERVER_NAME / GRADIO_SERVER_PORT (set on Hugging Face
Spaces), else Gradio's defaults. The model comes from --model, else MOLORA_MODEL, else the embedded assets/model.
MOLORA_CONCURRENCY sets how many generations run at once; MOLORA_THREADS (or --threads) torch's CPU threads.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time

import gradio as gr
import torch

from molora.app.ui import DEFAULT_CONCURRENCY, build_demo, default_adapter, launch_kwargs
from molora.models import InterleavedPipeline
from molora.models.engine.runtime import configure_cpu_threads

log = logging.getLogger("molora.app")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="molora serve", description="MoLoRA Gradio demo")
    parser.add_argument("--model", default=os.environ.get("MOLORA_MODEL") or None,
                        help="model directory (default: $MOLORA_MODEL, else the embedded assets/model)")
    parser.add_argument("--device", default=os.environ.get("MOLORA_DEVICE") or None,
                        help="cpu or cuda (default: cuda when available)")
    parser.add_argument("--host", default=None, help="bind address (default: $GRADIO_SERVER_NAME or 127.0.0.1)")
    parser.add_argument("--port", type=int, default=None, help="port (default: $GRADIO_SERVER_PORT or 7860)")
    parser.add_argument("--concurrency", type=int,
                        default=int(os.environ.get("MOLORA_CONCURRENCY", DEFAULT_CONCURRENCY)),
                        help="generations running at once")
    parser.add_argument("--threads", type=int, default=None,
                        help="CPU threads for torch (default: $MOLORA_THREADS, else 1; see models/engine/runtime.py)")
    parser.add_argument("--grid", default=os.environ.get("MOLORA_GRID") or None, metavar="ROWSxCOLS",
                        help="picture size in codes for families that take it per load (Emu3), e.g. 32x32")
    parser.add_argument("--no-warmup", action="store_true",
                        help="skip the short generation that warms the model up before serving")
    return parser.parse_args(argv)


def load_pipeline(model: str | None, device: str | None, grid: str | None = None) -> InterleavedPipeline:
    # on a ZeroGPU Space CUDA only appears inside @spaces.GPU calls; the model is still placed on "cuda" at start
    zero_gpu = bool(os.environ.get("SPACES_ZERO_GPU"))
    device = device or ("cuda" if torch.cuda.is_available() or zero_gpu else "cpu")
    log.info("loading %s on %s", model or "the embedded model", device)
    options = {} if grid is None else {"grid": tuple(int(n) for n in grid.lower().split("x"))}
    return InterleavedPipeline.from_pretrained(model, device=device, **options)


def warm_up(pipe: InterleavedPipeline) -> None:
    """One short image generation as the app starts: on CPU the first run after loading is slower than later ones
    (tiny test model, one 258-token image, 2 shared cores: 1.6 s first, 0.4 s second), so we pay it rather than the
    first visitor. `main` runs it once the page is served (a visitor who comes at once shares its forward passes):
    the page was 7-14 s later when the warm-up ran first (embedded model, 2 busy cores)."""
    text, image = default_adapter(pipe.adapters, "text"), default_adapter(pipe.adapters, "image")
    log.info("warming up: one short generation (a few seconds on a CPU; the page is served meanwhile)")
    started = time.perf_counter()
    pipe.generate("Draw a red circle.", text_adapter=text, image_adapter=image, routing="vocab", seed=0,
                  start_image=True, max_new_tokens=pipe.vocab.tokens_per_image + 2)
    log.info("warm-up done in %.1f s", time.perf_counter() - started)


def serve(pipe: InterleavedPipeline, *, host: str | None = None, port: int | None = None,
          concurrency: int = DEFAULT_CONCURRENCY, block: bool = True, quiet: bool | None = None) -> gr.Blocks:
    """Launch the page for `pipe`; with block=False return at once (tests, notebooks) and stop it with .close().
    `quiet` (default: not block): leave out Gradio's "Running on local URL" lines."""
    demo = create_demo(pipe, concurrency)
    demo.launch(server_name=host, server_port=port, prevent_thread_lock=not block,
                quiet=(not block) if quiet is None else quiet, **launch_kwargs())
    return demo


def create_demo(pipe: InterleavedPipeline, concurrency: int = DEFAULT_CONCURRENCY) -> gr.Blocks:
    """The page with its queue on: `concurrency` generations at once, a bounded wait list."""
    demo = build_demo(pipe)
    demo.queue(default_concurrency_limit=max(1, concurrency), max_size=64)
    return demo


def stop_on_sigterm() -> None:
    """Let SIGTERM (how Docker, Kubernetes and Spaces stop a container) end the app the way Ctrl+C does: the server
    closes and the exit handlers remove the app's temporary folder and every session's files in Gradio's cache.
    (Python's default for SIGTERM ends the process at once, leaving them behind.)"""
    stopping = threading.Event()

    def interrupt(signum: int, frame: object) -> None:
        if stopping.is_set():  # one shutdown: a second SIGTERM (even one already pending) must not cut it short
            return
        stopping.set()
        log.info("SIGTERM: shutting down")
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> None:
    stop_on_sigterm()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # Gradio's own health checks, one line per request
    args = parse_args(argv)
    configure_cpu_threads(args.threads)
    pipe = load_pipeline(args.model, args.device, args.grid)
    demo = serve(pipe, host=args.host, port=args.port, concurrency=args.concurrency, block=False, quiet=False)
    if not args.no_warmup:
        try:
            warm_up(pipe)
        except KeyboardInterrupt:  # Ctrl+C or SIGTERM during the warm-up: close as block_thread does after it
            log.info("stopped during the warm-up")
            demo.close()
            return
    demo.block_thread()  # until Ctrl+C or SIGTERM
