"""The running example of the V2 / LoRA tests: four requests of one step, as vLLM 0.33.0 ran them.

R_max = 6, max_model_len 32, block size 4, token budget 16, K = 2 draft tokens at most, vocabulary
64. Token t of request i is ``10 (i + 1) + t``; outputs follow the prompt in the token table, then
this step's drafts.

| req | kind | prompt | outputs | C | S | drafts | LoRA id | blocks |
|---|---|---|---|---|---|---|---|---|
| r0 | decode + 2 drafts | 5 | 15..19 | 9 | 3 | [50, 51] | 7 | 1, 2, 3 |
| r1 | chunked prefill | 20 | - | 4 | 6 | - | 0 | 4, 5, 6 |
| r2 | decode | 8 | 38..42 | 12 | 1 | - | 3 | 7, 8, 9, 10 |
| r3 | decode + 1 draft | 4 | 44..47 | 7 | 2 | [60] | 7 | 11, 12, 13 |

V2 state slots: r0 -> 5, r1 -> 3, r2 -> 2, r3 -> 1; slot 4 holds a live request with no work this
step (adapter 3), slot 0 is free. V1 rows: r0..r3 -> rows 0..3 (V1 drops unscheduled requests).
GPU adapter slots: adapter 3 in slot 0, adapter 7 in slot 2, out of ``max_loras = 4``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxprep import FeatureConfig, LoRAConfig, PrepConfig

K = 2
VOCAB = 64
LORA_SLOTS = np.array([3, -1, 7, -1], np.int32)
REQUESTS = (  # prompt, outputs, computed, scheduled, drafts, lora id, blocks
    (5, 5, 9, 3, [50, 51], 7, [1, 2, 3]),
    (20, 0, 4, 6, [], 0, [4, 5, 6]),
    (8, 5, 12, 1, [], 3, [7, 8, 9, 10]),
    (4, 4, 7, 2, [60], 7, [11, 12, 13]),
)
V2_SLOTS = (5, 3, 2, 1)
V1_ROWS = (0, 1, 2, 3)


def config(runner: str = "v1", **lora_options) -> PrepConfig:
    lora = LoRAConfig(max_loras=4, vocab_size=VOCAB, **lora_options)
    return PrepConfig(max_num_reqs=6, max_model_len=32, max_num_batched_tokens=16, block_size=4,
                      features=FeatureConfig(num_speculative_tokens=K, runner=runner, lora=lora))


def config_for(mode: str, runner: str = "v2") -> PrepConfig:
    """`config` for a `feature_batches.KERNEL_MODES` mode: without LoRA on the fused kernels (which do not
    cover it; the outputs the tests read do not depend on it)."""
    full = config(runner)
    return dataclasses.replace(full, features=dataclasses.replace(full.features, lora=None)) if mode == "pallas" \
        else full


def arrays(rows=V2_SLOTS, lora_ids=None) -> dict[str, np.ndarray]:
    """The example's `BatchState` arrays with request i at state row ``rows[i]``."""
    token_ids = np.zeros((6, 32), np.int32)
    block_table = np.zeros((6, 32), np.int32)
    computed, scheduled, drafts, prompt, ids = (np.zeros(6, np.int32) for _ in range(5))
    for i, (row, (p, o, c, s, d, lid, blocks)) in enumerate(zip(rows, REQUESTS, strict=True)):
        token_ids[row, :p + o] = 10 * (i + 1) + np.arange(p + o)
        token_ids[row, p + o:p + o + len(d)] = d
        block_table[row, :len(blocks)] = blocks
        computed[row], scheduled[row], drafts[row], prompt[row], ids[row] = c, s, len(d), p + o if o else p, lid
    if rows == V2_SLOTS:  # the live request without work this step
        token_ids[4, :3], block_table[4, 0], computed[4], prompt[4], ids[4] = [90, 91, 92], 14, 3, 3, 3
    if lora_ids is not None:
        ids = np.asarray(lora_ids, np.int32)
    return dict(token_ids=token_ids, block_table=block_table, num_computed_tokens=computed,
                num_scheduled_tokens=scheduled, num_draft_tokens=drafts, prefill_len=prompt,
                lora_ids=ids, lora_slots=LORA_SLOTS.copy())


BASE = PrepConfig(max_num_reqs=6, max_model_len=40, max_num_batched_tokens=32, block_size=4)


def with_random_adapters(arrays: dict, max_loras: int, rng) -> dict:
    """Random slot layout (some empty) and per-row ids: none, a loaded adapter, or stale on idle rows."""
    pool = rng.permutation(np.arange(1, 3 * max_loras + 1))
    slots = np.where(rng.random(max_loras) < 0.75, pool[:max_loras], -1).astype(np.int32)
    loaded = slots[slots > 0]
    rows = len(arrays["num_scheduled_tokens"])
    picks = rng.integers(0, len(loaded) + 1, rows)  # len(loaded): no adapter
    ids = np.array([loaded[p] if p < len(loaded) else 0 for p in picks], np.int32)
    idle = arrays["num_scheduled_tokens"] == 0
    ids = np.where(idle & (rng.random(rows) < 0.5), pool[-1], ids)  # stale ids of rows without work are never read
    return dict(arrays, lora_ids=ids.astype(np.int32), lora_slots=slots)


def lora_fields(step) -> dict:
    """The step's LoRA arrays as NumPy, kernel metadata flattened to ``token.<field>`` / ``prompt.<field>``."""
    out = {}
    for field in dataclasses.fields(step.lora):
        value = getattr(step.lora, field.name)
        if field.name.endswith("_mapping_meta"):
            prefix = field.name.split("_")[0]
            out.update({f"{prefix}.{f.name}": np.asarray(getattr(value, f.name)) for f in dataclasses.fields(value)})
        elif value is not None:
            out[field.name] = np.asarray(value)
    return out


def full_graph_config(runner: str) -> PrepConfig:
    return PrepConfig(max_num_reqs=6, max_model_len=32, max_num_batched_tokens=16, block_size=4,
                      features=FeatureConfig(num_speculative_tokens=1, runner=runner))


def full_graph_arrays() -> dict:
    """Slot 5: C = 9, S = 2 (one draft, 77); slot 4: C = 7, S = 2 (one draft, 88)."""
    token_ids = np.zeros((6, 32), np.int32)
    token_ids[5, :11] = [*range(60, 69), 69, 77]
    token_ids[4, :9] = [*range(40, 47), 47, 88]
    block_table = np.zeros((6, 32), np.int32)
    block_table[5, :3], block_table[4, :3] = [1, 2, 3], [4, 5, 6]
    computed, scheduled, drafts = (np.zeros(6, np.int32) for _ in range(3))
    computed[5], computed[4] = 9, 7
    scheduled[5] = scheduled[4] = 2
    drafts[5] = drafts[4] = 1
    return dict(token_ids=token_ids, block_table=block_table, num_computed_tokens=computed,
                num_scheduled_tokens=scheduled, num_draft_tokens=drafts)
