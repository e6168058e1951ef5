"""The caller's token budget and Stop, between the serving engine's tokens and the documents they write.

The engine masks <boi> once a picture no longer fits its budget, and the model then writes its next-best words in the
picture's place: word salad ("comes aboard:At added aboard:First"). So the pipeline gives the engine room for one
more picture than the caller's max_new_tokens and holds the caller's budget here: a picture the budget cannot hold
ends the document cleanly before its <boi>, with a notice. Where the model's positions leave no such room, the last
tokens are "blind" (a wish for a picture is not seen there) and the document ends at the first sentence end among
them. A StopSignal (models/engine/generation.py) ends every row with finish_reason "stopped" and the document so far.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator

from molora.models.engine.builder import DocumentBuilder
from molora.models.engine.core import Done, RequestHandle, Token
from molora.models.engine.events import Event, Notice, StepTiming
from molora.models.engine.generation import StopSignal
from molora.models.engine.vocab import UnifiedVocab

SENTENCE_ENDS = (".", "!", "?", ":", ";", '."', '!"', '?"')  # where text may end, or a picture follow


def document_events(sink: queue.Queue, handles: list[RequestHandle], builders: list[DocumentBuilder],
                    budget: tuple[int, int | None], stop: StopSignal | None, vocab: UnifiedVocab,
                    max_positions: int) -> Iterator[Event]:
    """The events of the documents `builders` write from the engine's (row, Token / Done) items in `sink`.
    `budget`: (the caller's max_new_tokens, which is held here, as the engine's is larger; the first token the
    engine generates blind to a picture, or None). A row ends when the engine ends it, when `stop` is set
    ("stopped"), when its budget is spent, or before a picture the budget cannot hold ("length", with a notice)."""
    limit = budget[0]
    open_rows = set(range(len(handles)))
    ending: dict[int, str] = {}  # rows the pipeline ended (cancelled), waiting for the engine to free them
    try:
        for builder in builders:
            yield from builder.start()
        times: list[list[float]] = [[] for _ in builders]
        while open_rows:
            row, item = sink.get()
            if isinstance(item, BaseException):
                raise item
            if row not in open_rows:
                continue
            builder = builders[row]
            if isinstance(item, Done):  # the engine freed the row: its adapters are unpinned
                open_rows.discard(row)
                reason = ending.pop(row, item.reason)
                if reason == "cancelled" and stop is not None and stop.is_set():
                    reason = "stopped"
                yield from finish_row(builder, reason, times[row])
                continue
            if row in ending:  # tokens the engine made before it saw the cancel: not the caller's
                continue
            times[row].append(item.ms)
            yield StepTiming(item.index, item.ms, batch=item.batch, row=row)
            notice = budget_end(builder, item, budget, vocab, max_positions)
            if notice is None:
                yield from builder.add(item.token, item.adapter, item.mix)
                if item.index + 1 < limit or item.token == vocab.eos_id:  # <eos>: the engine's Done
                    continue
            else:
                builder.doc.notices.append(notice)
                yield Notice(notice, row)
            # the caller's budget is spent, or the next picture would not fit in it: the row ends when the
            # engine has freed it (one step), so a caller that returns finds its adapters unpinned
            ending[row] = "length"
            handles[row].cancel()
    finally:
        for handle in handles:  # a consumer that stopped early cancels the requests still running
            if not handle.finished:
                handle.cancel()

def budget_end(builder: DocumentBuilder, item: Token, budget: tuple[int, int | None], vocab: UnifiedVocab,
               max_positions: int) -> str | None:
    """Why the row ends before `item` (a notice), or None. It ends when `item` opens a picture the budget
    cannot hold, or is a blind token (see _stream_rows) after a sentence end."""
    limit, blind_from = budget
    span = vocab.image_span_tokens
    if builder.in_image:
        return None
    if item.token == vocab.boi_id and limit - item.index < span:
        return (f"the document ends here: the model began picture {builder.images + 1} with "
                f"{limit - item.index} of max_new_tokens={limit} left, and a picture takes {span} "
                f"({vocab.image_span_note()}); raise max_new_tokens to draw it")
    if blind_from is not None and item.index >= blind_from and builder.text_so_far().rstrip().endswith(
            SENTENCE_ENDS):
        return (f"the document ends at a sentence end: the model's {max_positions} positions leave no room "
                f"for another picture ({span} tokens) after it")
    return None


def finish_row(builder: DocumentBuilder, reason: str, times: list[float]) -> list[Event]:
    """Stamp the request's timing (its first token includes the prompt's prefill) and close the document."""
    steps, total_ms = len(times), sum(times)
    first_ms = times[0] if times else 0.0
    decode_ms = (total_ms - first_ms) / max(steps - 1, 1)
    builder.doc.meta["timing"] = {"steps": steps, "total_ms": round(total_ms, 3),
                                  "ms_per_step": round(total_ms / max(steps, 1), 3),
                                  "prefill_ms": round(first_ms, 3), "decode_ms_per_step": round(decode_ms, 3)}
    notices = []
    if reason == "stopped":
        builder.doc.notices.append(f"stopped after {steps} tokens")
        notices.append(Notice(builder.doc.notices[-1], builder.row))
    return notices + builder.finish(reason)


__all__ = ["SENTENCE_ENDS", "budget_end", "document_events", "finish_row"]
