"""Token-level routing: the request-centric API (route / send / receive); algorithms and runtimes import lazily."""

from .api import Algorithm, Handoff, RequestView, StepResult, after_send, apply_handoff, commit, counter_uniform

__all__ = ["Algorithm", "Handoff", "RequestView", "StepResult", "after_send", "apply_handoff", "commit",
           "counter_uniform"]
