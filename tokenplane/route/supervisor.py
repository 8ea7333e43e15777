"""Process supervision for the routing runtime: spawn one sub-server per model, watch it, kill it, restart it.

The runtime's I/O thread drives it (every call below is made under the runtime's lock):

    spawn(m)            start model m's process (generation + 1, new socket names)
    on_ready(msg)       the process is serving: connect its client socket; returns True when every model is ready
    on_heartbeat(msg)   liveness, current step start, load (what health() reports without a round trip)
    watch(now)          exit codes, missed heartbeats (heartbeat_timeout_s: the heartbeat THREAD, independent of step
                        length), hung steps (step_timeout_s: one step's age from the heartbeat's step start); kills
                        and deaths are logged at ERROR on logger `tokenplane.route` with the reason, and recorded
                        (events, ModelHealth.last_error); the runtime's on_death callback fails the requests

States (ModelState): STARTING (first start), READY, RESTARTING (died after serving; respawned, not ready yet),
FAILED (died with auto_restart off, or 3 restarts in a row died before becoming ready).
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from .handoff import connect_push
from .messages import Heartbeat, Ready

log = logging.getLogger("tokenplane.route")

MAX_RESTART_ATTEMPTS = 3


class ModelState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"


@dataclass(frozen=True)
class ModelHealth:
    """One model's process as the supervisor sees it (heartbeat data: no round trip). `down_since` is wall-clock
    time (time.time()) of the death that started the current outage; None while READY."""
    model: int
    source: str
    state: ModelState
    pid: int | None
    restarts: int
    last_error: str | None
    down_since: float | None
    kv_blocks_used: int
    kv_blocks_total: int
    num_waiting: int
    num_running: int


@dataclass
class ModelProc:
    index: int
    source: str
    proc: Any = None
    generation: int = 0
    client: Any = None              # PUSH socket to its client inbox
    peer_address: str | None = None
    state: ModelState = ModelState.STARTING
    pid: int | None = None
    spawned_at: float = 0.0         # time.monotonic() of the latest spawn
    last_heartbeat: float = 0.0
    heard: bool = False         # a heartbeat of this generation has come (its thread runs from before the load)
    step_started: float | None = None
    info: Ready | None = None
    attempts: int = 0               # consecutive spawns that died before Ready
    restarts: int = 0               # respawns after a death, over the runtime's life
    last_error: str | None = None
    down_since: float | None = None
    kill_reason: str | None = None  # why the supervisor killed the current process, if it did
    start_s: float | None = None    # how long the latest successful start took (spawn -> Ready)
    heartbeat: Heartbeat | None = None

    @property
    def ready(self) -> bool:
        return self.state == ModelState.READY


def _source_name(src: Any) -> str:
    if isinstance(src, dict):
        return str(src.get("name") or src.get("_name_or_path") or src.get("model_type") or "config")
    return str(src)


class Supervisor:
    """Owns the model processes. `spec_fn(m, generation)` builds the SubServerSpec; `on_death(m, why)` is called
    (under the runtime's lock) when a READY model dies, before any respawn."""

    def __init__(self, config: Any, ctx: Any, mp_ctx: Any, spec_fn: Callable, on_death: Callable[[int, str], None],
                 events: list[str]):
        self.config = config
        self.ctx = ctx
        self.mp = mp_ctx
        self.spec_fn = spec_fn
        self.on_death = on_death
        self.events = events
        self.models = [ModelProc(i, _source_name(src)) for i, src in enumerate(config.models)]
        self.startup_error: str | None = None
        self.started = False            # every model has been ready once (startup is over)

    # -- processes -------------------------------------------------------------------------------------------------
    def spawn(self, m: int) -> None:
        from . import subserver
        st = self.models[m]
        st.generation += 1
        if st.state != ModelState.STARTING:
            st.state = ModelState.RESTARTING
        st.proc = self.mp.Process(target=subserver.main, args=(self.spec_fn(m, st.generation),),
                                  name=f"tokenplane-model{m}", daemon=True)
        st.proc.start()
        st.pid = st.proc.pid
        st.spawned_at = st.last_heartbeat = time.monotonic()
        st.heard = False
        st.step_started = None
        st.kill_reason = None

    def kill(self, m: int, reason: str) -> None:
        """Kill model m's process; the death is handled (logged, requests failed, respawned) by the next watch."""
        st = self.models[m]
        if st.proc is None or st.proc.exitcode is not None:
            return
        st.kill_reason = reason
        log.error("killing model %d (pid %s): %s", m, st.pid, reason)
        self.events.append(f"model {m} (pid {st.pid}) killed: {reason}")
        st.proc.kill()

    def on_ready(self, r: Ready) -> bool:
        """Returns True when this Ready completes a (re)start of every model."""
        st = self.models[r.model]
        if r.pid != st.pid:
            return False   # a previous generation's late message
        st.info = r
        st.peer_address = r.peer_address
        if st.client is not None:
            st.client.close(0)
        st.client = connect_push(self.ctx, r.client_address)
        now = time.monotonic()
        st.last_heartbeat = now
        st.start_s = now - st.spawned_at
        if st.state == ModelState.RESTARTING:
            self.events.append(f"model {r.model} restarted (pid {r.pid}) in {st.start_s:.2f} s")
            log.warning("model %d restarted (pid %d) in %.2f s", r.model, r.pid, st.start_s)
        st.state = ModelState.READY
        st.attempts = 0
        st.down_since = None
        return all(s.ready for s in self.models)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        st = self.models[hb.model]
        if hb.pid == st.pid:
            st.heard = True
            st.last_heartbeat = time.monotonic()
            st.step_started = hb.step_started
            st.heartbeat = hb

    def watch(self, now: float) -> None:
        """Detect dead, silent or hung sub-servers (every ~0.1 s)."""
        cfg = self.config
        for m, st in enumerate(self.models):
            if st.proc is None:
                continue
            code = st.proc.exitcode
            if code is not None:
                self._on_exit(m, code)
                continue
            if not st.ready:
                # loading (a first start or a restart): its heartbeat thread runs from before the model loads, so a
                # slow load is waited for while it beats. Killed: no first heartbeat within startup_timeout_s (the
                # interpreter's start and imports), silence after one as long as a serving model's, or the limit.
                silent = now - st.last_heartbeat
                limit, name = ((cfg.heartbeat_timeout_s, "heartbeat_timeout_s") if st.heard
                               else (cfg.startup_timeout_s, "startup_timeout_s"))
                if silent > limit:
                    self.kill(m, f"no heartbeat for {silent:.1f} s while loading, {now - st.spawned_at:.0f} s "
                                 f"after its start ({name} {limit})")
                elif now - st.spawned_at > cfg.startup_limit_s:
                    self.kill(m, f"not ready {now - st.spawned_at:.0f} s after its start (startup_limit_s "
                                 f"{cfg.startup_limit_s})")
                continue
            if now - st.last_heartbeat > cfg.heartbeat_timeout_s:
                self.kill(m, f"no heartbeat for {now - st.last_heartbeat:.1f} s (heartbeat_timeout_s "
                             f"{cfg.heartbeat_timeout_s}); the heartbeat thread is stuck or the process is frozen")
            elif (cfg.step_timeout_s is not None and st.step_started is not None
                  and now - st.step_started > cfg.step_timeout_s):
                self.kill(m, f"one step has run {now - st.step_started:.1f} s (step_timeout_s "
                             f"{cfg.step_timeout_s}): hung step")

    def _on_exit(self, m: int, code: int) -> None:
        st = self.models[m]
        why = f"exited with code {code}"
        if st.kill_reason:
            why += f" (killed by the supervisor: {st.kill_reason})"
        elif code < 0:
            why += f" (signal {-code} from outside the runtime; -9 is SIGKILL, e.g. the kernel's OOM killer)"
        msg = f"sub-server for model {m} (pid {st.pid}) {why}"
        st.proc = None
        if not self.started:
            self.startup_error = self.startup_error or f"model {m} exited during startup: {why}"
            st.state, st.last_error = ModelState.FAILED, msg
            log.error("%s", msg)
            return
        was_ready = st.ready
        st.last_error = msg
        self.events.append(msg)
        log.error("%s", msg)
        if st.client is not None:
            st.client.close(0)
            st.client = None
        if was_ready:
            st.down_since = time.time()
            st.state = ModelState.RESTARTING
            self.on_death(m, msg)
        if not self.config.auto_restart:
            st.state = ModelState.FAILED
            return
        if not was_ready:
            st.attempts += 1
            if st.attempts >= MAX_RESTART_ATTEMPTS:
                st.state = ModelState.FAILED
                log.error("model %d: %d restarts in a row died before becoming ready; giving up (restart_model "
                          "to retry)", m, st.attempts)
                return
        st.restarts += 1
        self.spawn(m)

    # -- queries ---------------------------------------------------------------------------------------------------
    def retry_after_s(self, m: int) -> float:
        """A client's best retry delay while model m is down: the rest of its expected start time."""
        st = self.models[m]
        if st.state == ModelState.FAILED:
            return 60.0
        expect = st.start_s if st.start_s is not None else 30.0
        return max(0.5, round(expect - (time.monotonic() - st.spawned_at), 1))

    def health(self) -> list[ModelHealth]:
        out = []
        for st in self.models:
            hb = st.heartbeat if st.ready else None
            total = st.info.num_blocks if st.info is not None else 0
            out.append(ModelHealth(st.index, st.source, st.state, st.pid, st.restarts, st.last_error,
                                   st.down_since, hb.kv_blocks_used if hb else 0,
                                   hb.kv_blocks_total if hb and hb.kv_blocks_total else total,
                                   hb.num_waiting if hb else 0, hb.num_running if hb else 0))
        return out


__all__ = ["ModelHealth", "ModelProc", "ModelState", "Supervisor"]
