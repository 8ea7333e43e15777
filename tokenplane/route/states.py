"""Per-model request lifecycle (vLLM style): one explicit state per request, finished states ordered last.

    WAITING         admitted (or returned without retained state) but holds no KV blocks yet
    RUNNING         holds KV blocks; decodes on this model at its next step
    PENDING_RETURN  a peer model is working on the request (or answering an ensemble score visit); this model keeps
                    its KV blocks, slot and counters so the return is an append + catch-up, not a re-admission
    FINISHED        stop token, length, or a done handoff
    ABORTED         client abort, peer failure, or an error

`state.is_finished` (state > PENDING_RETURN) is the only test callers need, as with vLLM's RequestStatus.
"""

from __future__ import annotations

from enum import IntEnum


class RequestState(IntEnum):
    WAITING = 0
    RUNNING = 1
    PENDING_RETURN = 2
    FINISHED = 3
    ABORTED = 4

    @property
    def is_finished(self) -> bool:
        return self > RequestState.PENDING_RETURN


__all__ = ["RequestState"]
