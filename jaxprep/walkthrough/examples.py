"""Built-in batches from docs/semantics.md#examples, as host arrays: used by the demo, the tests and the notebooks."""

from __future__ import annotations

import numpy as np

from jaxprep.config import PrepConfig, cdiv


def sequential_block_table(num_blocks_per_row, width: int) -> np.ndarray:
    """Blocks handed out in order from 1 (block 0 is the null block); entries past a row's blocks are 0.

    ```
    # num_blocks_per_row [2, 1, 3] -> rows [1, 2], [3], [4, 5, 6]
    ```
    """
    table = np.zeros((len(num_blocks_per_row), width), np.int32)
    next_block = 1
    for row, count in enumerate(num_blocks_per_row):
        table[row, :count] = np.arange(next_block, next_block + count)
        next_block += count
    return table


def example_a_config() -> PrepConfig:
    """Example A (docs/semantics.md#example-a-step-1): block size 2, max_model_len 12, budget 10."""
    return PrepConfig(max_num_reqs=3, max_model_len=12, max_num_batched_tokens=10, block_size=2)


def example_a_step1() -> dict[str, np.ndarray]:
    """Three prompts of 3, 2 and 5 tokens, all scheduled whole; rows [1,2], [3], [4,5,6]."""
    config = example_a_config()
    token_ids = np.zeros((3, config.max_model_len), np.int32)
    prompts = [[101, 102, 103], [201, 202], [301, 302, 303, 304, 305, 306, 307, 308]]
    for row, prompt in enumerate(prompts):
        token_ids[row, : len(prompt)] = prompt
    return dict(token_ids=token_ids,
                block_table=sequential_block_table([2, 1, 3], config.max_blocks_per_req),
                num_computed_tokens=np.array([0, 0, 0], np.int32),
                num_scheduled_tokens=np.array([3, 2, 5], np.int32))


def example_a_step2() -> dict[str, np.ndarray]:
    """Step 2: request 0 and 1 decode one token, request 2 prefills its next 3 prompt tokens.

    Rows [1,2], [3,7], [4,5,6,8]; the sampled tokens of step 1 sit after the prompts.
    """
    arrays = example_a_step1()
    arrays["token_ids"][0, 3] = 104
    arrays["token_ids"][1, 2] = 203
    arrays["block_table"][1, 1] = 7
    arrays["block_table"][2, 3] = 8
    arrays["num_computed_tokens"] = np.array([3, 2, 5], np.int32)
    arrays["num_scheduled_tokens"] = np.array([1, 1, 3], np.int32)
    return arrays


def example_b_config() -> PrepConfig:
    """Example B (docs/semantics.md#example-b): block size 16, max_model_len 240, budget 200."""
    return PrepConfig(max_num_reqs=5, max_model_len=240, max_num_batched_tokens=200, block_size=16)


def example_b() -> dict[str, np.ndarray]:
    """Two decodes (54 and 145 computed), two whole prefills (93, 75) and a chunked prefill (30)."""
    config = example_b_config()
    computed = np.array([54, 145, 0, 0, 0], np.int32)
    scheduled = np.array([1, 1, 93, 75, 30], np.int32)
    rng = np.random.default_rng(0)
    token_ids = rng.integers(1, 32000, size=(5, config.max_model_len), dtype=np.int32)
    blocks_per_row = [cdiv(int(c + s), config.block_size) for c, s in zip(computed, scheduled)]
    return dict(token_ids=token_ids,
                block_table=sequential_block_table(blocks_per_row, config.max_blocks_per_req),
                num_computed_tokens=computed, num_scheduled_tokens=scheduled)
