"""What the device refuses in a packed update (traced): every value it reads, bounded.

A buffer `pack_step` wrote from a checked `StepUpdates` passes every bound here (each one follows
from a host check of `jaxprep.serving.checks`); any other buffer may not. The checks reduce to two
scalars, computed before anything is written:

- `bad_layout`: the header itself (a flag outside {0, 1}; the counts past their static sizes are
  `packing.bad_counts`) or a data section whose length disagrees with the runs its records claim;
- `bad_values` (from the buffer alone) and `bad_against_state` (a gather of the rows it names):
  a row outside [0, max_num_reqs), an added row that is busy or a resumed row that is free, a
  count outside its range (``num_tokens`` in [1, max_model_len], ``stop_len`` in [num_tokens,
  max_model_len], ``num_computed_tokens`` below ``num_tokens``, ...), a token id outside
  [0, vocab bound), a draft outside it (-1 only where `placeholders_allowed`), a block id outside
  its table's ids or columns, a sampling parameter outside vLLM's bounds, a flag outside {0, 1}.

`transitions.apply_updates_body` then refuses a bad buffer whole (`packing.refused`: every
section's rows go to the drop sentinel, the schedule and the LoRA slots are absent), so the state
after equals the state before except for a bit of the error word. Each check is a few element-wise
compares over a section's static size and one ``any``: no select over a whole state table.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprep._constants import EMPTY_LORA_SLOT, NO_GRAMMAR, PLACEHOLDER_TOKEN_ID
from jaxprep.serving.config import ServingConfig
from jaxprep.serving.state import block_bounds, placeholders_allowed, table_names, table_widths

TOKENS, IS_TOKEN_IDS, MROPE, TABLE = 0, 1, 2, 5  # the segment kinds of `jaxprep.serving.packing`


def within(values: jax.Array, low, high) -> jax.Array:
    """``low <= values <= high`` element-wise (int32: no arithmetic, so no overflow)."""
    return (values >= low) & (values <= high)


def _any_outside(valid: jax.Array, ok: jax.Array) -> jax.Array:
    return jnp.any(valid & ~ok)


def bad_flags(head: dict) -> jax.Array:
    """A header flag outside {0, 1}: ``schedule_dense``, ``has_lora_slots``, ``has_schedule``."""
    return jnp.any(jnp.stack([~within(head[name], 0, 1) for name in ("schedule_dense", "has_lora_slots",
                                                                      "has_schedule")]))


def bad_records(config: ServingConfig, valid: dict, finish, add: dict, resume: dict, segments: dict) -> jax.Array:
    """The finish rows, add and resume records and appended segments (``valid[section]``: the
    entries inside the header's count), each field within its range.
    # max_model_len 32: an add with num_tokens -5, or stop_len 1000 -> True
    """
    rows, length = config.max_num_reqs, config.max_model_len
    widths = table_widths(config)
    bad = _any_outside(valid["finish"], within(finish, 0, rows - 1))
    tokens = add["num_tokens"]
    checks = [within(add["row"], 0, rows - 1), within(tokens, 1, length), within(add["stop_len"], tokens, length),
              within(add["num_computed_tokens"], 0, tokens - 1), within(add["prefill_len"], 0, tokens)]
    checks += [within(add[f"blocks_{t}"], 0, width) for t, width in enumerate(widths)]
    checks += [add[name] >= 0 for name in ("lora_id", "prompt_embeds_start") if name in add]
    checks += [within(add[name], 0, tokens) for name in ("mrope_len", "is_token_len") if name in add]
    if config.prep.features.sampling is not None:
        checks += _sampling_ok(add, tokens, config.prep.features.sampling.vocab_size)
    bad = bad | _any_outside(valid["add"], jnp.all(jnp.stack(checks), axis=0))
    bad = bad | _any_outside(valid["resume"], _resume_ok(resume, rows, length, widths))
    return bad | _any_outside(valid["segments"], _segment_ok(segments, rows, widths))


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
    ok = (within(resume["row"], 0, rows - 1) & ((tokens == -1) | within(tokens, 1, length))
          & ((computed == -1) | within(computed, 0, stated)) & ((prefill == -1) | within(prefill, 0, stated))
          & within(replace, 0, 1))
    for t, width in enumerate(widths):
        ok = ok & within(resume[f"blocks_{t}"], 0, jnp.where(replace == 1, width, 0))
    return ok


def _segment_ok(segments: dict, rows: int, widths: tuple[int, ...]) -> jax.Array:
    """Per appended segment: a block table's kind, a row in range, ``len >= 1`` columns from ``col`` inside
    the table's width (``len <= width - col``: no sum that could overflow)."""
    table = segments["kind"] - TABLE
    width = jnp.asarray(widths, jnp.int32)[jnp.clip(table, 0, len(widths) - 1)]
    return (within(table, 0, len(widths) - 1) & within(segments["row"], 0, rows - 1)
            & within(segments["col"], 0, width) & within(segments["len"], 1, width - segments["col"]))


def bad_data(config: ServingConfig, kind: jax.Array, row: jax.Array, col: jax.Array, value: jax.Array) -> jax.Array:
    """Per data word (kind -1: past the data): token ids in [0, vocab bound), M-RoPE positions >= 0,
    is_token_ids 0 or 1, block ids within their table's ids; every word inside its table's columns.
    # vocab 64: a TOKENS word 5000 -> True; a TABLE word 0 in a full-attention table -> True (null block)
    """
    bounds = [block_bounds(config, t) for t in range(len(table_names(config)))]
    table = jnp.clip(kind - TABLE, 0, len(bounds) - 1)
    low = jnp.asarray([b[0] for b in bounds], jnp.int32)[table]
    high = jnp.asarray([b[1] for b in bounds], jnp.int32)[table]
    width = jnp.asarray(table_widths(config), jnp.int32)[table]
    is_table = kind >= TABLE
    in_table = jnp.where(is_table, col < width, col < config.max_model_len)
    ok = jnp.where(kind == TOKENS, within(value, 0, config.token_id_bound - 1),
                   jnp.where(kind == IS_TOKEN_IDS, within(value, 0, 1),
                             jnp.where(is_table, within(value, low, high), value >= 0)))
    return _any_outside(kind >= 0, ok & in_table & within(row, 0, config.max_num_reqs - 1) & (col >= 0))


def bad_schedule(config: ServingConfig, entries: dict, sparse: jax.Array) -> jax.Array:
    """Per schedule entry inside the count: a sparse row in range and above the previous one (each row
    once), ``num_scheduled_tokens`` in [0, max_num_batched_tokens], ``num_draft_tokens`` D in [0, K] with
    ``num_scheduled_tokens >= D + 1`` when D > 0, the first D draft ids in [low, vocab bound) (low -1
    where `placeholders_allowed`), a grammar row -1 or in [0, max_num_reqs) on a scheduled row; the
    scheduled total within the token budget."""
    rows, budget = config.max_num_reqs, config.prep.max_num_batched_tokens
    valid, row = entries["valid"], entries["row"]
    previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), row[:-1]])
    scheduled = entries["num_scheduled_tokens"]
    ok = within(scheduled, 0, budget) & (~sparse | (within(row, 0, rows - 1) & (row > previous)))
    drafts = entries.get("num_draft_tokens")
    if drafts is not None:
        k = entries["draft_token_ids"].shape[1]
        low = PLACEHOLDER_TOKEN_ID if placeholders_allowed(config) else 0
        used = jnp.arange(k, dtype=jnp.int32)[None, :] < drafts[:, None]
        ids_ok = jnp.all(~used | within(entries["draft_token_ids"], low, config.token_id_bound - 1), axis=1)
        ok = ok & within(drafts, 0, k) & ((drafts == 0) | (scheduled > drafts)) & ids_ok
    grammar = entries.get("grammar_index")
    if grammar is not None:
        ok = ok & ((grammar == NO_GRAMMAR) | (within(grammar, 0, rows - 1) & (scheduled > 0)))
    total = jnp.sum(jnp.where(valid, jnp.clip(scheduled, 0, budget), 0))
    return _any_outside(valid, ok) | (total > budget)


def bad_lora_slots(slots: jax.Array, present: jax.Array) -> jax.Array:
    """LoRA slots, when the buffer carries them: -1 (empty) or an adapter id >= 1."""
    return present & jnp.any((slots != EMPTY_LORA_SLOT) & (slots < 1))


def bad_against_state(num_tokens: jax.Array, finish_rows: jax.Array, add: dict, resume: dict,
                      segment_rows: jax.Array, num_scheduled_tokens: jax.Array,
                      has_schedule: jax.Array) -> jax.Array:
    """The rows an update names, against the rows the state holds (``num_tokens`` [R], 0: free), in the
    update's order: an added row must be free once the finished rows are, a resumed row, a row appended
    to and a scheduled row busy once the added ones are; a resume's computed count (or prefill length)
    within the row's tokens when it keeps them. Payload rows are -1 past a section's count.
    # num_tokens [5, 0], finish [0], add row 0 -> fine; add row 0 without the finish -> True
    """
    num_rows = num_tokens.shape[0]

    def index(rows):
        return jnp.where((rows >= 0) & (rows < num_rows), rows, num_rows)

    tokens = jnp.append(num_tokens, 0).at[index(finish_rows)].set(0, mode="drop")
    add_rows = index(add["row"])
    bad = jnp.any((add_rows < num_rows) & (tokens[add_rows] > 0))
    tokens = tokens.at[add_rows].set(jnp.maximum(add["num_tokens"], 1), mode="drop").at[num_rows].set(0)
    resume_rows = index(resume["row"])
    kept = jnp.where(resume["num_tokens"] >= 0, resume["num_tokens"], tokens[resume_rows])
    resumed = resume_rows < num_rows
    bad = bad | jnp.any(resumed & ((tokens[resume_rows] == 0) | (resume["num_computed_tokens"] > kept)
                                   | (resume["prefill_len"] > kept)))
    segment_rows = index(segment_rows)
    bad = bad | jnp.any((segment_rows < num_rows) & (tokens[segment_rows] == 0))
    return bad | ((has_schedule == 1) & jnp.any((num_scheduled_tokens > 0) & (tokens[:num_rows] == 0)))
