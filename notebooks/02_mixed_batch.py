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
# # Decodes, prefills and a chunked prefill in one step
#
# Example B (docs/semantics.md#example-b): block size 16, `max_model_len` 240, a budget of 200 tokens, and five requests
# in one step:
#
# | request | computed | scheduled | what it does |
# |---|---|---|---|
# | 0 | 54 | 1 | decode |
# | 1 | 145 | 1 | decode |
# | 2 | 0 | 93 | whole prompt |
# | 3 | 0 | 75 | whole prompt |
# | 4 | 0 | 30 | first chunk of a longer prompt: the budget has 200 - 170 = 30 tokens left |
#
# Blocks are handed out in order from 1, `cdiv(computed + scheduled, 16)` per request. Token ids are
# random here (`jaxprep.walkthrough.examples.example_b`). The step is prepared by `jaxprep.prepare_inputs` and
# checked against the NumPy reference; the cells assert the numbers of docs/semantics.md.

# %%
import dataclasses

import numpy as np

import jaxprep
from jaxprep.walkthrough import format_step, kv_cache_view, plotting, prepare_record
from jaxprep.walkthrough.examples import example_b, example_b_config

config = example_b_config()
arrays = example_b()
# prompt lengths only label the rows: the decodes' prompts were shorter than their 54 and 145
# computed tokens, request 4's prompt is longer than its 30-token chunk
record = prepare_record(arrays, config, prompt_lens=[40, 100, 93, 75, 120])
print(format_step(record, max_columns=12))
assert record.matches_reference

# %% [markdown]
# Each decode writes one slot in the last block of its request: request 0's position 54 is block
# column `54 // 16 = 3`, block 4, slot `4 * 16 + 54 % 16 = 70`. The prefills write whole runs of
# slots, request 2 from block 15 on (`15 * 16 = 240`). Request 4's chunk ends at position 29, in its
# second block 27: slot `27 * 16 + 13 = 445`.

# %%
# Example B (docs/semantics.md#example-b)
slots = record.unpadded("slot_mapping")
assert len(slots) == 200 and slots[:4].tolist() == [70, 225, 240, 241] and slots[-4:].tolist() == [442, 443, 444, 445]
assert record.unpadded("query_start_loc").tolist() == [0, 1, 2, 95, 170, 200]
assert record.unpadded("seq_lens").tolist() == [55, 146, 93, 75, 30]
assert record.unpadded("logits_indices").tolist() == [0, 1, 94, 169, 199]
table = record.state["block_table"]
assert [row[row > 0].tolist() for row in table] == [
    [1, 2, 3, 4], list(range(5, 15)), list(range(15, 21)), list(range(21, 26)), [26, 27]]
assert record.num_tokens_padded == 200  # the budget is the top bucket: no padding this time

# %% [markdown]
# Every kind of work in one flat batch of 200 tokens: the two decodes are one query token each, over
# long cached contexts (light); the prefills are triangles of new K/V (full colour); request 4's chunk
# is a small triangle. The KV cache picture shows the partly filled last block of every request.

# %%
plotting.say_where_figures_go()  # as a script: one line saying the figures are not shown here

# %%
view = kv_cache_view(record)
assert view.num_used == 55 + 146 + 93 + 75 + 30 and int(view.new.sum()) == 200
plotting.plot_step(record)

# %% [markdown]
# ## The same step in vLLM V2's row order
#
# vLLM's newer model runner (V2) sorts the batch before preparing it (docs/semantics.md#batch-order): rows with drafts
# first, then decode-sized rows, then the rest by ascending scheduled count. jaxprep does the same
# with `FeatureConfig(reorder="v2")`; `idx_mapping` maps each batch row back to its state row. Here
# the order becomes requests 0, 1, 4, 3, 2, and every flattened output follows it (docs/semantics.md#v2-order).

# %%
v2_config = dataclasses.replace(config, features=jaxprep.FeatureConfig(reorder="v2"))
v2 = jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**arrays), v2_config, check=True)
meta = v2.attn_metadata
print("idx_mapping    ", np.asarray(v2.idx_mapping).tolist())
print("query_start_loc", np.asarray(meta.query_start_loc).tolist())
print("seq_lens       ", np.asarray(meta.seq_lens).tolist())
print("slot_mapping   ", np.asarray(meta.slot_mapping)[:6].tolist(), "...")

# %%
# docs/semantics.md#v2-order: example B in V2 order
assert np.asarray(v2.idx_mapping).tolist() == [0, 1, 4, 3, 2]
assert np.asarray(meta.query_start_loc).tolist() == [0, 1, 2, 32, 107, 200]
assert np.asarray(meta.slot_mapping)[:4].tolist() == [70, 225, 416, 417]
assert np.asarray(meta.seq_lens).tolist() == [55, 146, 30, 75, 93]
