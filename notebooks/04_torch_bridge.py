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
# # Handing a step to PyTorch
#
# `torch_bridge.to_torch` gives a prepared step to a PyTorch model under vLLM's
# `CommonAttentionMetadata` names and dtypes, sharing JAX's memory through DLPack (no copy on the
# arrays' own device). This notebook bridges every step of the chunked-prefill walkthrough (example A of
# docs/semantics.md#example-a-step-1, run to the end) and feeds it to `torch_bridge.paged_attention`, a plain-torch
# paged
# attention of about 40 lines: `write_kv_cache` writes each token's K/V at its `slot_mapping` slot
# and `paged_attention` reads each request's context through `block_table_tensor` and `seq_lens`.
# Every output is compared with torch's own dense causal attention over the whole sequence.
#
# Needs the `torch` extra: `pip install 'jaxprep[torch]'`.

# %%
import numpy as np
import torch
import torch.nn.functional as F

import jaxprep
import torch_bridge
from jaxprep.walkthrough import kv_cache_view, plotting, run_walkthrough
from torch_bridge.paged_attention import paged_attention, write_kv_cache

# example A (docs/semantics.md#example-a-step-1): block size 2, max_model_len 12, budget 10, prompts 3, 2, 8
records = run_walkthrough()


def prepared(record):
    """The record's step prepared again, as the `StepInputs` pytree the bridge takes."""
    return jaxprep.prepare_inputs(jaxprep.BatchState.from_numpy(**record.state), record.config)


# %% [markdown]
# ## Step 1 on the torch side
#
# `positions` and `slot_mapping` become int64 (as in vLLM's GPU runner), the rest stays int32, the
# counts become Python ints, and `query_start_loc` / `seq_lens` get their host mirrors
# (`*_cpu`), which CPU-side metadata builders read.

# %%
inputs = torch_bridge.to_torch(prepared(records[0]))
meta = inputs.attn_metadata
for name in ("input_ids", "positions"):
    print(f"{name:20s} {str(getattr(inputs, name).dtype):12s} {getattr(inputs, name).tolist()}")
for name in ("query_start_loc", "seq_lens", "slot_mapping"):
    print(f"{name:20s} {str(getattr(meta, name).dtype):12s} {getattr(meta, name).tolist()}")
print(f"{'block_table_tensor':20s} {str(meta.block_table_tensor.dtype):12s} {meta.block_table_tensor[:, :4].tolist()}")
print(f"num_reqs={meta.num_reqs} num_actual_tokens={meta.num_actual_tokens} "
      f"max_query_len={meta.max_query_len} max_seq_len={meta.max_seq_len} causal={meta.causal}")

# %%
# Example A, step 1 (docs/semantics.md#example-a-step-1), as torch tensors
assert meta.slot_mapping.dtype == inputs.positions.dtype == torch.int64
assert meta.query_start_loc.dtype == meta.seq_lens.dtype == inputs.input_ids.dtype == torch.int32
assert meta.slot_mapping.tolist() == [2, 3, 4, 6, 7, 8, 9, 10, 11, 12]
assert inputs.positions.tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3, 4]
assert meta.query_start_loc.tolist() == meta.query_start_loc_cpu.tolist() == [0, 3, 5, 10]
assert meta.seq_lens.tolist() == [3, 2, 5]
assert inputs.logits_indices.tolist() == [2, 4, 9]
assert meta.block_table_tensor[:, :3].tolist() == [[1, 2, 0], [3, 0, 0], [4, 5, 6]]
assert (meta.num_reqs, meta.num_actual_tokens, meta.max_query_len, meta.max_seq_len) == (3, 10, 5, 5)

# %% [markdown]
# Step 2 is padded to the 8-token bucket: the padded tokens' slots are -1, which `write_kv_cache`
# skips (it masks them out; -1 used as an index would wrap to the last slot).

# %%
step2 = torch_bridge.to_torch(prepared(records[1]))
print(step2.attn_metadata.slot_mapping.tolist())
# example A, step 2 (docs/semantics.md#example-a-step-2; + padding)
assert step2.attn_metadata.slot_mapping.tolist() == [5, 14, 13, 16, 17, -1, -1, -1]
assert step2.attn_metadata.query_start_loc.tolist() == [0, 1, 2, 5]
assert step2.attn_metadata.seq_lens.tolist() == [4, 3, 8]

# %% [markdown]
# ## Paged attention over every step
#
# Each request gets fixed random queries, keys and values for all its positions up front. Each step
# writes the K/V of its scheduled tokens into the paged cache and attends over what the cache holds.
# The oracle is `F.scaled_dot_product_attention(is_causal=True)` over each request's whole sequence:
# row `p` of it is what the token at position `p` must see.

# %%
HEADS, HEAD_SIZE = 2, 8
config = records[0].config
device = step2.positions.device  # where JAX's arrays live (cpu, or cuda on a GPU): everything stays there
generator = torch.Generator().manual_seed(0)
qkv = {request: [torch.randn(config.max_model_len, HEADS, HEAD_SIZE, generator=generator,
                             dtype=torch.float64).to(device)
                 for _ in range(3)] for request in range(3)}
dense = {request: F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in tensors), is_causal=True).transpose(0, 1)
         for request, tensors in qkv.items()}
cache_shape = (config.num_blocks, config.block_size, HEADS, HEAD_SIZE)
key_cache, value_cache = (torch.zeros(cache_shape, dtype=torch.float64, device=device) for _ in range(2))

worst = 0.0
for record in records:
    inputs = torch_bridge.to_torch(prepared(record))
    meta, n = inputs.attn_metadata, record.num_actual_tokens
    token_requests = np.repeat(record.request_ids[record.batch_rows], record.scheduled[record.batch_rows])
    positions = inputs.positions[:n].tolist()
    query, key, value = (torch.zeros(inputs.num_tokens_padded, HEADS, HEAD_SIZE, dtype=torch.float64, device=device)
                         for _ in range(3))
    for t, (request, p) in enumerate(zip(token_requests, positions)):
        query[t], key[t], value[t] = (x[p] for x in qkv[int(request)])
    write_kv_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    output = paged_attention(query, key_cache, value_cache, meta)
    expected = torch.stack([dense[int(r)][p] for r, p in zip(token_requests, positions)])
    worst = max(worst, float((output[:n] - expected).abs().max()))
    assert torch.allclose(output[:n], expected, atol=1e-12), f"step {record.number}"
    assert not output[n:].any()  # padded tokens: zeros
    # the cache holds every request's keys exactly where the walkthrough's KV view says
    view = kv_cache_view(record)
    for (block, offset), request in np.ndenumerate(view.request):
        if request >= 0:
            assert torch.equal(key_cache[block, offset], qkv[int(request)][1][view.position[block, offset]])
    print(f"step {record.number}: {n} token{'s' * (n != 1)}, paged attention = dense causal attention "
          f"(max |diff| {worst:.1e})")

# %% [markdown]
# The cache after step 2, where `write_kv_cache` put each token (light: written by step 1, full:
# by step 2):

# %%
plotting.say_where_figures_go()  # as a script: one line saying the figures are not shown here

# %%
plotting.plot_kv_cache(records[1])

# %% [markdown]
# ## And back
#
# The sampled tokens come back to JAX with `torch_bridge.from_torch`: int32 tensors are shared, other
# integer dtypes are range-checked and cast (a value outside int32 raises instead of wrapping).

# %%
sampled = torch.tensor([104, 203, 0], dtype=torch.int64)  # step 1's samples (request 2's is discarded)
back = torch_bridge.from_torch(sampled, name="sampled_token_ids")
print(back.dtype, back.tolist())
assert str(back.dtype) == "int32" and back.tolist() == [104, 203, 0]
