"""Prefill and decode throughput of a serving run, from the time of each dispatch.

A dispatch that computes prompt tokens is a prefill dispatch (a request running more than one token,
vLLM's rule: `jaxprep.serving.host.dispatch_log`); its decodes, a token per decoding request, ride along.
A dispatch with no prompt token is a decode dispatch: each token it runs is a generated token. So

    prefill tokens/s = prompt tokens of prefill dispatches / their seconds
    decode tokens/s  = tokens of decode dispatches / their seconds

(the decodes riding in a prefill dispatch count to neither: every prompt token is a prefill token,
but not every decode token a decode dispatch's).

The engine must keep its history (``keep_history=True``: one `DispatchRecord` per dispatch) and call
``on_step`` once per dispatch; otherwise (``simulate --async-scheduling``) the figures are None.
"""

from __future__ import annotations

import time


class PhaseClock:
    """An ``on_step`` callback of `Engine.run` that records the seconds of each dispatch; ``then`` is
    called after it (a progress display)."""

    def __init__(self, then=None):
        self.seconds: list[float] = []
        self.then = then
        self.last = time.perf_counter()

    def __call__(self, engine) -> None:
        now = time.perf_counter()
        self.seconds.append(now - self.last)
        self.last = now
        if self.then is not None:
            self.then(engine)

    def phases(self, stats) -> dict | None:
        """``{"prefill": (dispatches, tokens, seconds), "decode": (...)}``, seconds unrounded; None when
        the engine's callbacks are not one per dispatch (async scheduling). (The prepare figure of
        `Engine(time_prep=True)` is replayed after the loop, so no dispatch's seconds include it.)"""
        records = stats.dispatches_log[-len(self.seconds):] if self.seconds else []
        if len(records) != len(self.seconds):
            return None
        totals = {"prefill": [0, 0, 0.0], "decode": [0, 0, 0.0]}
        for record, seconds in zip(records, self.seconds, strict=True):
            if record.prefill_tokens:
                phase, tokens = "prefill", record.prefill_tokens
            else:
                phase, tokens = "decode", record.decode_tokens + sum(record.later_tokens)
            totals[phase][0] += 1
            totals[phase][1] += tokens
            totals[phase][2] += seconds
        return {phase: tuple(total) for phase, total in totals.items()}

    def rates(self, stats) -> dict:
        """``prefill_dispatches``, ``prefill_tokens``, ``prefill_s``, ``prefill_tokens_per_s`` (tokens over
        the unrounded seconds) and the same for decode; all None under async scheduling."""
        phases = self.phases(stats)
        out = {}
        for phase in ("prefill", "decode"):
            dispatches, tokens, seconds = phases[phase] if phases else (None, None, None)
            out.update({f"{phase}_dispatches": dispatches, f"{phase}_tokens": tokens,
                        f"{phase}_s": None if seconds is None else round(seconds, 3),
                        f"{phase}_tokens_per_s": round(tokens / seconds, 1) if seconds else None})
        return out


def rates_line(rates: dict) -> str:
    """``prefill 120 tokens in 1.5 s (80.0 tokens/s), decode 64 tokens in 2.0 s (32.0 tokens/s)``."""
    return ", ".join(f"{phase} {rates[f'{phase}_tokens']} tokens in {rates[f'{phase}_s']} s "
                     f"({rates[f'{phase}_tokens_per_s']} tokens/s)" for phase in ("prefill", "decode"))
