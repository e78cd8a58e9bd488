"""Terminal tables of a `StepRecord`: the requests, the token table, the block table, the KV cache
slots and every output, each output with the formula that gives it."""

from __future__ import annotations

import numpy as np

from jaxprep.config import cdiv
from jaxprep.metadata import SCALAR_FIELDS
from jaxprep.walkthrough.record import StepRecord
from jaxprep.walkthrough.views import CACHED, EMPTY, SCHEDULED, kv_cache_view, token_table_states

FORMULAS = {
    "positions": "computed + index inside the request",
    "token_indices": "row * max_model_len + position (NumPy reference)",
    "input_ids": "token_ids.flat[token_indices]",
    "slot_mapping": "block_table[row, pos // B] * B + pos % B; pad -1",
    "query_start_loc": "0, then cumsum(scheduled); pad repeats the total",
    "seq_lens": "computed + scheduled; pad 0",
    "logits_indices": "query_start_loc[1:] - 1 (last token of each request)",
    "idx_mapping": "state row of each batch row; pad -1",
}


def format_step(record: StepRecord, *, max_columns: int = 24, max_entries: int = 24) -> str:
    """Every table of one step, as lines of text (tables wider than ``max_columns`` positions or
    blocks, and lists longer than ``max_entries``, are cut in the middle)."""
    sections = [_header(record), _requests(record), _token_table(record, max_columns),
                _block_table(record, max_columns), _kv_cache(record), _outputs(record, max_entries), _after(record)]
    return "\n".join(line for section in sections for line in section)


def _header(record: StepRecord) -> list[str]:
    config = record.config
    lines = [f"== step {record.number}: {_plural(record.num_actual_tokens, 'token')} scheduled (budget "
             f"{config.max_num_batched_tokens}), {_plural(record.num_reqs, 'request')}, padded to the "
             f"{record.num_tokens_padded}-token bucket"]
    lines += [f"  request {request} finished last step: its row is free, its blocks {blocks} go back to the free list"
              for request, blocks in record.freed.items()]
    return lines


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _requests(record: StepRecord) -> list[str]:
    lines = ["  request  row  prompt  computed  scheduled  seq_len  this step"]
    for row in np.flatnonzero(record.request_ids >= 0):
        computed, scheduled = int(record.computed[row]), int(record.scheduled[row])
        lines.append(f"  {record.request_ids[row]:<7d}  {row:<3d}  {record.prompt_lens[row]:<6d}  {computed:<8d}  "
                     f"{scheduled:<9d}  {computed + scheduled:<7d}  {record.kind(row)}")
    return lines


def _token_table(record: StepRecord, max_columns: int) -> list[str]:
    states, tokens = token_table_states(record), record.state["token_ids"]
    columns = _cut(range(record.config.max_model_len), max_columns)
    width = max(len(str(int(tokens.max()))) + 2, 4)
    lines = ["token table (token_ids[row, position]: [x] scheduled now, x KV cached, (x) known, "
             "not scheduled, . empty)",
             "  position " + " ".join(_cell("..." if c is None else c, width) for c in columns)]
    for row in range(len(tokens)):
        cells = [_token_cell(states[row, c], tokens[row, c]) if c is not None else "..." for c in columns]
        lines.append(f"  row {row:<4d} " + " ".join(_cell(c, width) for c in cells))
    return lines


def _token_cell(state: int, token: int) -> str:
    if state == EMPTY:
        return "."
    return {CACHED: f"{token}", SCHEDULED: f"[{token}]"}.get(state, f"({token})")


def _block_table(record: StepRecord, max_columns: int) -> list[str]:
    config, table = record.config, record.state["block_table"]
    shown = cdiv(config.max_model_len, config.block_size)
    columns = _cut(range(shown), max_columns)
    new = {(row, b) for row in range(len(table)) for b in record.new_blocks.get(int(record.request_ids[row]), [])}
    width = len(str(int(table.max()))) + 1
    lines = [f"block table (block_table[row, :{shown}] of {table.shape[1]} columns; * new this step, 0 null)"]
    for row in range(len(table)):
        cells = ["..." if c is None else f"{table[row, c]}{'*' if (row, int(table[row, c])) in new else ''}"
                 for c in columns]
        lines.append(f"  row {row:<4d} " + " ".join(_cell(c, width) for c in cells))
    return lines


def _kv_cache(record: StepRecord) -> list[str]:
    view, block_size = kv_cache_view(record), record.config.block_size
    lines = [f"KV cache after the step: {view.num_used} of {view.request.size - block_size} slots hold K/V "
             f"(slot = block * {block_size} + offset; block 0 is the null block)",
             "  block  slots    holds"]
    for block in range(1, len(view.request)):
        if (view.request[block] < 0).all():
            continue
        first = block * block_size
        slots = f"{first}-{first + block_size - 1}" if block_size > 1 else f"{first}"
        lines.append(f"  {block:<5d}  {slots:<7s}  {_block_contents(view, block)}")
    return lines


def _block_contents(view, block: int) -> str:
    """Runs of slots by (request, new): e.g. "r0 p2, r0 p3 new, 1 free"."""
    runs, start = [], 0
    keys = [(int(r), bool(n)) for r, n in zip(view.request[block], view.new[block])]
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            request, new = keys[start]
            if request < 0:
                runs.append(f"{i - start} free")
            else:
                first, last = view.position[block, start], view.position[block, i - 1]
                span = f"p{first}" if first == last else f"p{first}-{last}"
                runs.append(f"r{request} {span}{' new' if new else ''}")
            start = i
    return ", ".join(runs)


def _outputs(record: StepRecord, max_entries: int) -> list[str]:
    values = {name: _array(record, name, max_entries) for name in FORMULAS}
    width = min(max(len(v) for v in values.values()), 60)
    lines = ["outputs ([real entries | padding])"]
    lines += [f"  {name:16s} {value:{width}s}  {FORMULAS[name]}" for name, value in values.items()]
    lines.append("  " + " ".join(f"{name}={int(record.outputs[name])}" for name in SCALAR_FIELDS))
    return lines


def _array(record: StepRecord, name: str, max_entries: int) -> str:
    real = record.unpadded(name)
    pad = [] if name == "token_indices" else record.outputs[name][len(real):]
    text = _list(real, max_entries)
    return f"[{text} | {_list(pad, max_entries)}]" if len(pad) else f"[{text}]"


def _after(record: StepRecord) -> list[str]:
    lines = []
    for row in record.batch_rows if record.sampled is not None else ():
        request = int(record.request_ids[row])
        if request in record.sampled:
            lines.append(f"  request {request} samples {record.sampled[request]} (appended at position "
                         f"{record.num_tokens[row]})" + (", finished" if request in record.finished else ""))
        else:
            lines.append(f"  request {request} samples nothing: its prompt is not done "
                         "(discarded, docs/semantics.md#logits-indices)")
    head = ["after the step"] if lines else []
    check = "match" if record.matches_reference else "DIFFER FROM"
    return head + lines + [f"every output and its padding {check} the NumPy reference"]


def _cut(items, limit: int) -> list:
    """Keeps the first and last items of a long range, with None where the middle was cut."""
    items = list(items)
    if len(items) <= limit:
        return items
    head = limit - limit // 4
    return items[:head] + [None] + items[len(items) - limit // 4:]


def _list(values, limit: int) -> str:
    values = [int(v) for v in values]
    if len(values) > limit:
        return ", ".join(map(str, values[: limit - 4])) + ", ..., " + ", ".join(map(str, values[-3:]))
    return ", ".join(map(str, values))


def _cell(text, width: int) -> str:
    return f"{text!s:>{width}s}"
