"""Batch document generation: a file of prompts in, one document per prompt out, data-parallel over processes.

    molora generate --prompts prompts.jsonl --out out/docs/                                   # one process
    accelerate launch --num_processes 2 -m molora generate --prompts prompts.jsonl --out out/docs/   # one a GPU
    torchrun --nproc_per_node 2 -m molora generate --prompts prompts.jsonl --out out/docs/ --device cpu  # CPU

Each process (accelerate's `PartialState`: rank, world size, device) takes its share of the prompts, loads its own
pipeline (its own engine and hot set) on its device and submits its share to the engine all at once, so the
share decodes as one batch. Every prompt has its own seed (its line's "seed", else --seed + its index), and a
request's tokens do not depend on what it is batched with, so a document does not depend on how many processes
ran (bit-exact on the CPU; on a GPU greedy tokens are the same, but a sampled token can flip when a row is decoded
in a different batch width: benchmarks/RESULTS.md). Each document is written as `<index>.html`; every process
writes a line per prompt to its shard, and the main process joins the shards into `documents.jsonl` (index order)
and writes `run.json` (processes, tokens, seconds, tokens/s, the prompts that failed and why).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molora.models.document import Document
from molora.routing.errors import MoLoRAError

ITEM_KEYS = ("prompt", "seed", "text_adapter", "image_adapter", "start_image", "max_new_tokens")


class PromptFileError(MoLoRAError):
    """A prompts file that cannot be read, or a line in it that is not a prompt."""


@dataclass
class PromptItem:
    """One line of a prompts file: the prompt and what it sets for itself (None: the command's setting)."""

    index: int
    prompt: str
    seed: int
    options: dict[str, Any] = field(default_factory=dict)


def read_prompts(path: str | Path, base_seed: int = 0) -> list[PromptItem]:
    """A `.jsonl` file (one object a line: "prompt" and optionally "seed", "text_adapter", "image_adapter",
    "start_image", "max_new_tokens") or a plain text file (one prompt a non-empty line). Every problem names its
    line."""
    from molora.models.engine.generation import check_text
    from molora.models.engine.sampling import check_seed

    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PromptFileError(f"cannot read the prompts file {path}: {exc}") from exc
    items: list[PromptItem] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        if path.suffix.lower() == ".jsonl":
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PromptFileError(f"{where}: not a JSON object ({exc.msg})") from None
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise PromptFileError(f'{where}: a line must be an object with a "prompt" string')
            unknown = sorted(set(record) - set(ITEM_KEYS))
            if unknown:
                raise PromptFileError(f"{where}: unknown keys {unknown}; a line may set {list(ITEM_KEYS)}")
        else:
            record = {"prompt": line.strip()}
        try:
            check_text(record["prompt"], f"{where}: the prompt")
        except MoLoRAError as exc:
            raise PromptFileError(str(exc)) from None
        index = len(items)
        try:
            seed = check_seed(record.pop("seed", base_seed + index), f"{where} seed")
        except MoLoRAError as exc:
            raise PromptFileError(str(exc)) from None
        items.append(PromptItem(index, record.pop("prompt"), seed, record))
    if not items:
        raise PromptFileError(f"{path} holds no prompts")
    return items


def document_record(item: PromptItem, doc: Document, html_name: str) -> dict:
    """What documents.jsonl keeps of one document: enough to compare runs (text, token ids, adapters, a hash of
    each picture's pixels) without opening the pages."""
    images = [hashlib.sha256(im.tobytes()).hexdigest()[:16] for im in doc.images]
    return {"index": item.index, "prompt": item.prompt, "seed": item.seed, "html": html_name, "text": doc.text,
            "token_ids": [r.id for r in doc.routing], "adapters": [r.adapter for r in doc.routing],
            "image_sha256": images, "finish_reason": doc.meta.get("finish_reason"), "notices": list(doc.notices)}


def generate_share(generate: Callable[..., Document], items: list[PromptItem], out_dir: Path,
                   overrides: dict[str, Any], *, concurrency: int, color_tokens: bool = True) -> list[dict]:
    """Generate `items` with `generate(prompt, **options)` from `concurrency` threads at once (the engine decodes
    live requests together), write each as <index>.html and return their records in index order. A prompt the
    project refuses (e.g. too few new tokens for a picture) is recorded with its error; the others go on."""
    out_dir.mkdir(parents=True, exist_ok=True)

    def one(item: PromptItem) -> dict:
        options = {**overrides, **item.options, "seed": item.seed}
        try:
            doc = generate(item.prompt, **options)
        except MoLoRAError as exc:
            return {"index": item.index, "prompt": item.prompt, "seed": item.seed, "error": str(exc)}
        name = f"{item.index:05d}.html"
        doc.save_html(out_dir / name, color_tokens=color_tokens)
        return document_record(item, doc, name)

    with ThreadPoolExecutor(max_workers=max(1, min(concurrency, len(items)))) as pool:
        return list(pool.map(one, items))


def run_data_parallel(load: Callable[[str], Any], items: list[PromptItem], out_dir: str | Path,
                      overrides: dict[str, Any], *, device: str | None = None, color_tokens: bool = True) -> dict:
    """This process's share of `items`, on its own pipeline (`load(device)`); the main process then joins every
    shard. One process (no `accelerate launch`) does everything. Returns the run summary (main process) or this
    process's part of it."""
    import torch
    from accelerate import PartialState

    # on the CPU (asked for, or no GPU) the processes meet over gloo: accelerate needs to be told
    state = PartialState(cpu=str(device).startswith("cpu") or (device is None and not torch.cuda.is_available()))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = device or str(state.device)
    shard = out_dir / f"shard-{state.process_index}.jsonl"
    with state.split_between_processes(items) as share:
        pipe = load(device)
        started = time.perf_counter()
        records = generate_share(pipe.generate, list(share), out_dir, overrides,
                                 concurrency=pipe.engine.max_rows, color_tokens=color_tokens) if share else []
        seconds = time.perf_counter() - started
    failed = sum("error" in r for r in records)
    part = {"rank": state.process_index, "device": device, "documents": len(records) - failed, "failed": failed,
            "tokens": sum(len(r.get("token_ids", ())) for r in records), "seconds": round(seconds, 3)}
    shard.write_text("".join(json.dumps(r) + "\n" for r in [{"process": part}, *records]), encoding="utf-8")
    state.wait_for_everyone()
    if not state.is_main_process:
        return part
    return join_shards(out_dir, state.num_processes)


def join_shards(out_dir: Path, processes: int) -> dict:
    """documents.jsonl in index order and run.json from every process's shard; the shards are removed."""
    parts, records = [], []
    for rank in range(processes):
        shard = out_dir / f"shard-{rank}.jsonl"
        lines = [json.loads(line) for line in shard.read_text(encoding="utf-8").splitlines()]
        parts.append(lines[0]["process"])
        records += lines[1:]
        shard.unlink()
    records.sort(key=lambda r: r["index"])
    (out_dir / "documents.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    tokens = sum(p["tokens"] for p in parts)
    seconds = max(p["seconds"] for p in parts)  # the processes run side by side: the slowest sets the wall time
    failed = [{"index": r["index"], "error": r["error"]} for r in records if "error" in r]
    summary = {"processes": processes, "documents": len(records) - len(failed), "failed": failed,
               "tokens": tokens, "seconds": seconds,
               "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None, "per_process": parts}
    (out_dir / "run.json").write_text(json.dumps(summary, indent=1), encoding="utf-8")
    return summary
