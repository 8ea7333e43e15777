"""Threshold routing shared by the five algorithms: signal / calibrated / synthetic modes, quantile calibration.

- "signal":     the algorithm's real signal against a fixed threshold (meaningful with real weights).
- "calibrated": the same signal, but each threshold is set at warm-up to reach a target rate (random weights make raw
                thresholds meaningless: near-uniform distributions route everything or nothing).
- "synthetic":  Bernoulli / two-state Markov decisions from the counter RNG, reproducing a switching pattern exactly.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Literal

import torch

from ..api import Algorithm, RequestView, StepResult, counter_uniform

Mode = Literal["signal", "calibrated", "synthetic"]
MODES = ("signal", "calibrated", "synthetic")
# How a calibrated threshold fires: "above" = signal > t, "below" = signal < t, "at_most" = signal <= t.
Direction = Literal["above", "below", "at_most"]


@dataclass(frozen=True)
class Gate:
    """One calibratable decision: on `model`, fire when the signal crosses the threshold in `direction`."""
    name: str           # key in thresholds / rates ("switch", "return", "gate")
    model: int
    direction: Direction


def fires(signal: float, threshold: float, direction: Direction) -> bool:
    if direction == "above":
        return signal > threshold
    if direction == "below":
        return signal < threshold
    return signal <= threshold


def calibrate_threshold(signals: list[float], rate: float, direction: Direction) -> float:
    """Threshold at which exactly round(rate * n) of `signals` fire (fewer only when values tie at the cut)."""
    if not signals:
        raise ValueError("calibration needs at least one warm-up signal")
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"target rate must be in [0, 1], got {rate}")
    s = sorted(float(x) for x in signals)
    n = len(s)
    k = round(rate * n)
    if direction == "above":        # the k largest fire: threshold = the (n-k)-th smallest
        return math.inf if k == 0 else (-math.inf if k == n else s[n - k - 1])
    if direction == "below":        # the k smallest fire: threshold = the (k+1)-th smallest
        return -math.inf if k == 0 else (math.inf if k == n else s[k])
    return -math.inf if k == 0 else s[k - 1]   # at_most: the k smallest fire


@contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Deterministic module init without touching the caller's global RNG state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield


def load_weights(module: torch.nn.Module, path: str | Path, *, prefix: str = "") -> None:
    """Load router weights from a safetensors file; every module parameter must be present with the right shape."""
    from safetensors.torch import load_file
    tensors = load_file(str(path))
    state = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    if missing:
        raise ValueError(f"{path}: missing router weights {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for k, v in own.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise ValueError(f"{path}: {k} has shape {tuple(state[k].shape)}, router expects {tuple(v.shape)}")
    module.load_state_dict({k: state[k] for k in own})


class ThresholdAlgorithm(Algorithm):
    """An algorithm whose decisions are `fires(signal, threshold)` per gate, with the three modes.

    thresholds: gate name -> threshold ("signal" mode defaults, overwritten by calibration).
    rates: gate name -> target rate (calibrated mode) or Bernoulli probability (synthetic mode).
    """
    gates: tuple[Gate, ...] = ()
    default_thresholds: dict[str, float] = {}
    default_rates: dict[str, float] = {}

    def __init__(self, *, mode: Mode = "signal", thresholds: dict[str, float] | None = None,
                 rates: dict[str, float] | None = None, seed: int = 0, num_models: int | None = None):
        super().__init__(seed=seed, num_models=num_models)
        if mode not in MODES:
            raise ValueError(f"{self.name}: mode must be one of {MODES}, got {mode!r}")
        self.mode: Mode = mode
        self.thresholds = dict(self.default_thresholds)
        self.calibrated = mode != "calibrated"
        if thresholds:
            self._check_names(thresholds)
            self.thresholds.update({k: float(v) for k, v in thresholds.items()})
            self.calibrated = True   # explicit thresholds = an already calibrated algorithm rebuilt elsewhere
        self.rates = dict(self.default_rates)
        if rates:
            self._check_names(rates)
            for k, v in rates.items():
                if not 0.0 <= float(v) <= 1.0:
                    raise ValueError(f"{self.name}: rate {k}={v} is not a probability")
            self.rates.update({k: float(v) for k, v in rates.items()})

    def _check_names(self, d: dict[str, Any]) -> None:
        names = {g.name for g in self.gates}
        bad = sorted(set(d) - names)
        if bad:
            raise ValueError(f"{self.name}: unknown gate(s) {bad}; gates are {sorted(names)}")

    def config(self) -> dict[str, Any]:
        cfg = super().config()
        cfg.update(mode=self.mode, rates=dict(self.rates))
        if self.calibrated:   # an uncalibrated algorithm must stay uncalibrated when rebuilt elsewhere
            cfg["thresholds"] = dict(self.thresholds)
        return cfg

    # -- decisions ------------------------------------------------------------------------------------------
    def signal(self, gate: Gate, result: StepResult) -> float:
        """The real signal of `gate` at this step (a scalar compared with the threshold)."""
        raise NotImplementedError

    def decide(self, gate: Gate, result: StepResult, req: RequestView) -> bool:
        """Does `gate` fire at this step? Pure in (outputs, seed, request_id, position, model)."""
        if self.mode == "synthetic":
            u = counter_uniform(self.seed, req.request_id, result.position, result.model, stream=0)
            return u < self.rates[gate.name]
        if not self.calibrated:
            raise RuntimeError(f"{self.name}: calibrated mode needs calibrate() (or explicit thresholds) first")
        return fires(self.signal(gate, result), self.thresholds[gate.name], gate.direction)

    def gate(self, name: str) -> Gate:
        for g in self.gates:
            if g.name == name:
                return g
        raise KeyError(name)

    # -- calibration ----------------------------------------------------------------------------------------
    def calibration_gates(self) -> list[Gate]:
        """Gates whose thresholds warm-up sets (empty unless in calibrated mode)."""
        return list(self.gates) if self.mode == "calibrated" else []

    def calibrate(self, signals: dict[str, list[float]]) -> dict[str, float]:
        """Set each calibrated gate's threshold from its warm-up signals; returns the thresholds."""
        for g in self.calibration_gates():
            if g.name not in signals:
                raise ValueError(f"{self.name}: no warm-up signals for gate {g.name!r}")
            self.thresholds[g.name] = calibrate_threshold(signals[g.name], self.rates[g.name], g.direction)
        self.calibrated = True
        return dict(self.thresholds)


class OneTokenCorrection(ThresholdAlgorithm):
    """R2R / CITER / Co-LLM commit pattern: when the small model's gate fires, its token is dropped, the large model
    generates exactly one token at that position, which is accepted, and the request returns to the small model."""
    gates = (Gate("switch", 0, "above"),)
    default_rates = {"switch": 0.1}

    def route(self, result: StepResult, req: RequestView) -> int:
        if result.model == 0:
            return 1 if self.decide(self.gates[0], result, req) else 0
        return 0

    def keep_last(self, result: StepResult, req: RequestView, target: int) -> bool:
        return result.model != 0
