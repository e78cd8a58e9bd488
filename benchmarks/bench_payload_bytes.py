"""Host-to-device bytes of one serving step's update: `jaxprep.serving.update_packing.pack_step` against
the entries the update writes, and against the old fixed-shape payload (whole ``[A, max_model_len]``
token rows and ``[A, max_blocks_per_req]`` block rows, a dense per-row schedule) with
A = max_num_reqs, the size that admits any step's requests in one payload.

    PYTHONPATH=. python benchmarks/bench_payload_bytes.py

Host only (packing, no device): three steps per size, as vLLM's scheduler sends them:
admission (every row new, prompts of 128 tokens), steady decode (every row one token, a block
appended every 16th step: one row in 16 appends), and a mixed step (1/8 of the rows new).
"""

from __future__ import annotations

import numpy as np

from jaxprep import PrepConfig
from jaxprep.serving import ServingConfig, StepUpdates, pack_step

SIZES = ((64, 2048), (256, 8192), (1024, 32768))  # (max_num_reqs, max_model_len)
PROMPT = 128


def steps(config: ServingConfig, rows: int, rng):
    blocks = -(-PROMPT // config.block_size)
    new = [dict(row=r, token_ids=rng.integers(0, 32000, PROMPT), block_ids=list(range(1 + r * blocks, 1 + (r + 1) *
                                                                                     blocks))) for r in range(rows)]
    yield "admission", StepUpdates.build(config, add=new, num_scheduled_tokens=[16] * rows), np.zeros((rows, 1))
    full = np.full((rows, 1), blocks + 1)
    appends = {r: [rows * blocks + 1 + r] for r in range(0, rows, 16)}
    yield "decode", StepUpdates.build(config, append=appends, num_scheduled_tokens=[1] * rows), full - 1
    mixed = rows // 8
    yield "mixed", StepUpdates.build(config, finish=range(mixed), add=new[:mixed],
                                     num_scheduled_tokens=[16] * mixed + [1] * (rows - mixed)), full


def old_payload_bytes(config: ServingConfig) -> int:
    """The old `AddRequests` + `AppendBlocks` + `Schedule` + `FinishRequests` bytes, A = max_num_reqs."""
    prep, rows = config.prep, config.max_num_reqs
    add = rows * (prep.max_model_len + prep.max_blocks_per_req + 5)
    appends = 2 * (-(-prep.max_num_batched_tokens // prep.block_size) + rows)  # the old per-step cap, 2 words each
    return 4 * (add + appends + 3 * rows + 1)


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'rows':>5} {'max_model_len':>13} {'step':>9} {'bytes':>9} {'changed':>9} {'ratio':>6} {'old bytes':>11}")
    for rows, max_model_len in SIZES:
        prep = PrepConfig(max_num_reqs=rows, max_model_len=max_model_len, max_num_batched_tokens=max(rows * 16, 2048),
                          block_size=16, num_blocks=rows * 64)
        config = ServingConfig(prep=prep, vocab_size=32000)
        for name, updates, blocks in steps(config, rows, rng):
            packed = pack_step(config, updates, blocks.astype(np.int64))
            changed = 4 * packed.changed_words
            old = old_payload_bytes(config)
            print(f"{rows:>5} {max_model_len:>13} {name:>9} {packed.nbytes:>9} {changed:>9} "
                  f"{packed.nbytes / changed:>6.2f} {old:>11}")


if __name__ == "__main__":
    main()
