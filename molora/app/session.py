"""Per-visitor state: the adapters one browser session uploaded.

The model and its built-in adapters are shared by everybody; an uploaded adapter is private to the session that
uploaded it. It is registered in the shared pipeline under an internal name carrying the session's id, but a
request can only reach it through its own session's `SessionState`, which maps the visitor's display name to that
internal name; its modality and folder are in the pipeline's adapter registry, beside its weights (the shared
adapters are the registry's others: `MoLoRAApp.builtin`, app/ui.py). Other sessions never see it: not in their
pickers, not in their view of the hot-set cache (`visible_cache`), and naming it through the API is refused. When
the tab closes (Gradio's unload event) the session's adapters leave the pipeline and its hot set and its folder is
removed; an adapter still held by the session's own last generation is retried until that generation has stopped.
Gradio's delete_callback (an hour later) and the app's shutdown (`SessionRegistry.close_all`) run the same cleanup,
which is idempotent.

Gradio keeps its own copies of what crosses the page, in its upload cache: the files a visitor uploads and the files
the app hands out (the document's download, the gallery's pictures). Each is registered with its session
(`SessionRegistry.track`) and deleted when the session ends, so a closed tab leaves nothing reachable by URL; at
shutdown (Ctrl+C, SIGTERM, interpreter exit) every copy still registered goes too.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from molora.app.uploads import UploadError
from molora.routing.errors import AdapterError, UnknownAdapterError

log = logging.getLogger(__name__)

MAX_UPLOADS_PER_SESSION = 4
NONE_CHOICE = "none"
REMOVE_RETRY_SECONDS = 0.5  # an adapter held by a generation that is stopping is removed this often...
REMOVE_RETRIES = 1200  # ...for at most 10 minutes (a stopped generation ends after its current step)


@dataclass
class SessionState:
    """What one visitor owns. Deep-copied by gr.State for each new session, so it starts empty."""

    session_id: str | None = None
    uploads: dict[str, str] = field(default_factory=dict)  # display name -> internal name in the pipeline
    workdir: Path | None = None
    root: Path | None = None  # where `folder()` makes the session's folder (the app's own temporary folder)
    download: str | None = None  # the last document handed out (a file of Gradio's cache)

    def bind(self, session_id: str) -> None:
        """Tie the state to the Gradio session on first use (the id is unknown when the state is created)."""
        if self.session_id is None:
            self.session_id = session_id
        elif self.session_id != session_id:
            raise UploadError("this session state belongs to another session; reload the page")

    def folder(self) -> Path:
        """A private folder for this session's files (uploads, documents)."""
        if self.workdir is None or not self.workdir.exists():
            if self.root is not None:
                self.root.mkdir(parents=True, exist_ok=True)
            self.workdir = Path(tempfile.mkdtemp(prefix="molora-session-", dir=self.root))
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
            return self.uploads[choice], choice
        if choice in builtin:
            return choice, choice
        raise UnknownAdapterError(f"unknown adapter {choice!r}: choose one of {', '.join(self.names(builtin)) or 'none'}")

    def names(self, builtin: dict[str, str]) -> list[str]:
        return [*builtin, *self.uploads]

    def display_names(self) -> dict[str, str]:
        """internal name -> display name for this session's uploads (to label the routing map)."""
        return {internal: name for name, internal in self.uploads.items()}

    def choices(self, modality: str, builtin: dict[str, str]) -> list[tuple[str, str]]:
        """Picker choices for one modality: none, built-ins of that modality first, then the rest, then uploads."""
        out = [("none (base model)", NONE_CHOICE)]
        out += [(name, name) for name, mod in builtin.items() if mod == modality]
        out += [(f"{name} ({mod} adapter)", name) for name, mod in builtin.items() if mod != modality]
        out += [(f"{name} (uploaded)", name) for name in self.uploads]
        return out

    def visible_cache(self, stats: dict, builtin: dict[str, str]) -> dict:
        """The hot-set cache's stats as this session may see them: a slot holding another session's upload reads
        as empty (its name, and that it is there at all, are that session's business), and the adapter lists
        name only built-in adapters and this session's own uploads."""
        mine = {*builtin, *self.uploads.values()}
        view = dict(stats)
        view["slots"] = [name if name in mine else None for name in stats.get("slots", [])]
        for key in ("pool", "pinned"):
            if isinstance(stats.get(key), dict):
                view[key] = {name: value for name, value in stats[key].items() if name in mine}
            elif isinstance(stats.get(key), list):
                view[key] = [name for name in stats[key] if name in mine]
        return view

    def extra_adapters(self, pipe: Any) -> dict[str, str]:
        """internal name -> folder (from `pipe`'s adapter registry), so a worker process (ZeroGPU) can load uploads
        it has not seen yet."""
        infos = pipe.adapter_infos()
        return {internal: str(infos[internal].path) for internal in self.uploads.values() if internal in infos}

    def cleanup(self, pipe: Any) -> None:
        """Unload this session's adapters from the shared pipeline (and so from its hot set) and delete its files.
        Safe to call more than once."""
        for internal in list(self.uploads.values()):
            _remove_adapter(pipe, internal, REMOVE_RETRIES)
        self.uploads.clear()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def _remove_adapter(pipe: Any, name: str, retries: int) -> None:
    """Remove `name` from the pipeline; while a (stopping) generation still holds it, try again a little later."""
    remove = getattr(pipe, "remove_adapter", None)
    if remove is None:
        log.warning("this pipeline cannot unload adapters; a session's upload stays loaded")
        return
    try:
        remove(name)
    except UnknownAdapterError:
        return  # unloaded already (cleanup runs on unload and again at shutdown): nothing left to do
    except AdapterError:  # held by a running request: it ends soon (the session's tab is closed)
        if retries <= 0:
            log.warning("a closed session's adapter stayed in use for %d s; it stays loaded",
                        int(REMOVE_RETRIES * REMOVE_RETRY_SECONDS))
            return
        timer = threading.Timer(REMOVE_RETRY_SECONDS, _remove_adapter, args=(pipe, name, retries - 1))
        timer.daemon = True
        timer.start()


def _remove_files(files: dict[str, set[str]]) -> None:
    """Delete every file in `files` ({session: paths}) and the folder Gradio made for it when left empty."""
    for paths in list(files.values()):
        for path in list(paths):
            _remove_file(path)
    files.clear()


def _remove_file(path: str) -> None:
    """Delete one file a session was handed, then its folder in Gradio's cache (one folder per file, named by its
    hash) unless another file of the same content still lives there."""
    file = Path(path)
    try:
        file.unlink(missing_ok=True)
    except OSError as err:
        log.warning("could not delete a session's file %s: %s", file, err)
        return
    if file.parent.is_dir() and not any(file.parent.iterdir()):
        file.parent.rmdir()


class SessionRegistry:
    """The live sessions of one app, by Gradio session hash, and the app's temporary folder that holds their files.

    `end(session_hash)` runs when a tab closes; `close_all()` at shutdown cleans every session and removes the
    folder (which is removed at interpreter exit in any case), so nothing is left in the system's temp directory."""

    def __init__(self, pipe: Any) -> None:
        self.pipe = pipe
        self.root = Path(tempfile.mkdtemp(prefix="molora-app-"))
        self._sessions: dict[str, SessionState] = {}
        self._files: dict[str, set[str]] = {}  # session hash -> its files in Gradio's cache
        self._lock = threading.Lock()
        # the folder goes when the registry does, and at the latest when the interpreter exits (Ctrl-C included)
        self._remove_root = weakref.finalize(self, shutil.rmtree, str(self.root), True)
        self._remove_files = weakref.finalize(self, _remove_files, self._files)

    def track(self, session_hash: str | None, path: str | Path) -> str:
        """Register a file of Gradio's cache (an upload, a download handed out) as the session's: deleted when the
        session ends. Returns the path."""
        path = str(path)
        if session_hash:
            with self._lock:
                self._files.setdefault(session_hash, set()).add(path)
        return path

    def untrack(self, session_hash: str | None, path: str | Path) -> None:
        """Delete one of the session's files now (e.g. the previous run's download), unless another session
        holds the same file (same content, same cache path)."""
        path = str(path)
        with self._lock:
            self._files.get(session_hash or "", set()).discard(path)
            shared = any(path in paths for paths in self._files.values())
        if not shared:
            _remove_file(path)

    def _release_files(self, session_hash: str | None) -> None:
        with self._lock:
            paths = self._files.pop(session_hash, set()) if session_hash else set()
            held = set().union(*self._files.values()) if self._files else set()
        for path in paths - held:
            _remove_file(path)

    def __deepcopy__(self, memo: dict) -> SessionRegistry:
        """The registry is the app's one shared service, not a value: a copy of it is itself.

        Gradio deep-copies the page config on every page load (`/config`), and the State's delete_callback, our
        bound `forget`, is in it. Were the copy to fail (at the lock), Gradio's fallback copies the config piece by
        piece, ~0.4 s of held GIL per page load: eight visitors opening the page at once waited over 5 s."""
        return self

    def new_state(self) -> SessionState:
        return SessionState(root=self.root)

    def bind(self, state: SessionState, session_hash: str) -> None:
        """Tie `state` to its session and remember it, so the session's end can clean it up."""
        state.bind(session_hash)
        if state.root is None:
            state.root = self.root
        with self._lock:
            self._sessions[session_hash] = state

    def end(self, session_hash: str | None) -> None:
        """The tab closed: unload the session's adapters and delete its files now."""
        with self._lock:
            state = self._sessions.pop(session_hash, None) if session_hash else None
        if state is not None:
            state.cleanup(self.pipe)
        self._release_files(session_hash)

    def forget(self, state: SessionState) -> None:
        """Gradio dropped the state (delete_callback): clean it up if the tab's end did not."""
        with self._lock:
            if state.session_id is not None and self._sessions.get(state.session_id) is state:
                del self._sessions[state.session_id]
        state.cleanup(self.pipe)
        self._release_files(state.session_id)

    def close_all(self) -> None:
        with self._lock:
            states, self._sessions = list(self._sessions.values()), {}
        for state in states:
            state.cleanup(self.pipe)
        self._remove_files()
        self._remove_root()
