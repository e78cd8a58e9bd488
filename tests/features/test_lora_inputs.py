"""LoRA state inputs: `BatchState.empty` fills them, `validate` rejects bad ones naming field and bound."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxprep import BatchState, InvalidBatchError, validate
from support import mrv2_examples as ex


def test_empty_state_has_no_adapters_and_empty_slots():
    state = BatchState.empty(ex.config("v2"))
    assert np.asarray(state.lora_ids).tolist() == [0] * 6
    assert np.asarray(state.lora_slots).tolist() == [-1] * 4


@pytest.mark.parametrize("edit, message", [
    (lambda a: a["lora_ids"].__setitem__(5, -2), "lora_ids at row 5 is -2, which is below 0 \\(0: no LoRA"),
    (lambda a: a["lora_ids"].__setitem__(2, 9),
     "lora_ids at row 2 is 9, which no slot of lora_slots \\[3, -1, 7, -1\\] holds: load the adapter"),
    (lambda a: a["lora_slots"].__setitem__(1, 0),
     "lora_slots\\[1\\] is 0: a slot holds -1 \\(empty\\) or an adapter id"),
    (lambda a: a["lora_slots"].__setitem__(3, -4), "lora_slots\\[3\\] is -4"),
    (lambda a: a["lora_slots"].__setitem__(1, 7), "lora_slots holds adapter 7 in two slots"),
])
def test_bad_lora_inputs_are_rejected_and_nothing_changes(edit, message):
    arrays = ex.arrays(ex.V2_SLOTS)
    edit(arrays)
    state = BatchState.from_numpy(**arrays)
    before = {name: np.array(value) for name, value in state.to_numpy().items()}
    with pytest.raises(InvalidBatchError, match=message):
        validate(state, ex.config("v2"))
    for name, value in state.to_numpy().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)


def test_stale_ids_of_rows_without_work_are_not_checked():
    """V2 keeps a finished request's id in its slot until the slot is reused; only scheduled rows count."""
    arrays = ex.arrays(ex.V2_SLOTS)
    arrays["lora_ids"][0] = 42  # slot 0 is free; 42 is loaded nowhere
    validate(BatchState.from_numpy(**arrays), ex.config("v2"))


def test_missing_or_misshaped_lora_fields_are_named():
    arrays = ex.arrays(ex.V2_SLOTS)
    with pytest.raises(InvalidBatchError, match="BatchState.lora_slots is missing: FeatureConfig.lora needs it"):
        validate(BatchState.from_numpy(**dict(arrays, lora_slots=None)), ex.config("v2"))
    with pytest.raises(InvalidBatchError, match="BatchState.lora_slots has shape \\(3,\\), config expects \\(4,\\)"):
        validate(BatchState.from_numpy(**dict(arrays, lora_slots=np.array([3, -1, 7], np.int32))), ex.config("v2"))
    with pytest.raises(ValueError, match="BatchState.lora_ids has 5 rows, but token_ids has 6"):  # at construction
        dataclasses.replace(BatchState.from_numpy(**arrays), lora_ids=np.zeros(5, np.int32))


def test_lora_slots_of_the_wrong_length_fail_at_trace_time():
    """The unchecked path: a slot table that does not match max_loras fails when the step is traced."""
    from jaxprep import prepare_padded

    state = BatchState.from_numpy(**dict(ex.arrays(ex.V2_SLOTS), lora_slots=np.array([3, -1, 7], np.int32)))
    with pytest.raises(ValueError, match="BatchState.lora_slots has shape \\(3,\\), config expects \\(4,\\)"):
        prepare_padded(state, ex.config("v2"), 16)
