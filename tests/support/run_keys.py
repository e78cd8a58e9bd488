"""What `ServingBatch` ran: a stand-in for `jaxprep.serving.host.batch.run` that records each call's executable key
(``("door", bucket, words, steady)``, ``("apply", steady, ...)``, ``("widen", words)``, ``("run_step", ...)``), and
an engine's run after its warm-up with those keys recorded (`run_after_warmup`)."""

from __future__ import annotations

import copy

from jaxprep.serving.host import batch as batch_module


def recording_run(keys: list):
    """`batch.run` as it is now, appending each call's key to ``keys`` first: install it with
    ``monkeypatch.setattr(batch_module, "run", recording_run(keys))`` (or by assignment, in a worker process)."""
    real_run = batch_module.run

    def run(table, key, *args, **static):
        keys.append(key)
        return real_run(table, key, *args, **static)

    return run


def run_after_warmup(engine, workload, monkeypatch) -> tuple[list, int, list]:
    """``engine`` warmed up, then run on a copy of ``workload`` with `batch.run` recorded: the finished
    requests, how many programs compiled during the run (none, after a complete warm-up) and the keys run."""
    from jaxprep.compilation import count_compiles

    engine.warmup()
    keys = []
    monkeypatch.setattr(batch_module, "run", recording_run(keys))
    engine.submit(copy.deepcopy(workload.requests), workload.arrival_steps)
    with count_compiles() as compiles:
        finished = engine.run()
    return finished, compiles.compiles, keys
