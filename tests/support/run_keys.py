"""What `ServingBatch` ran: a stand-in for `jaxprep.serving.host.batch.run` that records each call's executable key
(``("door", bucket, words, steady)``, ``("apply", steady, ...)``, ``("widen", words)``, ``("run_step", ...)``)."""

from __future__ import annotations

from jaxprep.serving.host import batch as batch_module


def recording_run(keys: list):
    """`batch.run` as it is now, appending each call's key to ``keys`` first: install it with
    ``monkeypatch.setattr(batch_module, "run", recording_run(keys))`` (or by assignment, in a worker process)."""
    real_run = batch_module.run

    def run(table, key, *args, **static):
        keys.append(key)
        return real_run(table, key, *args, **static)

    return run
