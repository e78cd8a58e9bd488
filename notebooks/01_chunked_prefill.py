# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chunked prefill, step by step
#
# Before every forward pass, a serving engine turns its batch state (a token table, a block table,
# and per request how many tokens are already computed and how many are scheduled now) into the
# model's inputs (`input_ids`, `positions`) and the attention metadata (`query_start_loc`,
# `seq_lens`, `slot_mapping`, ...). This notebook follows example A (docs/semantics.md#example-a-step-1), three requests
# with
# prompts of 3, 2 and 8 tokens, block size 2, `max_model_len` 12 and a budget of 10 tokens per step,
# until every request has finished.
#
# Nothing below is drawn by hand. Each step runs the real pieces: the host `Scheduler` decides,
# `ServingBatch` applies its updates to the device state, `jaxprep.prepare_inputs` (jitted) builds the
# step, and a stand-in model "samples" the next token. Request *i*'s token at position *p* is
# `(i + 1) * 100 + p + 1`, so a token id tells you where it sits: 305 is request 2, position 4.
# Every output is checked against the NumPy reference, and the cells below assert the values that
# docs/semantics.md gives, so a wrong number fails the notebook.

# %%
from jaxprep.walkthrough import (
    WalkthroughOptions,
    attention_pattern,
    format_step,
    kv_cache_view,
    plotting,
    run_walkthrough,
)

options = WalkthroughOptions(prompt_lens=(3, 2, 8), max_tokens=(4, 2, 4), block_size=2, max_model_len=12, budget=10)
records = run_walkthrough(options)
print(f"{len(records)} steps; every output matches the NumPy reference: {all(r.matches_reference for r in records)}")
assert len(records) == 5 and all(r.matches_reference for r in records)

# %% [markdown]
# ## Step 1: two whole prompts and a chunk
#
# The scheduler hands out the budget in arrival order: request 0 takes its 3 prompt tokens, request 1
# its 2, and request 2 gets the 5 tokens left, a **chunk** of its 8-token prompt. Blocks come from a
# free list in order (block 0 is the null block, never handed out): `cdiv(3, 2) = 2` blocks for
# request 0, 1 for request 1, `cdiv(5, 2) = 3` for request 2.
#
# Reading the outputs:
# - `positions`: each scheduled token's position in its request, `computed + index inside the request`;
# - `token_indices`: where that token sits in the flattened token table, `row * 12 + position`
#   (from the reference; jaxprep gathers by row and position directly);
# - `input_ids`: the token ids read there;
# - `slot_mapping`: where the token's K/V is written in the paged cache,
#   `block_table[row, position // 2] * 2 + position % 2`;
# - `query_start_loc`: where each request's tokens start in the flat batch; `seq_lens`: tokens of
#   context each request attends to after this step (`computed + scheduled`);
# - `logits_indices`: the last token of each request, whose logits are sampled. Request 2 is
#   still inside its prompt, so its sample is thrown away (docs/semantics.md#logits-indices).

# %%
step1 = records[0]
print(format_step(step1))

# %%
# Example A, step 1 (docs/semantics.md#example-a-step-1)
assert step1.unpadded("positions").tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
assert step1.token_indices.tolist() == [0, 1, 2, 12, 13, 24, 25, 26, 27, 28]
assert step1.unpadded("input_ids").tolist() == [101, 102, 103, 201, 202, 301, 302, 303, 304, 305]
assert step1.unpadded("slot_mapping").tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
assert step1.unpadded("query_start_loc").tolist() == [0, 3, 5, 10]
assert step1.unpadded("seq_lens").tolist() == [3, 2, 5]
assert step1.unpadded("logits_indices").tolist() == [2, 4, 9]
assert step1.state["block_table"][:, :3].tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
assert step1.sampled == {0: 104, 1: 203}  # request 2's sample is discarded: C + S = 5 < 8

# %% [markdown]
# The same step as pictures: the token table (what is scheduled now), the block table, the KV-cache
# slots after the step, and who attends to what. In the attention pattern each query token sees the
# keys of its own request up to its own position: a lower-triangular block per request.

# %%
plotting.say_where_figures_go()  # as a script: one line saying the figures are not shown here

# %%
plotting.plot_step(step1)

# %% [markdown]
# ## Step 2: two decodes and the last chunk
#
# Running requests go first. Requests 0 and 1 each decode one token (the one sampled in step 1);
# request 2 schedules the 3 prompt tokens it has left. Request 1's position 2 needs a second block
# (7, the next free one), and so does request 2's position 6 (8). Only 5 tokens run, so the step is
# padded to the 8-token bucket: padded tokens get position 0, input id 0 and slot -1 (`PAD_SLOT_ID`:
# the kernel writes nothing there).

# %%
step2 = records[1]
print(format_step(step2))

# %%
# Example A, step 2 (docs/semantics.md#example-a-step-2)
assert step2.unpadded("positions").tolist() == [3, 2, 5, 6, 7]
assert step2.token_indices.tolist() == [3, 14, 29, 30, 31]
assert step2.unpadded("input_ids").tolist() == [104, 203, 306, 307, 308]
assert step2.unpadded("slot_mapping").tolist() == [5, 14, 13, 16, 17]
assert step2.unpadded("query_start_loc").tolist() == [0, 1, 2, 5]
assert step2.unpadded("seq_lens").tolist() == [4, 3, 8]
assert step2.unpadded("logits_indices").tolist() == [0, 1, 4]
assert step2.state["block_table"][:, :4].tolist() == [[1, 2, 0, 0], [3, 7, 0, 0], [4, 5, 6, 8]]
assert step2.num_tokens_padded == 8 and step2.outputs["slot_mapping"][5:].tolist() == [-1, -1, -1]
assert step2.sampled == {0: 105, 1: 204, 2: 309} and step2.finished == (1,)

# %% [markdown]
# Request 2's three query tokens (positions 5, 6, 7) read the K/V of positions 0..4 from the cache
# (written in step 1) and the K/V this step writes: that is the bottom-right aligned causal mask of
# docs/semantics.md#causal-mask, `key <= position` and `key < seq_len`, with no mask tensor at all: `query_start_loc`
# and
# `seq_lens` say it all.

# %%
pattern = attention_pattern(step2)
assert pattern.pattern.astype(bool).sum(axis=1).tolist() == [4, 3, 6, 7, 8]  # each query sees positions 0..p
plotting.plot_step(step2)

# %% [markdown]
# ## Steps 3 to 5: decodes until every request has finished
#
# Request 1 reached its 2 output tokens in step 2, so before step 3 its row and its blocks (3 and 7)
# are freed: row 1 is a hole, and `idx_mapping` (the state row of each batch row) skips it. Blocks
# freed go to the back of the free list, so request 0's position 4 gets block 9 and request 2's
# position 8 block 10. Request 0 finishes in step 4, and request 2 in step 5 with its 12th token
# (4 outputs, and `max_model_len` 12).
#
# These values are not in docs/semantics.md; they follow from its formulas by hand
# (`slot = block_table[row, p // 2] * 2 + p % 2`).

# %%
for record in records[2:]:
    print(format_step(record) + "\n")

# %%
step3, step4, step5 = records[2:]
assert step3.freed == {1: [3, 7]} and step3.unpadded("idx_mapping").tolist() == [0, 2]
assert step3.unpadded("positions").tolist() == [4, 8] and step3.unpadded("slot_mapping").tolist() == [18, 20]
assert step3.unpadded("query_start_loc").tolist() == [0, 1, 2] and step3.unpadded("seq_lens").tolist() == [5, 9]
assert step3.new_blocks == {0: [9], 2: [10]}
assert step4.unpadded("slot_mapping").tolist() == [19, 21] and step4.finished == (0,)
assert step5.unpadded("idx_mapping").tolist() == [2] and step5.unpadded("slot_mapping").tolist() == [22]
assert step5.unpadded("seq_lens").tolist() == [11] and step5.finished == (2,)
outputs = {request: [r.sampled[request] for r in records if request in r.sampled] for request in range(3)}
assert outputs == {0: [104, 105, 106, 107], 1: [203, 204], 2: [309, 310, 311, 312]}

# %% [markdown]
# How full the KV cache was after each step (slots holding K/V, out of 24 usable):

# %%
used = [kv_cache_view(record).num_used for record in records]
print(used)
assert used == [10, 15, 14, 16, 11]

# %%
plotting.plot_step(step5)

# %% [markdown]
# The same tables, for any requests and limits, from the terminal:
#
# ```
# jaxprep walkthrough                                   # this notebook's example
# jaxprep walkthrough --prompt-lens 20 5 30 --max-tokens 3 --block-size 4 --max-model-len 40 --budget 16
# ```
