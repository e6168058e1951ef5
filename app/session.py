"""Per-visitor state: the adapters one browser session uploaded.

The model and its built-in adapters are shared by everybody; an uploaded adapter is private to the session that
uploaded it. It is registered in the shared pipeline under an internal name carrying the session's id, but a
request can only reach it through its own session's `SessionState`, which maps the visitor's display name to that
internal name. Other sessions never see it in their pickers, and naming it through the API is refused. When the
session ends (Gradio deletes a closed tab's state after its grace period, an hour in Gradio 6, so a reload can
reconnect) the adapter is unloaded from the pipeline and its folder removed.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from app.uploads import UploadError
from routing.errors import UnknownAdapterError

log = logging.getLogger(__name__)

MAX_UPLOADS_PER_SESSION = 4
NONE_CHOICE = "none"


@dataclass
class UploadedAdapter:
    display_name: str
    internal_name: str
    modality: str  # "text" | "image": which picker it is offered in (it may be used in either)
    folder: Path


@dataclass
class SessionState:
    """What one visitor owns. Deep-copied by gr.State for each new session, so it starts empty."""

    session_id: str | None = None
    uploads: dict[str, UploadedAdapter] = field(default_factory=dict)
    workdir: Path | None = None

    def bind(self, session_id: str) -> None:
        """Tie the state to the Gradio session on first use (the id is unknown when the state is created)."""
        if self.session_id is None:
            self.session_id = session_id
        elif self.session_id != session_id:
            raise UploadError("this session state belongs to another session; reload the page")

    def folder(self) -> Path:
        """A private folder for this session's files (uploads, documents)."""
        if self.workdir is None or not self.workdir.exists():
            self.workdir = Path(tempfile.mkdtemp(prefix="molora-session-"))
        return self.workdir

    def internal_name(self, display_name: str) -> str:
        return f"{display_name}@{(self.session_id or 'anon')[:12]}"

    def check_new_name(self, display_name: str, builtin: dict[str, str]) -> None:
        if display_name == NONE_CHOICE or display_name in builtin:
            raise UploadError(f"{display_name!r} is the name of a built-in adapter; choose another name")
        if display_name in self.uploads:
            raise UploadError(f"you already uploaded an adapter named {display_name!r}; choose another name")
        if len(self.uploads) >= MAX_UPLOADS_PER_SESSION:
            raise UploadError(f"a session may upload at most {MAX_UPLOADS_PER_SESSION} adapters; reload the page "
                              "to start a fresh session")

    def resolve(self, choice: str | None, builtin: dict[str, str]) -> tuple[str | None, str | None]:
        """Map a picker value to (internal name, display name); None for "none"; refuse names not ours."""
        if choice is None or choice == "" or choice == NONE_CHOICE:
            return None, None
        if choice in self.uploads:
            return self.uploads[choice].internal_name, choice
        if choice in builtin:
            return choice, choice
        raise UnknownAdapterError(f"unknown adapter {choice!r}: choose one of {', '.join(self.names(builtin)) or 'none'}")

    def names(self, builtin: dict[str, str]) -> list[str]:
        return [*builtin, *self.uploads]

    def display_names(self) -> dict[str, str]:
        """internal name -> display name for this session's uploads (to label the routing map)."""
        return {up.internal_name: name for name, up in self.uploads.items()}

    def choices(self, modality: str, builtin: dict[str, str]) -> list[tuple[str, str]]:
        """Picker choices for one modality: none, built-ins of that modality first, then the rest, then uploads."""
        out = [("none (base model)", NONE_CHOICE)]
        out += [(name, name) for name, mod in builtin.items() if mod == modality]
        out += [(f"{name} ({mod} adapter)", name) for name, mod in builtin.items() if mod != modality]
        out += [(f"{name} (uploaded)", name) for name, up in self.uploads.items()]
        return out

    def extra_adapters(self) -> dict[str, str]:
        """internal name -> folder, so a worker process (ZeroGPU) can load uploads it has not seen yet."""
        return {up.internal_name: str(up.folder) for up in self.uploads.values()}

    def cleanup(self, pipe) -> None:
        """Unload this session's adapters from the shared pipeline and delete its files."""
        remove = getattr(pipe, "remove_adapter", None)
        for up in list(self.uploads.values()):
            if remove is None:
                log.warning("this pipeline cannot unload adapters; %s stays loaded", up.internal_name)
                continue
            try:
                remove(up.internal_name)
            except Exception:  # the pipeline may already have dropped it; cleanup must never fail
                log.debug("adapter %s was already gone", up.internal_name, exc_info=True)
        self.uploads.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None
