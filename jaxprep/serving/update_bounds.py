"""What the device refuses in a packed update (traced): every value it reads, bounded.

A buffer `pack_step` wrote from a checked `StepUpdates` passes every bound here (each one follows
from a host check of `jaxprep.serving.host.checks`); any other buffer may not. Each function returns
*faults*: boolean vectors, one entry per record (or word, or flag), True where a bound is broken.
They are concatenated and reduced once per verdict (`verdict`), so the checks cost element-wise
compares that fuse with their reads and one reduction, not a reduction per check:

- the layout verdict: the header itself (a flag outside {0, 1}; the counts past their static sizes
  are `packing._bad_counts`) or data runs that disagree with ``n_data``;
- the value verdict, from the buffer alone (`record_faults`, `data_faults`, `schedule_faults`,
  `lora_faults`) and from the rows it names against the state (`state_faults`, two scatters and two
  gathers over the rows): a row outside [0, max_num_reqs), an added row that is busy or a resumed,
  appended or scheduled row that is free, a count outside its range (``num_tokens`` in
  [1, max_model_len], ``stop_len`` in [num_tokens, max_model_len], ``num_computed_tokens`` below
  ``num_tokens``, ...), a token id outside [0, vocab bound), a draft outside it (-1 only where
  `placeholders_allowed`), a block id outside its table's ids or columns, a sampling parameter
  outside vLLM's bounds, a flag outside {0, 1}.

`transitions.apply_updates_body` then refuses a bad buffer whole (`packing.refused`: every
section's rows go to the drop sentinel, the schedule and the LoRA slots are absent), so the state
after equals the state before except for a bit of the error word.
"""

from __future__ import annotations

import functools
import operator

import jax
import jax.numpy as jnp

from jaxprep._constants import EMPTY_LORA_SLOT, NO_GRAMMAR, PLACEHOLDER_TOKEN_ID
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.state import block_bounds, placeholders_allowed, table_names, table_widths

TOKENS, IS_TOKEN_IDS, MROPE, TABLE = 0, 1, 2, 5  # the segment kinds of `jaxprep.serving.update_packing`


def within(values: jax.Array, low, high) -> jax.Array:
    """``low <= values <= high`` element-wise (int32: no arithmetic, so no overflow)."""
    return (values >= low) & (values <= high)


def _all(checks: list[jax.Array]) -> jax.Array:
    return functools.reduce(operator.and_, checks)


def verdict(faults: list[jax.Array]) -> jax.Array:
    """One scalar: any fault at all (one concatenation, one reduction).

    ```
    # [[F, T], [F]] -> True
    ```
    """
    return jnp.any(jax.lax.optimization_barrier(jnp.concatenate([jnp.reshape(fault, (-1,)) for fault in faults])))


def flag_faults(head: dict) -> list[jax.Array]:
    """A header flag outside {0, 1}: ``schedule_dense``, ``has_lora_slots``, ``has_schedule``."""
    return [~within(jnp.stack([head[name] for name in ("schedule_dense", "has_lora_slots", "has_schedule")]), 0, 1)]


def record_faults(config: ServingConfig, valid: dict, finish, add: dict, resume: dict,
                  segments: dict) -> list[jax.Array]:
    """The finish rows, add and resume records and appended segments (``valid[section]``: the
    entries inside the header's count), each field within its range.

    ```
    # max_model_len 32: an add with num_tokens -5, or stop_len 1000 -> a fault
    ```
    """
    rows, length = config.max_num_reqs, config.max_model_len
    widths = table_widths(config)
    tokens = add["num_tokens"]
    checks = [within(add["row"], 0, rows - 1), within(tokens, 1, length), within(add["stop_len"], tokens, length),
              within(add["num_computed_tokens"], 0, tokens - 1), within(add["prefill_len"], 0, tokens)]
    checks += [within(add[f"blocks_{t}"], 0, width) for t, width in enumerate(widths)]
    checks += [add[name] >= 0 for name in ("lora_id", "prompt_embeds_start") if name in add]
    checks += [within(add[name], 0, tokens) for name in ("mrope_len", "is_token_len") if name in add]
    if config.prep.features.sampling is not None:
        checks += _sampling_ok(add, tokens, config.prep.features.sampling.vocab_size)
    return [valid["finish"] & ~within(finish, 0, rows - 1), valid["add"] & ~_all(checks),
            valid["resume"] & ~_resume_ok(resume, rows, length, widths),
            valid["segments"] & ~_segment_ok(segments, rows, widths)]


def _sampling_ok(add: dict, tokens: jax.Array, vocab_size: int) -> list[jax.Array]:
    """vLLM's bounds of the sampling parameters (`jaxprep.features.sampling.check_parameter_bounds`),
    on their float32 bit patterns."""
    value = {name: jax.lax.bitcast_convert_type(add[name], jnp.float32)
             for name in ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty",
                          "presence_penalty")}
    finite = {name: jnp.isfinite(v) for name, v in value.items()}
    return [finite["temperature"] & (value["temperature"] >= 0), within(add["top_k"], 1, vocab_size),
            (value["top_p"] > 0) & (value["top_p"] <= 1), (value["min_p"] >= 0) & (value["min_p"] <= 1),
            finite["repetition_penalty"] & (value["repetition_penalty"] > 0), finite["frequency_penalty"],
            finite["presence_penalty"], within(add["seeds_set"], 0, 1), within(add["prompt_len"], 0, tokens)]


def _resume_ok(resume: dict, rows: int, length: int, widths: tuple[int, ...]) -> jax.Array:
    """Per resume record: row in range, each count -1 (kept) or in range, ``replace_blocks`` 0 or 1 and
    the block counts 0 unless it is 1; a stated computed count and prefill length within the stated tokens."""
    tokens, computed, prefill = resume["num_tokens"], resume["num_computed_tokens"], resume["prefill_len"]
    replace = resume["replace_blocks"]
    stated = jnp.where(tokens >= 0, tokens, length)
    checks = [within(resume["row"], 0, rows - 1), (tokens == -1) | within(tokens, 1, length),
              (computed == -1) | within(computed, 0, stated), (prefill == -1) | within(prefill, 0, stated),
              within(replace, 0, 1)]
    checks += [within(resume[f"blocks_{t}"], 0, jnp.where(replace == 1, width, 0)) for t, width in enumerate(widths)]
    return _all(checks)


def _per_table(table: jax.Array, values: tuple[int, ...]) -> jax.Array:
    """``values[table]`` from a short static tuple, as a chain of selects (no gather).

    ```
    # values (3, 7), table [1, 0] -> [7, 3]
    ```
    """
    out = jnp.full(table.shape, values[0], jnp.int32)
    for t, value in enumerate(values[1:], start=1):
        out = jnp.where(table == t, value, out)
    return out


def _segment_ok(segments: dict, rows: int, widths: tuple[int, ...]) -> jax.Array:
    """Per appended segment: a block table's kind, a row in range, ``len >= 1`` columns from ``col`` inside
    the table's width (``len <= width - col``: no sum that could overflow)."""
    table = segments["kind"] - TABLE
    width = _per_table(table, widths)
    return (within(table, 0, len(widths) - 1) & within(segments["row"], 0, rows - 1)
            & within(segments["col"], 0, width) & within(segments["len"], 1, width - segments["col"]))


def data_faults(config: ServingConfig, kind: jax.Array, row: jax.Array, col: jax.Array,
                value: jax.Array) -> list[jax.Array]:
    """Per data word (kind -1: past the data): token ids in [0, vocab bound), M-RoPE positions >= 0,
    is_token_ids 0 or 1, block ids within their table's ids; every word inside its table's columns.

    ```
    # vocab 64: a TOKENS word 5000 -> a fault; a TABLE word 0 in a full-attention table -> a fault (null block)
    ```
    """
    bounds = [block_bounds(config, t) for t in range(len(table_names(config)))]
    is_table = kind >= TABLE
    table = kind - TABLE
    low, high = _per_table(table, tuple(b[0] for b in bounds)), _per_table(table, tuple(b[1] for b in bounds))
    in_row = jnp.where(is_table, col < _per_table(table, table_widths(config)), col < config.max_model_len)
    ok = jnp.where(kind == TOKENS, within(value, 0, config.token_id_bound - 1),
                   jnp.where(kind == IS_TOKEN_IDS, within(value, 0, 1),
                             jnp.where(is_table, within(value, low, high), value >= 0)))
    return [(kind >= 0) & ~(ok & in_row & within(row, 0, config.max_num_reqs - 1) & (col >= 0))]


def schedule_faults(config: ServingConfig, entries: dict, sparse: jax.Array) -> list[jax.Array]:
    """Per schedule entry inside the count: a sparse row in range and above the previous one (each row
    once), ``num_scheduled_tokens`` in [0, max_num_batched_tokens], ``num_draft_tokens`` D in [0, K] with
    ``num_scheduled_tokens >= D + 1`` when D > 0, the first D draft ids in [low, vocab bound) (low -1
    where `placeholders_allowed`), a grammar row -1 or in [0, max_num_reqs) on a scheduled row; the
    scheduled total within the token budget."""
    rows, budget = config.max_num_reqs, config.prep.max_num_batched_tokens
    valid, row = entries["valid"], entries["row"]
    previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), row[:-1]])
    scheduled = entries["num_scheduled_tokens"]
    checks = [within(scheduled, 0, budget), ~sparse | (within(row, 0, rows - 1) & (row > previous))]
    drafts = entries.get("num_draft_tokens")
    if drafts is not None:
        low = PLACEHOLDER_TOKEN_ID if placeholders_allowed(config) else 0
        ids = entries["draft_token_ids"]
        checks += [within(drafts, 0, ids.shape[1]), (drafts == 0) | (scheduled > drafts)]
        checks += [(drafts <= k) | within(ids[:, k], low, config.token_id_bound - 1) for k in range(ids.shape[1])]
    grammar = entries.get("grammar_index")
    if grammar is not None:
        checks.append((grammar == NO_GRAMMAR) | (within(grammar, 0, rows - 1) & (scheduled > 0)))
    total = jnp.sum(jnp.where(valid, jnp.clip(scheduled, 0, budget), 0))
    return [valid & ~_all(checks), (total > budget)[None]]


def lora_faults(slots: jax.Array, present: jax.Array) -> list[jax.Array]:
    """LoRA slots, when the buffer carries them: -1 (empty) or an adapter id >= 1."""
    return [present & (slots != EMPTY_LORA_SLOT) & (slots < 1)]


def state_faults(num_tokens: jax.Array, finish_rows: jax.Array, add: dict, resume: dict,
                 append_rows: jax.Array, entry_rows: jax.Array, entry_scheduled: jax.Array) -> list[jax.Array]:
    """The rows an update names, against the rows the state holds (``num_tokens`` [R], 0: free), in the
    update's order: an added row must be free once the finished rows are; a resumed row, a row appended
    to and a scheduled schedule entry's row busy once the added ones are; a resume's computed count (or
    prefill length) within the row's tokens when it keeps them. Payload rows are -1 (or R) past a
    section's count. Two scatters (finish, add) and two gathers.

    ```
    # num_tokens [5, 0], finish [0], add row 0 -> no fault; add row 0 without the finish -> a fault
    ```
    """
    num_rows = num_tokens.shape[0]

    def index(rows):  # anything outside the rows -> the sentinel R, dropped by scatters, filled by gathers
        return jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)

    def held(table, rows, past):
        return jnp.take(table, rows, mode="fill", fill_value=past)

    finished = num_tokens.at[index(finish_rows)].set(0, mode="drop")
    add_rows = index(add["row"])
    added = finished.at[add_rows].set(jnp.maximum(add["num_tokens"], 1), mode="drop")
    sections = (index(resume["row"]), index(append_rows), index(entry_rows))
    rows = held(added, jnp.concatenate(sections), 1)  # one gather; past a section's count: busy, no fault
    resumed, appended, entries = jnp.split(rows, [len(sections[0]), len(sections[0]) + len(sections[1])])
    kept = jnp.where(resume["num_tokens"] >= 0, resume["num_tokens"], resumed)
    return [held(finished, add_rows, 0) > 0,
            (resumed == 0) | (resume["num_computed_tokens"] > kept) | (resume["prefill_len"] > kept),
            appended == 0, (entry_scheduled > 0) & (entries == 0)]
