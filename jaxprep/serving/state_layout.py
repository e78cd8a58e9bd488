"""Where each field of the serving state lives: three int32 arrays, every field a range of their columns.

`jaxprep.serving.state.ServingState` keeps the whole per-request state of the serving loop in three
device arrays, each ``[max_num_reqs, width]`` int32 with one row per request slot (vLLM's persistent
batch rows), so a jitted step takes and donates three arrays whatever the features:

- ``tokens``: the wide per-row tables a step reads a few entries of: ``token_ids`` [L], then where their
  features are on ``mrope_positions`` [3, L], ``is_token_ids`` [L] (0/1) and the sampler's penalty bins
  (``prompt_bin_mask`` [V / 32], ``output_bin_counts`` [V]);
- ``tables``: the block tables: KV group 0's ``block_table``, then groups 1.. (``extra_block_tables``)
  and the Mamba state blocks (``mamba_block_table``);
- ``rows``: every other per-row value, each a few words: the counters, the features' per-row values (floats
  as their bit patterns, bools as 0/1), and two values that belong to no row, held in
  row 0 of their columns (`Placement.shared`): the error word and the LoRA slots. Under data
  parallelism (the state split by rows over a mesh) each rank's row 0 holds its own.

With no feature on, ``token_ids`` is the whole ``tokens`` array and ``block_table`` the whole ``tables``
array: reading them is free, and the step's gathers read them as before.

```
# max_num_reqs 4, max_model_len 8, 2 block columns, no feature:
#   tokens [4, 8] = token_ids; tables [4, 2] = block_table;
#   rows [4, 8] = num_computed_tokens, num_scheduled_tokens, num_draft_tokens, num_tokens, stop_len,
#                 num_blocks (the row record, columns 0..5), then errors (column 6, row 0) ...
```

The layout is static (a pure function of the `ServingConfig`, hashable: part of every compile key).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import numpy as np

from jaxprep.features import registry
from jaxprep.serving.config import ServingConfig

TOKENS, TABLES, ROWS = "tokens", "tables", "rows"
ARRAYS = (TOKENS, TABLES, ROWS)
"""The state's arrays, in pytree order."""

INT, FLOAT, BOOL = "int32", "float32", "bool"

TOKEN_WIDE = ("token_ids", "mrope_positions", "is_token_ids", "prompt_bin_mask", "output_bin_counts")
"""Fields placed in ``tokens``, in column order: the wide ones. ``rows`` keeps only small per-row values, so a
copy of it (XLA makes one where a while loop carries the state, `jaxprep.serving.step`) stays small."""
ROW_RECORD = ("num_computed_tokens", "num_scheduled_tokens", "num_draft_tokens", "num_tokens", "stop_len",
              "num_blocks")
"""The counters every row has, in the first columns of ``rows`` (the row record's core)."""
SERVING_FIELDS = ("num_tokens", "stop_len", "num_blocks")
"""Per-row fields of the serving loop that `BatchState` does not have."""
SHARED = ("errors", "lora_slots")
"""Values of the whole state (not of a row), held in row 0 of their columns."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where one field lives: columns ``[start, start + width)`` of array ``array``; each row holds the
    field's per-row value of shape ``shape`` (flattened, row-major). ``shared``: the field is one value of
    ``shape`` for the whole state, held in row 0."""

    array: str
    start: int
    shape: tuple[int, ...]
    kind: str  # INT, FLOAT (float32 bit patterns) or BOOL (0 / 1)
    shared: bool = False

    @property
    def width(self) -> int:
        return math.prod(self.shape)

    @property
    def stop(self) -> int:
        return self.start + self.width


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """Every field's `Placement`, and each array's width; `layout_of` builds it from a config."""

    placements: tuple[tuple[str, Placement], ...]
    widths: tuple[tuple[str, int], ...]  # (array, columns) in `ARRAYS` order
    num_extra_tables: int  # KV groups past the first (``extra_block_tables``)
    record_width: int  # the row record: the per-row scalar int/float/bool fields, columns [0, record_width) of rows

    @functools.cached_property
    def by_name(self) -> dict[str, Placement]:
        return dict(self.placements)

    def __getitem__(self, name: str) -> Placement:
        return self.by_name[name]

    def __contains__(self, name: str) -> bool:
        return name in self.by_name

    def width(self, array: str) -> int:
        return dict(self.widths)[array]

    @functools.cached_property
    def array_widths(self) -> tuple[int, ...]:
        """Each array's width, in `ARRAYS` order."""
        return tuple(width for _, width in self.widths)

    @functools.cached_property
    def record_fields(self) -> tuple[str, ...]:
        """The fields of the row record, in column order (each one column wide)."""
        return tuple(name for name, p in self.placements if p.array == ROWS and p.stop <= self.record_width)

    @property
    def table_fields(self) -> tuple[str, ...]:
        """The block tables, in `jaxprep.serving.state.table_names` order."""
        return tuple(name for name, p in self.placements if p.array == TABLES)


def extra_table_name(group: int) -> str:
    """The field name of KV group ``group + 1``'s table (``extra_block_tables[group]``)."""
    return f"extra_block_tables[{group}]"


@functools.lru_cache(maxsize=64)
def layout_of(config: ServingConfig) -> StateLayout:
    """The layout of ``config``'s state: the fields `jaxprep.BatchState.empty` has under ``config.prep``
    (with ``num_draft_tokens`` always: the serving loop counts drafts), then the serving counters."""
    fields = empty_fields(config)
    placed, next_column = [], dict.fromkeys(ARRAYS, 0)

    def place(name: str, array: str, value: np.ndarray, shared: bool = False) -> None:
        shape = tuple(value.shape) if shared else tuple(value.shape[1:])
        kind = BOOL if value.dtype == np.bool_ else FLOAT if value.dtype == np.float32 else INT
        placement = Placement(array, next_column[array], shape, kind, shared)
        placed.append((name, placement))
        next_column[array] = placement.stop

    for name in TOKEN_WIDE:
        if name in fields:
            place(name, TOKENS, fields[name])
    for name in _table_order(fields):
        place(name, TABLES, fields[name])
    record = list(ROW_RECORD) + [name for name, value in fields.items() if _in_record(name, value)]
    for name in record:
        place(name, ROWS, fields[name])
    record_width = next_column[ROWS]
    for name, value in fields.items():
        if name in SHARED:
            place(name, ROWS, value, shared=True)
        elif name not in record and name not in TOKEN_WIDE and not _is_table(name):
            place(name, ROWS, value)
    extra = sum(1 for name in fields if name.startswith("extra_block_tables["))
    return StateLayout(placements=tuple(placed), widths=tuple((a, max(next_column[a], 1)) for a in ARRAYS),
                       num_extra_tables=extra, record_width=record_width)


def empty_fields(config: ServingConfig) -> dict[str, np.ndarray]:
    """Every field of an empty state, by name, as host arrays in their empty values (the extra KV
    groups' tables one field each): no tokens, null blocks, no drafts, each feature's empty value."""
    prep, rows = config.prep, config.max_num_reqs
    fields = {"token_ids": np.zeros((rows, prep.max_model_len), np.int32),
              "block_table": np.zeros((rows, prep.max_blocks_per_req), np.int32),
              **{name: np.zeros((rows,), np.int32) for name in ROW_RECORD}}
    for name, value in registry.empty_inputs(prep).items():
        if name == "extra_block_tables":
            fields.update({extra_table_name(g): table for g, table in enumerate(value)})
        else:
            fields[name] = value
    fields["errors"] = np.zeros((1,), np.int32)
    return fields


def _is_table(name: str) -> bool:
    return name in ("block_table", "mamba_block_table") or name.startswith("extra_block_tables[")


def _table_order(fields: dict) -> list[str]:
    extra = sorted((name for name in fields if name.startswith("extra_block_tables[")),
                   key=lambda name: int(name[len("extra_block_tables["):-1]))
    return ["block_table", *extra] + (["mamba_block_table"] if "mamba_block_table" in fields else [])


def _in_record(name: str, value: np.ndarray) -> bool:
    """A per-row scalar field (one column): part of the row record."""
    return name not in SHARED and name not in ROW_RECORD and value.ndim == 1 and not _is_table(name)

