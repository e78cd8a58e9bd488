"""`ServingState`: the serving loop's device state as three int32 arrays, read and written by field.

Every field of the state (`jaxprep.BatchState`'s tables, the serving counters, the error word) is a
range of columns of one of three arrays (`jaxprep.serving.state_layout`), so a jitted step takes and
donates three arrays, not one per field (on a GPU each array in or out of a call costs the calling
thread ~5 µs). Inside a jit, reading a field is a slice that XLA fuses into its reader; writing one is
an in-place scatter or dynamic-update-slice of its columns (the state is donated), never a copy of an
array:

- `ServingState.field` / ``batch`` / ``num_tokens`` ...: views (floats and bools decoded);
- `ServingState.replace`: whole fields (a per-row column, the LoRA slots);
- `ServingState.write_cells`: single entries of any fields, grouped into one scatter per array;
- `ServingState.write_records`: whole row records (the per-row scalars) of a few rows, one scatter;
- `ServingState.fill_rows`: every column of some rows of one array (the block tables of a freed row);
- `ServingState.with_error_bits`: bits ORed into the error word.

Every write maps an index outside its field (row outside the state, column outside the field) to
the dropped sentinel row, so no write lands in a neighbouring field.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxprep.serving.config import ServingConfig
from jaxprep.serving.state_layout import (
    ARRAYS,
    BOOL,
    FLOAT,
    ROWS,
    SERVING_FIELDS,
    StateLayout,
    empty_fields,
    extra_table_name,
    layout_of,
)
from jaxprep.state import BatchState

BATCH_FIELDS = frozenset(f.name for f in dataclasses.fields(BatchState))


@dataclasses.dataclass(frozen=True)
class Cells:
    """Entries of one field to write: ``field[rows, columns] = values`` (``columns`` index the field's
    flattened per-row shape; None: column 0, a per-row scalar). ``rows``, ``columns`` and ``values``
    broadcast together; an entry outside the field is dropped."""

    name: str
    rows: jax.Array
    values: jax.Array | int | float | bool
    columns: jax.Array | None = None


@dataclasses.dataclass(frozen=True)
class ServingState:
    """The serving state: every leaf an int32 [max_num_reqs, width] device array (`state_layout`)."""

    tokens: jax.Array  # [max_num_reqs, _] token_ids (+ mrope_positions, is_token_ids)
    tables: jax.Array  # [max_num_reqs, _] block_table (+ the other KV groups', the Mamba table)
    rows: jax.Array  # [max_num_reqs, _] counters and per-row feature values; row 0: errors, lora_slots
    layout: StateLayout = dataclasses.field(metadata=dict(static=True))

    def __post_init__(self):
        _check_arrays(self)

    # --- building --------------------------------------------------------------------------------

    @classmethod
    def empty(cls, config: ServingConfig) -> ServingState:
        """No requests: every row free, every feature's value empty."""
        return cls.from_fields(layout_of(config), empty_fields(config))

    @classmethod
    def from_fields(cls, layout: StateLayout, fields: dict) -> ServingState:
        """The state holding ``fields`` (host arrays by field name, every field of ``layout``; the extra KV
        groups' tables by `extra_table_name`), placed on the default device."""
        num_rows = np.shape(fields["token_ids"])[0]
        arrays = {name: np.zeros((num_rows, layout.width(name)), np.int32) for name in ARRAYS}
        for name, place in layout.placements:
            value = _encode_host(np.asarray(fields[name]), place.kind)
            if place.shared:
                arrays[place.array][0, place.start:place.stop] = value.reshape(-1)
            else:
                arrays[place.array][:, place.start:place.stop] = value.reshape(num_rows, place.width)
        return cls(**jax.device_put(arrays), layout=layout)

    # --- reading ---------------------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return self.rows.shape[0]

    def field(self, name: str) -> jax.Array:
        """Field ``name`` as its own array ([rows, *shape], or its shape for a shared value), decoded."""
        place = self.layout[name]
        array = getattr(self, place.array)
        if place.shared:
            value = array[0, place.start:place.stop].reshape(place.shape)
        elif place.start == 0 and place.stop == array.shape[1] and len(place.shape) == 1:
            value = array  # the whole array: no slice
        else:
            value = array[:, place.start:place.stop].reshape((array.shape[0], *place.shape))
        return _decode(value, place.kind)

    @functools.cached_property
    def batch(self) -> BatchState:
        """The `BatchState` the step is prepared from (views of the state's columns)."""
        values = {name: self.field(name) for name in self.layout.by_name if name in BATCH_FIELDS}
        if self.layout.num_extra_tables:
            values["extra_block_tables"] = tuple(self.field(extra_table_name(g))
                                                 for g in range(self.layout.num_extra_tables))
        return BatchState(**values)

    @property
    def num_tokens(self) -> jax.Array:
        """[max_num_reqs] prompt + sampled tokens in token_ids; 0 = free row."""
        return self.field("num_tokens")

    @property
    def stop_len(self) -> jax.Array:
        """[max_num_reqs] num_tokens at which the request stops (max_model_len: no stop)."""
        return self.field("stop_len")

    @property
    def num_blocks(self) -> jax.Array:
        """[max_num_reqs] allocated columns of KV group 0's block table."""
        return self.field("num_blocks")

    @property
    def num_draft_tokens(self) -> jax.Array:
        """[max_num_reqs] drafts scheduled this step (``batch.num_draft_tokens``, the one copy)."""
        return self.field("num_draft_tokens")

    @property
    def errors(self) -> jax.Array:
        """[1] the error word of the unchecked device transitions (`ERROR_BITS`), 0 if none: the OR of
        the column's rows (row 0 of each data-parallel rank holds that rank's word, every other row 0)."""
        place = self.layout["errors"]
        column = self.rows[:, place.start]
        return jax.lax.reduce(column, np.int32(0), jax.lax.bitwise_or, (0,))[None]

    def to_numpy(self) -> dict[str, np.ndarray]:
        """Host copies of every field by name, as `jaxprep.BatchState.to_numpy` and the serving counters
        give them (``extra_block_tables`` a tuple of tables, ``errors`` the [1] word)."""
        host = {name: np.asarray(getattr(self, name)) for name in ARRAYS}
        out = {}
        for name, place in self.layout.placements:
            array = host[place.array]
            if place.shared:
                value = array[0, place.start:place.stop].reshape(place.shape)
            else:
                value = array[:, place.start:place.stop].reshape((array.shape[0], *place.shape))
            out[name] = _decode_host(np.ascontiguousarray(value), place.kind)
        out["errors"] = np.bitwise_or.reduce(host[ROWS][:, self.layout["errors"].start])[None].astype(np.int32)
        if self.layout.num_extra_tables:
            out["extra_block_tables"] = tuple(out.pop(extra_table_name(g))
                                              for g in range(self.layout.num_extra_tables))
        return out

    # --- writing (each returns a new state; inside a donating jit, in place) ----------------------

    def replace(self, **values) -> ServingState:
        """Whole fields set: ``values[name]`` broadcast to the field's shape ([rows, *shape], or its shape for
        a shared value). One scatter per array, whatever the number of fields: it reads nothing of the
        array it writes, so XLA never keeps an old copy of it alive."""
        return self.write_cells([self._whole(name, value) for name, value in values.items()])

    def replace_where(self, present: jax.Array, **values) -> ServingState:
        """`replace` where the 0-d bool ``present`` holds, else nothing written (no read of the old values:
        the writes go to the dropped sentinel row)."""
        return self.write_cells([self._whole(name, value, present) for name, value in values.items()])

    def _whole(self, name: str, value, present: jax.Array | bool = True) -> Cells:
        """The `Cells` of every entry of field ``name`` (row 0 only for a shared field)."""
        place = self.layout[name]
        num_rows = 1 if place.shared else self.num_rows
        rows = jnp.where(present, jnp.arange(num_rows, dtype=jnp.int32), -1)[:, None]
        values = jnp.broadcast_to(jnp.asarray(value), place.shape if place.shared else (num_rows, *place.shape))
        columns = jnp.arange(place.width, dtype=jnp.int32)[None, :]
        return Cells(name, rows, values.reshape(num_rows, place.width), columns)

    def write_cells(self, cells: Sequence[Cells], mode: str = "set") -> ServingState:
        """``field[rows, columns] = values`` (``mode`` "set"; "add" and "max" on int fields) for every `Cells`,
        in one scatter per array. Entries outside their field are dropped. Entries of one call must not
        write one place twice unless with the same value ("set": which one lands is unspecified)."""
        parts = {name: [] for name in ARRAYS}
        for cell in cells:
            place = self.layout[cell.name]
            if mode != "set" and place.kind == FLOAT:
                raise ValueError(f"write_cells(mode={mode!r}) on the float field {cell.name}")
            array = getattr(self, place.array)
            rows = jnp.asarray(cell.rows, jnp.int32)
            columns = jnp.zeros_like(rows) if cell.columns is None else jnp.asarray(cell.columns, jnp.int32)
            rows, columns = jnp.broadcast_arrays(rows, columns)
            values = jnp.broadcast_to(_encode(jnp.asarray(cell.values), place.kind), rows.shape)
            inside = (rows >= 0) & (rows < (1 if place.shared else array.shape[0])) & (columns >= 0) & \
                (columns < place.width)
            parts[place.array].append((jnp.where(inside, rows, array.shape[0]).reshape(-1),
                                       (place.start + jnp.where(inside, columns, 0)).reshape(-1), values.reshape(-1)))
        arrays = {}
        for name, written in parts.items():
            array = getattr(self, name)
            if written:
                rows, columns, values = (jnp.concatenate(p) if len(written) > 1 else p[0] for p in zip(*written))
                arrays[name] = getattr(array.at[rows, columns], mode)(values, mode="drop")
        return dataclasses.replace(self, **arrays)

    def write_array(self, array: str, rows: jax.Array, columns: jax.Array, values: jax.Array,
                    mode: str = "set") -> ServingState:
        """``array[rows, columns] = values`` at absolute columns of one array: for writes whose column the
        caller has already bounded to its field (`write_cells` does it by field); entries outside the
        array are dropped."""
        current = getattr(self, array)
        rows, columns = jnp.asarray(rows, jnp.int32), jnp.asarray(columns, jnp.int32)
        inside = (rows >= 0) & (rows < current.shape[0]) & (columns >= 0) & (columns < current.shape[1])
        target = current.at[jnp.where(inside, rows, current.shape[0]), jnp.where(inside, columns, 0)]
        return dataclasses.replace(self, **{array: getattr(target, mode)(jnp.asarray(values, jnp.int32), mode="drop")})

    def write_records(self, rows: jax.Array, records: jax.Array) -> ServingState:
        """The row record (the per-row scalar fields, `StateLayout.record_fields` order, each encoded as
        `record_column` gives it) of ``rows`` [n] set to ``records`` [n, record_width]; rows outside the
        state are dropped."""
        rows = jnp.asarray(rows, jnp.int32)
        rows = jnp.where((rows >= 0) & (rows < self.num_rows), rows, self.num_rows)
        width = self.layout.record_width
        return dataclasses.replace(self, rows=self.rows.at[rows, :width].set(records, mode="drop"))

    def record_block(self):
        """Every row's record as a `RecordBlock` to edit (a [rows, record_width]
        copy of the first columns of ``rows``)."""
        return RecordBlock(self.layout, self.rows[:, : self.layout.record_width])

    def with_record_block(self, block) -> ServingState:
        """The state with every row's record set from ``block`` (one dynamic-update-slice of ``rows``)."""
        if block.values.shape == self.rows.shape:
            return dataclasses.replace(self, rows=block.values)
        return dataclasses.replace(self, rows=jax.lax.dynamic_update_slice(self.rows, block.values,
                                                                           (jnp.int32(0), jnp.int32(0))))

    def records(self, rows: jax.Array) -> jax.Array:
        """[n, record_width] the row records of ``rows`` (encoded; a row outside the state reads 0s)."""
        return jnp.take(self.rows[:, : self.layout.record_width], jnp.asarray(rows, jnp.int32), axis=0, mode="fill",
                        fill_value=0)

    def fill_rows(self, array: str, rows: jax.Array, value: int, start: int = 0,
                  stop: int | None = None) -> ServingState:
        """Columns ``[start, stop)`` (default: all) of ``rows`` of ``array`` set to ``value``."""
        current = getattr(self, array)
        stop = current.shape[1] if stop is None else stop
        rows = jnp.asarray(rows, jnp.int32)
        rows = jnp.where((rows >= 0) & (rows < self.num_rows), rows, self.num_rows)
        block = jnp.full((rows.shape[0], stop - start), value, jnp.int32)
        return dataclasses.replace(self, **{array: current.at[rows, start:stop].set(block, mode="drop")})

    def with_error_bits(self, bits: jax.Array) -> ServingState:
        """The error word with ``bits`` ORed in (row 0 of its column)."""
        column = self.layout["errors"].start
        word = self.rows[0, column] | jnp.asarray(bits, jnp.int32)
        return dataclasses.replace(self, rows=self.rows.at[0, column].set(word))

    def record_column(self, name: str) -> int:
        """The column of per-row scalar ``name`` in a row record."""
        return self.layout[name].start


def assemble(layout: StateLayout, old: jax.Array, new: dict) -> jax.Array:
    """Row records [n, record_width]: ``old``'s columns, replaced by ``new[name]`` (a decoded value, [n] or a
    scalar) for each per-row field ``name`` the state has (others are skipped), in one stack.

    ```
    # record fields (num_computed_tokens, num_scheduled_tokens, ...), old [[4, 1, ...]], new {num_scheduled_tokens: 0}
    #   -> [[4, 0, ...]]
    ```
    """
    n = old.shape[0]
    columns = []
    for i, name in enumerate(layout.record_fields):
        value = new.get(name)
        columns.append(old[:, i] if value is None else jnp.broadcast_to(encode(value, layout[name].kind), (n,)))
    return jnp.stack(columns, axis=1)


@dataclasses.dataclass(frozen=True)
class RecordBlock:
    """Every row's record (its per-row scalars as stored, `StateLayout.record_fields`) while an update edits
    them: a small [max_num_reqs, record_width] working copy, read from the state once and written back once
    (`ServingState.record_block`, ``with_record_block``), so the edits in between never read an array of
    the state after writing it (which would make XLA keep a copy of the array)."""

    layout: StateLayout
    values: jax.Array  # [max_num_reqs, record_width] int32

    @property
    def num_rows(self) -> int:
        return self.values.shape[0]

    def field(self, name: str) -> jax.Array:
        """[max_num_reqs] per-row field ``name``, as stored (int32)."""
        return self.values[:, self.layout[name].start]

    def gather(self, rows: jax.Array) -> jax.Array:
        """[n, record_width] the records of ``rows`` (the sentinel row reads 0s)."""
        return jnp.take(self.values, rows, axis=0, mode="fill", fill_value=0)

    def write(self, rows: jax.Array, records: jax.Array) -> RecordBlock:
        """``records`` [n, record_width] written to ``rows`` (scatter indices: the sentinel is dropped)."""
        return dataclasses.replace(self, values=self.values.at[rows].set(records, mode="drop"))

    def raise_to(self, name: str, rows: jax.Array, values: jax.Array) -> RecordBlock:
        """``field[rows] = max(field[rows], values)`` (the sentinel row is dropped)."""
        column = self.layout[name].start
        return dataclasses.replace(self, values=self.values.at[rows, column].max(values, mode="drop"))

    def replace_where(self, present: jax.Array, **fields) -> RecordBlock:
        """Whole per-row fields set where the 0-d ``present`` holds."""
        new = {name: jnp.where(present, encode(value, self.layout[name].kind), self.field(name))
               for name, value in fields.items()}
        return dataclasses.replace(self, values=assemble(self.layout, self.values, new))


def encode(value: jax.Array, kind: str) -> jax.Array:
    """A field's value as the int32 the state stores: float32 bit patterns, bools as 0 / 1."""
    return _encode(jnp.asarray(value), kind)


def _encode(value: jax.Array, kind: str) -> jax.Array:
    if kind == FLOAT:
        return jax.lax.bitcast_convert_type(value.astype(jnp.float32), jnp.int32)
    return value.astype(jnp.int32)


def _decode(value: jax.Array, kind: str) -> jax.Array:
    if kind == FLOAT:
        return jax.lax.bitcast_convert_type(value, jnp.float32)
    if kind == BOOL:
        return value != 0
    return value


def _encode_host(value: np.ndarray, kind: str) -> np.ndarray:
    if kind == FLOAT:
        return value.astype(np.float32).view(np.int32)
    return value.astype(np.int32)


def _decode_host(value: np.ndarray, kind: str) -> np.ndarray:
    if kind == FLOAT:
        return value.view(np.float32)
    if kind == BOOL:
        return value != 0
    return value


def _check_arrays(state: ServingState) -> None:
    """Each array int32 [rows, its layout width], all with one row count (concrete arrays only: JAX
    rebuilds the pytree with tracers and other leaves while tracing). It runs on every jitted call's
    state too (`_rebuild`): the common case is one comparison chain, the message only on a mismatch."""
    tokens, tables, rows = arrays = (state.tokens, state.tables, state.rows)
    for array in arrays:
        if isinstance(array, jax.core.Tracer) or not isinstance(array, (np.ndarray, jax.Array)):
            return
    shape = tokens.shape
    num_rows = shape[0] if len(shape) == 2 else None
    width_tokens, width_tables, width_rows = state.layout.array_widths
    if num_rows is not None and shape[1] == width_tokens and tables.shape == (num_rows, width_tables) \
            and rows.shape == (num_rows, width_rows) and tokens.dtype == tables.dtype == rows.dtype == np.int32:
        return
    for name, array, width in zip(ARRAYS, arrays, state.layout.array_widths):
        if array.dtype != np.int32 or array.ndim != 2 or array.shape != (num_rows, width):
            raise ValueError(f"ServingState.{name} has shape {array.shape} and dtype {array.dtype}, expected int32 "
                             f"[{num_rows}, {width}] (build it with ServingState.empty)")


def _rebuild(layout: StateLayout, arrays) -> ServingState:
    """A `ServingState` from its pytree children, as JAX rebuilds one from every jitted call's outputs: the
    three arrays and the layout written into a new object's ``__dict__`` at once, then `_check_arrays`, as
    ``__init__`` and ``__post_init__`` do (a frozen dataclass's ``__init__`` sets each field by
    ``object.__setattr__``: with the check, ~5 µs a call before, on this project's CPU host)."""
    state = object.__new__(ServingState)
    state.__dict__.update(zip(ARRAYS, arrays), layout=layout)
    _check_arrays(state)
    return state


_ARRAY_KEYS = tuple(jax.tree_util.GetAttrKey(name) for name in ARRAYS)
jax.tree_util.register_pytree_with_keys(
    ServingState, lambda state: (tuple(zip(_ARRAY_KEYS, (state.tokens, state.tables, state.rows))), state.layout),
    _rebuild, flatten_func=lambda state: ((state.tokens, state.tables, state.rows), state.layout))


__all__ = ["Cells", "RecordBlock", "SERVING_FIELDS", "ServingState", "assemble", "encode"]
