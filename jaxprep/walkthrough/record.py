"""`StepRecord`: one prepared step with everything a reader wants to see, checked against the reference.

`prepare_record` runs the real jitted `prepare_inputs` on a batch state, takes ``token_indices``
from the NumPy reference (jaxprep has none: it gathers by state row, see DIVERGENCES.md) and
checks every output against that reference, so a walkthrough never shows a number nobody checked.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxprep.config import PrepConfig
from jaxprep.metadata import step_fields
from jaxprep.prepare import prepare_inputs
from jaxprep.reference import pad_reference, prepare_reference
from jaxprep.state import BatchState

OUTPUT_FIELDS = ("positions", "token_indices", "input_ids", "slot_mapping", "query_start_loc", "seq_lens",
                 "logits_indices", "idx_mapping")
"""The step outputs a walkthrough prints, in the order the seed documents derive them."""

NO_REQUEST = -1
"""`StepRecord.request_ids` entry of a free row (and `KVCacheView` entry of a free slot)."""


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step: the state ``prepare_inputs`` read, what it returned, and what happened next.

    Per-row arrays are indexed by state row; ``request_ids`` says which request holds each row.
    """

    number: int  # 1-based step number
    config: PrepConfig
    state: dict[str, np.ndarray]  # host copy of the BatchState read: token_ids, block_table, num_*_tokens
    request_ids: np.ndarray  # [max_num_reqs] request in each row; NO_REQUEST: free row
    prompt_lens: np.ndarray  # [max_num_reqs] prompt tokens of each row's request; 0: free row
    num_tokens: np.ndarray  # [max_num_reqs] known tokens (prompt + outputs) before the step
    outputs: dict[str, np.ndarray]  # padded step outputs (OUTPUT_FIELDS but token_indices) + scalars
    token_indices: np.ndarray  # [num_actual_tokens] from the NumPy reference: position + state_row * M
    matches_reference: bool  # every padded output equals the reference's
    num_tokens_padded: int  # the token bucket
    sampled: dict[int, int] | None = None  # request -> token appended; None: no model ran this step
    new_blocks: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # request -> blocks this step
    freed: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # request -> blocks freed before the step
    finished: tuple[int, ...] = ()  # requests that finished with this step's token

    @property
    def computed(self) -> np.ndarray:
        return self.state["num_computed_tokens"]

    @property
    def scheduled(self) -> np.ndarray:
        return self.state["num_scheduled_tokens"]

    @property
    def num_actual_tokens(self) -> int:
        return int(self.outputs["num_actual_tokens"])

    @property
    def num_reqs(self) -> int:
        return int(self.outputs["num_reqs"])

    @property
    def batch_rows(self) -> np.ndarray:
        """State rows in the batch, in batch order: ``idx_mapping`` without its padding."""
        return self.outputs["idx_mapping"][: self.num_reqs]

    def unpadded(self, name: str) -> np.ndarray:
        """An output cut to its real entries: per token, per request, or ``query_start_loc``'s R + 1."""
        if name == "token_indices":
            return self.token_indices
        value = self.outputs[name]
        if name in ("positions", "input_ids", "slot_mapping"):
            return value[: self.num_actual_tokens]
        return value[: self.num_reqs + (name == "query_start_loc")]

    def kind(self, row: int) -> str:
        """What the row does this step, in the seed documents' words."""
        computed, scheduled, prompt = int(self.computed[row]), int(self.scheduled[row]), int(self.prompt_lens[row])
        if scheduled == 0:
            return "idle" if self.request_ids[row] >= 0 else "free"
        if computed >= prompt:
            return "decode"
        if computed + scheduled < prompt:
            return f"chunked prefill ({computed + scheduled} of {prompt}, sample discarded)"
        return "prefill" if computed == 0 else f"last prefill chunk ({computed}..{prompt - 1})"


def prepare_record(arrays: dict[str, np.ndarray], config: PrepConfig, *, prompt_lens, request_ids=None,
                   num_tokens=None, number: int = 1) -> StepRecord:
    """Prepares the step of ``arrays`` (BatchState.from_numpy keywords) and checks it against the reference.

    ``prompt_lens`` [max_num_reqs] (0 for free rows) only labels the rows; ``request_ids`` defaults
    to the row numbers of rows with a prompt; ``num_tokens`` (known tokens) defaults to
    ``max(computed + scheduled, prompt)``.
    """
    arrays = {name: np.array(value) for name, value in arrays.items()}
    prompt_lens = np.asarray(prompt_lens, np.int64)
    if request_ids is None:
        request_ids = np.where(prompt_lens > 0, np.arange(len(prompt_lens)), NO_REQUEST)
    if num_tokens is None:
        num_tokens = np.maximum(arrays["num_computed_tokens"] + arrays["num_scheduled_tokens"], prompt_lens)
    step = prepare_inputs(BatchState.from_numpy(**arrays), config, check=True)
    outputs = _host_outputs(step)
    ref = prepare_reference(arrays["token_ids"], arrays["block_table"], arrays["num_computed_tokens"],
                            arrays["num_scheduled_tokens"], config.block_size)
    expected = pad_reference(ref, step.num_tokens_padded, step.num_reqs_padded)
    matches = all(np.array_equal(outputs[name], np.asarray(value)) for name, value in expected.items())
    return StepRecord(number=number, config=config, state=arrays, request_ids=np.asarray(request_ids, np.int64),
                      prompt_lens=prompt_lens, num_tokens=np.asarray(num_tokens, np.int64), outputs=outputs,
                      token_indices=ref["token_indices"], matches_reference=matches,
                      num_tokens_padded=step.num_tokens_padded)


def _host_outputs(step) -> dict[str, np.ndarray]:
    return {name: np.asarray(value) for name, value in step_fields(step).items()}
