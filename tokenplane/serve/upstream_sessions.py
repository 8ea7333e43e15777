"""Upstream conversation sessions: each turn sends the upstream only the token IDs its live context lacks.

With `tokenplane serve --upstream URL --upstream-sessions`, the upstream is a vLLM server running this project's
middleware (serve/vllm_plugin/tokenplane_vllm_sessions.py: one live engine request per session, extended turn by
turn). A conversation's token session here and its upstream session there hold the same context: the upstream's is
the prompt IDs this tier sent, then the answer tokens it kept (all but the last sampled one, which the engine never
ran through the model). A turn is sent as a suffix when, and only when, its exact IDs (the token session's, after
repair) start with that context: the previous turn's prompt kept whole by the splice (`IdsOrigin.keep`), then the
kept answer tokens equal to the IDs the conversation now holds after it. Anything else (an edited history, an answer
the chat template renders with other tokens, a failed or cut turn, another upstream) opens a new upstream session
with the whole prompt, closing the old one. So the IDs the engine computes on are always this tier's exact IDs; the
saving is the upstream's O(context) work per turn (parsing the IDs, hashing every KV block, building the request).

An upstream that no longer knows a session (restarted, expired, evicted) answers 409 `session_mismatch`; the tier
then sends the whole prompt as a new session (proxy_routes.py).
"""

from __future__ import annotations

import argparse
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .ids_json import JSON_IDS, Chunks, IdsOrigin, ids_run

PATH = "/tokenplane/v1/session_completions"
PLUGIN_DIR = Path(__file__).resolve().parent / "vllm_plugin"   # holds tokenplane_vllm_sessions.py
MISMATCH = "session_mismatch"


@dataclass
class _Held:
    """An upstream session's context as this tier knows it."""
    sid: str
    revision: int = -1        # the token session's revision whose IDs the context starts with
    n_prompt: int = 0         # IDs of that revision the context holds (all of them)
    context: int = 0          # tokens the upstream holds: n_prompt + len(kept)
    kept: tuple[int, ...] = ()
    busy: bool = True         # a turn is out on it: its context is not known until the turn ends


@dataclass
class Turn:
    """One turn sent on an upstream session: `finish` with the upstream's report when its answer completes."""
    session: str
    sid: str
    revision: int
    n_prompt: int
    context: int              # tokens the upstream held before this turn
    sent: int                 # IDs sent this turn
    owner: SessionTurns = field(repr=False)

    def finish(self, report: Any) -> bool:
        """The answer completed and the upstream reported {"id", "context", "kept"}: the session's context is known
        again (True) if the report is consistent with what was sent, else it is dropped (False)."""
        return self.owner._finish(self, report)

    def fail(self) -> None:
        """The turn did not complete (error, cut on a stop string here, client gone): the next turn starts over."""
        self.owner._fail(self)


class SessionTurns:
    """Per token session, the upstream session that mirrors it (thread-safe: bodies are built on worker threads)."""

    def __init__(self) -> None:
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self.suffix_turns = 0
        self.full_turns = 0
        self.plain_turns = 0

    def forget(self, session: str) -> None:
        with self._lock:
            self._held.pop(session, None)

    def chunks(self, fields: dict[str, Any], ids: Any, origin: IdsOrigin) -> tuple[Chunks, Turn] | None:
        """This turn's body for the session route: the suffix past the upstream's context where the IDs extend it,
        else the whole prompt as a new upstream session (replacing the old one). None where the IDs are the
        upstream's context or a prefix of it (a resent or retried turn: nothing new to append), for the plain route,
        which leaves the upstream session as it is for the next turn."""
        n = len(ids)
        with self._lock:
            held = self._held.get(origin.session)
            suffix_from = 0
            extends = held is not None and not held.busy and origin.base_revision == held.revision \
                and origin.keep >= held.n_prompt \
                and (not held.kept or np.array_equal(np.asarray(ids[held.n_prompt:min(n, held.context)]),
                                                     np.asarray(held.kept[:max(0, n - held.n_prompt)],
                                                                dtype=np.int64)))
            if extends and held is not None and n <= held.context:
                self.plain_turns += 1
                return None
            if extends and held is not None:
                suffix_from = held.context
                spec: dict[str, Any] = {"id": held.sid, "context": held.context}
                held.busy = True
                self.suffix_turns += 1
            else:
                new = _Held(secrets.token_hex(12))
                spec = {"id": new.sid, "context": 0, "replaces": held.sid if held is not None else None}
                self._held[origin.session] = held = new
                self.full_turns += 1
        turn = Turn(origin.session, held.sid, origin.revision, n, suffix_from, n - suffix_from, self)
        run = ids_run(ids[suffix_from:])
        body = {**{k: v for k, v in fields.items() if k != "logprobs"}, "tokenplane_session": spec}
        return JSON_IDS.frame(body, [run], len(run)), turn

    def _finish(self, turn: Turn, report: Any) -> bool:
        ok = isinstance(report, dict) and report.get("id") == turn.sid and isinstance(report.get("kept"), list) \
            and report.get("context") == turn.context + turn.sent + len(report["kept"])
        with self._lock:
            held = self._held.get(turn.session)
            if held is None or held.sid != turn.sid:
                return False   # replaced meanwhile by a newer turn's session
            if not ok:
                del self._held[turn.session]
                return False
            held.revision, held.n_prompt, held.context = turn.revision, turn.n_prompt, int(report["context"])
            held.kept, held.busy = tuple(int(t) for t in report["kept"]), False
            return True

    def _fail(self, turn: Turn) -> None:
        with self._lock:
            held = self._held.get(turn.session)
            if held is not None and held.sid == turn.sid:
                held.revision = -1    # never matches: the next turn opens a new session, replacing this one
                held.busy = False

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {"sessions": len(self._held), "suffix_turns": self.suffix_turns, "full_turns": self.full_turns,
                    "plain_turns": self.plain_turns}


def plugin_path(args: argparse.Namespace) -> int:
    """`tokenplane vllm-plugin-path`: the middleware's directory, for the vLLM server's PYTHONPATH."""
    print(PLUGIN_DIR)
    return 0


__all__ = ["MISMATCH", "PATH", "PLUGIN_DIR", "SessionTurns", "Turn", "plugin_path"]
