"""Concurrent visitors of the app on the CPU, through gradio_client on loopback (issue: serving engine, S1 and
reliability).

    python -m benchmarks.app_load --users 8 --sequential --same-length   # S1 (CPU): 8 at once vs one by one
    python -m benchmarks.app_load --users 20 --minutes 3 --cancel 0.2    # bounded load test

The app (embedded model, `app.server.serve`) runs in this process on a free 127.0.0.1 port; the visitors' clients
run in a second process (as browsers on other machines would: in the server's process their threads would take
its interpreter lock; `--clients-in-server` puts them there, as before 2026-12-06). Each user is its own
gradio_client session with its own adapters, routing mode, seed, length and best_of; with --cancel a share of the
requests is cancelled part-way (what the Stop button and a closed tab do). Every completed output is compared with
the same request run alone afterwards (the solo run), and the process's resident memory is read before and after.
Nothing but 127.0.0.1 is contacted; every loop is bounded in count and time.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import multiprocessing
import random
import resource
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path

from gradio_client import Client

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's molora, as `python benchmarks/x.py`

from molora.app.server import load_pipeline, serve, warm_up  # noqa: E402
from molora.models.engine.runtime import configure_cpu_threads  # noqa: E402

PROMPTS = ["Draw a red circle at the top left.", "Show me two blue squares.", "A green triangle in the center:",
           "Tell me about a yellow star.", "Arr, a purple diamond:", "Three pink circles on the right."]
COMBOS = [("pirate", "outline", "vocab"), ("pirate", "none", "vocab"), ("none", "outline", "vocab"),
          ("pirate", "outline", "sequence"), ("none", "none", "none")]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_request(rng: random.Random, same_length: bool = False) -> dict:
    """A visitor's request; `same_length`: a picture and text, 300 tokens, no best-of (only adapters, routing,
    sampling and seed differ), so the users' requests cost the same."""
    text, image, routing = rng.choice(COMBOS)
    start_image = same_length or rng.random() < 0.5  # then the first 274 tokens are a picture
    return dict(prompt=rng.choice(PROMPTS), text_choice=text, image_choice=image, routing=routing,
                start_image=start_image, text_temperature=rng.choice([0.0, 0.7, 1.0]), text_top_k=0,
                text_top_p=rng.choice([1.0, 0.9]), image_temperature=rng.choice([0.0, 1.0]), image_top_k=0,
                cfg_scale=rng.choice([1.0, 3.0]), seed=rng.randrange(1000),
                max_new_tokens=300 if same_length else rng.choice([300, 360] if start_image else [40, 120, 300]),
                best_of=1 if same_length else rng.choice([1, 1, 1, 2]))


def connect(url: str) -> Client:
    """A new visitor (its own session); generous timeouts: the page shares 2 busy cores with the model."""
    return Client(url, verbose=False, httpx_kwargs={"timeout": 120})


def run(client: Client, req: dict, cancel_after: float | None = None) -> tuple[dict | None, float]:
    """(comparable output or None when cancelled, seconds)."""
    started = time.perf_counter()
    if cancel_after is not None:
        job = client.submit(**req, api_name="/generate")
        time.sleep(cancel_after)
        job.cancel()
        return None, time.perf_counter() - started
    text, gallery, _, _, routing_map, _, _ = client.predict(**req, api_name="/generate")
    images = [open(item["image"], "rb").read() for item in gallery]
    tokens = [(t["token"], t["class_or_confidence"]) for t in routing_map["value"]]
    return {"text": text, "tokens": tokens, "images": images}, time.perf_counter() - started


def visit(url: str, requests: list[dict], cancels: list[float | None], together: bool
          ) -> tuple[list[tuple[dict | None, float]], float]:
    """The visitors: each request in its own new session, all at once (`together`) or one after another in one
    session; ([(output, seconds)], wall seconds). Sessions are opened before the clock starts."""
    clients = [connect(url) for _ in requests] if together else [connect(url)] * len(requests)
    started = time.perf_counter()
    if together:
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            results = list(pool.map(lambda args_: run(*args_), zip(clients, requests, cancels)))
    else:
        results = [run(client, req, cancel) for client, req, cancel in zip(clients, requests, cancels)]
    return results, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--users", type=int, default=8)
    parser.add_argument("--sequential", action="store_true", help="also run the same requests one by one (S1)")
    parser.add_argument("--minutes", type=float, default=0.0, help="keep users coming for this long (load test)")
    parser.add_argument("--cancel", type=float, default=0.0, help="share of requests cancelled part-way")
    parser.add_argument("--rounds", type=int, default=1, help="at least this many rounds of --users at once")
    parser.add_argument("--no-solo", dest="solo", action="store_false", help="skip the solo runs (memory only)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--same-length", action="store_true", help="every request a picture and text, 300 tokens")
    parser.add_argument("--clients-in-server", action="store_true",
                        help="run the visitors' clients in the server's process (before 2026-12-06: their threads "
                             "then share its interpreter lock with the engine)")
    args = parser.parse_args()
    configure_cpu_threads(None)
    rng = random.Random(args.seed)
    pipe = load_pipeline(None, "cpu")
    warm_up(pipe)
    port = free_port()
    demo = serve(pipe, host="127.0.0.1", port=port, block=False)
    # the visitors' clients stand for browsers on other machines: by default they run in a process of their own,
    # so their threads do not take the server's interpreter lock (they still share the two cores)
    pool = ThreadPoolExecutor(1) if args.clients_in_server else \
        ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"))
    visitors = pool.submit
    url = f"http://127.0.0.1:{port}/"
    try:
        rss_before = rss_mib()
        deadline = time.monotonic() + args.minutes * 60
        done: list[tuple[dict, dict, float]] = []
        cancelled = 0
        wall = 0.0
        lock = threading.Lock()
        rounds = 0
        rss_rounds: list[float] = []
        pipe.engine.step_ms = []  # each decode step's time: how much of the wall the engine's steps take
        while True:
            requests = [make_request(rng, args.same_length) for _ in range(args.users)]
            cancels = [rng.uniform(0.2, 2.0) if rng.random() < args.cancel else None for _ in requests]
            results, seconds = visitors(visit, url, requests, cancels, True).result()
            wall += seconds
            rounds += 1
            rss_rounds.append(rss_mib())
            with lock:
                for req, (out, seconds) in zip(requests, results):
                    if out is None:
                        cancelled += 1
                    else:
                        done.append((req, out, seconds))
            if (time.monotonic() >= deadline and rounds >= args.rounds) or rounds >= 50:
                break
        time.sleep(1.0)  # cancelled requests leave within one engine step; give the page's workers a moment
        together_steps, pipe.engine.step_ms = pipe.engine.step_ms, None
        stats = pipe.engine.stats()
        idle = stats["running"] == 0 and stats["waiting"] == 0 and not pipe.cache_stats()["pinned"]
        rss_after_load = rss_mib()
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # hand freed heap pages back: what is left is really held
        rss_trimmed = rss_mib()
        # the solo runs: the same requests, one at a time
        solo_requests = [req for req, _, _ in done] if args.solo else []
        alone, solo_wall = visitors(visit, url, solo_requests, [None] * len(solo_requests), False).result()
        solo_wall = max(solo_wall, 1e-9)
        solo_seconds = [seconds for _, seconds in alone]
        mismatches = sum(out != solo for (_, out, _), (solo, _) in zip(done, alone))
        latencies = [s for _, _, s in done]
        print(f"users {args.users}, rounds {rounds}, completed {len(done)}, cancelled {cancelled}")
        print(f"together: {wall:.1f} s wall; per-user latency p50 {statistics.median(latencies):.2f} s, "
              f"max {max(latencies):.2f} s; {_steps(together_steps)}")
        if args.solo and (args.sequential or args.minutes == 0):
            print(f"one by one: {solo_wall:.1f} s wall; alone latency p50 {statistics.median(solo_seconds):.2f} s; "
                  f"a user's wait one by one p50 {statistics.median(_cumulative(solo_seconds)):.2f} s, "
                  f"max {max(_cumulative(solo_seconds)):.2f} s; throughput ratio {solo_wall / wall:.2f}x")
        if args.solo:
            print(f"outputs equal to their solo runs: {len(done) - mismatches}/{len(done)}")
        print(f"engine idle after the load (no running, waiting or pinned): {idle}")
        print(f"resident memory: {rss_before:.0f} MiB before, {rss_after_load:.0f} MiB after the load, "
              f"{rss_trimmed:.0f} MiB once freed heap pages went back (malloc_trim), "
              + (f"{rss_mib():.0f} MiB after the solo runs; " if args.solo else "") + "after each round: "
              f"{', '.join(f'{r:.0f}' for r in rss_rounds)} MiB")
    finally:
        pool.shutdown(cancel_futures=True)
        demo.close()


def _steps(step_ms: list[float]) -> str:
    """The engine's decode steps while the users ran together: how many, and their time (from one step's tokens to
    the next's, so a prefill between two steps counts in the second)."""
    total = sum(step_ms) / 1e3
    return f"engine: {len(step_ms)} decode steps, {total:.2f} s ({total / max(1, len(step_ms)) * 1e3:.2f} ms a step)"


def _cumulative(seconds: list[float]) -> list[float]:
    """Each user's wait when the users are served one after another."""
    total, out = 0.0, []
    for s in seconds:
        total += s
        out.append(total)
    return out


if __name__ == "__main__":
    main()
