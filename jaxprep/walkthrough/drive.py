"""Drives requests step by step through the real serving pieces until every request has finished.

Each step: the host `Scheduler` (vLLM V1's manner: running requests first, chunked prefill under the
token budget, blocks from a free list) decides; `ServingBatch` applies its updates to the device
state with the checked, donating transitions; `prepare_record` runs `prepare_inputs` on that state;
a stand-in model "samples" the next token; `ServingBatch.record_sampled` appends it on the device.

The stand-in model makes token ids read like addresses: request ``i``'s token at position ``p`` is
``(i + 1) * base + p + 1`` with ``base`` the power of ten above ``max_model_len``.

```
# max_model_len 12 -> base 100: request 0's prompt [101, 102, 103], its first sampled token 104
```
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np

from jaxprep.config import PrepConfig, cdiv
from jaxprep.serving import NO_TOKEN, Request, Scheduler, ServingBatch, ServingConfig, StepUpdates
from jaxprep.walkthrough.record import NO_REQUEST, StepRecord, prepare_record


@dataclasses.dataclass(frozen=True, kw_only=True)
class WalkthroughOptions:
    """The requests and the batch limits; the defaults are example A (docs/semantics.md#example-a-step-1), run to the
    end.

    Attributes:
      prompt_lens: prompt tokens of each request (all arrive before step 1).
      max_tokens: output tokens each request may sample; one value applies to every request.
      block_size, max_model_len, budget: ``PrepConfig.block_size``, ``max_model_len`` and
        ``max_num_batched_tokens``.
    """

    prompt_lens: tuple[int, ...] = (3, 2, 8)
    max_tokens: tuple[int, ...] = (4, 2, 4)
    block_size: int = 2
    max_model_len: int = 12
    budget: int = 10

    def __post_init__(self):
        object.__setattr__(self, "prompt_lens", tuple(int(n) for n in self.prompt_lens))
        max_tokens = tuple(int(n) for n in self.max_tokens)
        if len(max_tokens) == 1:
            max_tokens *= len(self.prompt_lens)
        object.__setattr__(self, "max_tokens", max_tokens)
        if not self.prompt_lens:
            raise ValueError("WalkthroughOptions.prompt_lens must name at least one request")
        if len(max_tokens) != len(self.prompt_lens):
            raise ValueError(f"WalkthroughOptions.max_tokens has {len(max_tokens)} values for "
                             f"{len(self.prompt_lens)} prompts (give one value or one per prompt)")
        for i, (prompt, tokens) in enumerate(zip(self.prompt_lens, max_tokens)):
            if not 0 < prompt < self.max_model_len:
                raise ValueError(f"WalkthroughOptions.prompt_lens[{i}]={prompt} must lie in "
                                 f"[1, max_model_len={self.max_model_len})")
            if tokens < 1:
                raise ValueError(f"WalkthroughOptions.max_tokens[{i}]={tokens} must be >= 1")

    @property
    def num_blocks(self) -> int:
        """A KV cache that holds every request whole (no preemption), plus the null block."""
        lengths = (min(p + t, self.max_model_len) for p, t in zip(self.prompt_lens, self.max_tokens))
        return 1 + sum(cdiv(n, self.block_size) for n in lengths)

    def prep_config(self) -> PrepConfig:
        return PrepConfig(max_num_reqs=len(self.prompt_lens), max_model_len=self.max_model_len,
                          max_num_batched_tokens=self.budget, block_size=self.block_size, num_blocks=self.num_blocks)

    @property
    def token_base(self) -> int:
        """The power of ten above max_model_len: ids of different requests never collide."""
        return 10 ** len(str(self.max_model_len))

    def token_id(self, request: int, position: int) -> int:
        """The stand-in model's token of ``request`` at ``position``."""
        return (request + 1) * self.token_base + position + 1

    def prompt(self, request: int) -> list[int]:
        return [self.token_id(request, p) for p in range(self.prompt_lens[request])]


def walk(options: WalkthroughOptions | None = None, max_steps: int | None = None) -> Iterator[StepRecord]:
    """Yields one `StepRecord` per step until every request has finished (or ``max_steps``)."""
    options = options or WalkthroughOptions()
    prep = options.prep_config()
    config = ServingConfig(prep=prep, decode_steps=1)
    scheduler, batch = Scheduler(config), ServingBatch(config)
    for i, max_tokens in enumerate(options.max_tokens):
        scheduler.add_request(Request(request_id=i, prompt_token_ids=options.prompt(i), max_tokens=max_tokens))
    requests_by_row, previous, number = {}, None, 0
    while scheduler.has_unfinished and (max_steps is None or number < max_steps):
        number += 1
        out = scheduler.schedule()
        freed = {requests_by_row.pop(row).request_id: _blocks_of(previous, row) for row in out.finished_rows}
        requests_by_row.update({r.row: r for r in scheduler.running})
        batch.apply_updates(StepUpdates.build(config, finish=out.finished_rows, add=out.new_requests,
                                              append=out.new_block_ids, num_scheduled_tokens=out.num_scheduled_tokens))
        record = _record(batch, requests_by_row, number)
        new_blocks = {requests_by_row[row].request_id: list(blocks) for row, blocks in out.new_block_ids.items()}
        new_blocks.update({requests_by_row[r["row"]].request_id: list(r["block_ids"]) for r in out.new_requests})
        appended = _sample_and_record(record, batch, options)
        tokens = np.full((1, prep.max_num_reqs), NO_TOKEN, np.int32)  # [iterations, rows] as the scheduler reads them
        tokens[0, list(appended)] = list(appended.values())
        done = scheduler.update(out, tokens, config.eos_token_id)
        sampled = {requests_by_row[row].request_id: token for row, token in appended.items()}
        previous = dataclasses.replace(record, sampled=sampled, new_blocks=new_blocks, freed=freed,
                                       finished=tuple(r.request_id for r in done))
        yield previous


def _blocks_of(record: StepRecord, row: int) -> list[int]:
    """The blocks a row held after ``record``'s step: those of its computed + scheduled tokens."""
    num_blocks = cdiv(int(record.computed[row] + record.scheduled[row]), record.config.block_size)
    return [int(b) for b in record.state["block_table"][row, :num_blocks]]


def _record(batch: ServingBatch, requests_by_row: dict, number: int) -> StepRecord:
    host = batch.state.to_numpy()
    arrays = {name: host[name] for name in ("token_ids", "block_table", "num_computed_tokens", "num_scheduled_tokens")}
    rows = range(batch.config.max_num_reqs)
    request_ids = [requests_by_row[row].request_id if row in requests_by_row else NO_REQUEST for row in rows]
    prompt_lens = [len(requests_by_row[row].prompt_token_ids) if row in requests_by_row else 0 for row in rows]
    return prepare_record(arrays, batch.config.prep, prompt_lens=prompt_lens, request_ids=request_ids,
                          num_tokens=host["num_tokens"], number=number)


def _sample_and_record(record: StepRecord, batch: ServingBatch, options: WalkthroughOptions) -> dict[int, int]:
    """The stand-in model's next token for every batch row; the device keeps only the rows that
    reached the end of their known tokens (a chunked prefill's sample is discarded, docs/semantics.md#logits-indices).
    Returns {state row: token appended}."""
    rows, seq_lens = record.batch_rows, record.unpadded("seq_lens")
    tokens = np.zeros((len(record.outputs["idx_mapping"]), 1), np.int32)
    for b, (row, seq_len) in enumerate(zip(rows, seq_lens)):
        tokens[b, 0] = options.token_id(int(record.request_ids[row]), int(seq_len))
    before = record.num_tokens.copy()
    batch.record_sampled(record.outputs["idx_mapping"], tokens, np.ones(len(tokens), np.int32))
    after = batch.state.to_numpy()
    appended = np.flatnonzero(after["num_tokens"] > before)
    return {int(row): int(after["token_ids"][row, before[row]]) for row in appended}


def run_walkthrough(options: WalkthroughOptions | None = None, max_steps: int | None = None) -> list[StepRecord]:
    """Every step of `walk`, as a list."""
    return list(walk(options, max_steps))

