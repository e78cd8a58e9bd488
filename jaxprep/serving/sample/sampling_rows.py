"""The serving loop's sampling rows: admission writes them, every sampled token counts in them.

Admission (vLLM V2 `vllm/v1/worker/gpu/sample/sampler.py::Sampler.add_request`, then
``apply_staged_writes``): the request's normalised parameters (`jaxprep.SamplingParams`,
`jaxprep.features.sampling_params.state_row`) go into its state row, and the penalty bins are built on
the device from the token row: ``prompt_bin_mask`` has bit ``t % 32`` of word ``t // 32`` for every
prompt token t, ``output_bin_counts`` counts the tokens in ``[prompt_len, num_tokens)`` (the
outputs a resumed request recomputes). vLLM builds the bins only for penalty requests; here every
request gets them (the bins of a request without penalties are never read, so nothing observable
differs). Nothing is reset when a request finishes.

After each step (vLLM ``post_update``) every appended token adds 1 to its row's ``output_bin_counts``.

The parameters travel in the one int32 update buffer (`jaxprep.serving.update_packing`): float parameters
as their float32 bit patterns, bit-cast back inside the jit; admission itself is
`jaxprep.serving.transitions.admit_sampling_body` (the bins from the update's token words).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxprep.serving.device_state import Cells


def sampled_count_cells(vocab: int, rows: jax.Array, sampled_token_ids: jax.Array, num_sampled: jax.Array):
    """The cells to add 1 to for the first ``num_sampled[b]`` tokens of each batch row b (``rows``: its state
    row as a scatter index, the sentinel for padding): ``output_bin_counts[s, token] += 1``, as the
    `jaxprep.serving.device_state.Cells` of a ``write_cells(..., mode="add")``.

    ```
    # rows [2], sampled [[9, 4]], num_sampled [1] -> output_bin_counts[2, 9] += 1
    ```
    """
    offsets = jnp.arange(sampled_token_ids.shape[1], dtype=jnp.int32)[None, :]
    valid = (offsets < num_sampled[:, None]) & (sampled_token_ids >= 0) & (sampled_token_ids < vocab)
    target = jnp.broadcast_to(rows[:, None], sampled_token_ids.shape)
    return [Cells("output_bin_counts", jnp.where(valid, target, -1), 1, sampled_token_ids)]
