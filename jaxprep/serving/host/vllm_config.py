"""The door's configuration read from vLLM's own, and the mistakes of a hand-written door named.

`serving_config_from_vllm` builds the `ServingConfig` a `VllmAdapter` needs from the two objects vLLM's
``Scheduler`` is built from, so that no size is copied by hand:

- ``PrepConfig.max_num_reqs``: ``scheduler_config.max_num_seqs`` (the rows of V1's ``InputBatch``);
- ``PrepConfig.max_num_batched_tokens``: ``scheduler_config.max_num_batched_tokens``;
- ``PrepConfig.max_model_len``: ``model_config.max_model_len``;
- ``PrepConfig.block_size``: ``kv_cache_config.kv_cache_groups[0].kv_cache_spec.block_size``;
- ``PrepConfig.num_blocks`` and each group's ``num_blocks``: ``kv_cache_config.num_blocks`` (one pool);
- ``FeatureConfig.kv_groups``: each group's spec, full attention (``FullAttentionSpec``,
  ``MLAAttentionSpec``) or a sliding window (``SlidingWindowSpec``); off for one full-attention group;
- ``FeatureConfig.num_speculative_tokens`` and ``speculative_method``: ``speculative_config``'s
  ``num_speculative_tokens`` and ``method``; ``FeatureConfig.async_tokens``: drafts under
  ``scheduler_config.async_scheduling``;
- ``FeatureConfig.lora``: ``lora_config.max_loras`` and ``specialize_active_lora``,
  ``compilation_config.cudagraph_specialize_lora``;
- ``FeatureConfig.mrope``: ``model_config.uses_mrope``;
- ``ServingConfig.vocab_size``: ``model_config.get_vocab_size()``;

and ``FeatureConfig.discard_request_mask`` is always on: `VllmAdapter.take_sampled` reads it to leave a
partial prefill chunk's sample out, as vLLM's runners discard it.

The checks below name the mistakes a door written by hand makes, where the batch's own checks could
only name the symptom (a row past its allocated blocks, a token not known yet):

- a call that needs a feature the configuration leaves off (`needs_feature`);
- a block size that disagrees with vLLM's, seen in the first new request whose blocks it cannot hold, or
  that holds more blocks than jaxprep's block size would ever give it (`check_new_blocks`);
- a prepared step whose samples were never recorded before the next step (`check_recorded`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jaxprep.bounds import cdiv
from jaxprep.config import PrepConfig
from jaxprep.features import FeatureConfig, KVCacheGroupSpec
from jaxprep.features.lora_config import LoRAConfig
from jaxprep.serving.config import ServingConfig

FULL_ATTENTION_SPECS = ("FullAttentionSpec", "MLAAttentionSpec")
"""vLLM's KV-cache specs whose block table holds every block of the request (a full-attention group)."""
SLIDING_WINDOW_SPECS = ("SlidingWindowSpec",)
"""vLLM's KV-cache specs of a sliding-window group (blocks wholly outside the window read the null block)."""


class AdapterUsageError(ValueError):
    """A `VllmAdapter` used in a way that cannot work: the message names the setting or the call that
    fixes it (a feature to turn on, vLLM's block size, a record of the last step's samples)."""


def serving_config_from_vllm(vllm_config, kv_cache_config, *, features: FeatureConfig | None = None,
                             **prep_options) -> ServingConfig:
    """The `ServingConfig` of a `VllmAdapter` driven by a scheduler built from ``vllm_config`` (vLLM's
    ``VllmConfig``) and ``kv_cache_config`` (its ``KVCacheConfig``), every size read from them (the list of
    the module docstring).

    ``features``: features vLLM's configuration does not decide (``sampling``, ``structured_outputs``,
    ``runner``, ...); a field vLLM's configuration decides may be given only with vLLM's value.
    ``prep_options``: other `PrepConfig` fields (``token_buckets``, ``kernel``, ``max_blocks_per_req``).
    """
    model, scheduler = vllm_config.model_config, vllm_config.scheduler_config
    groups = _kv_groups(kv_cache_config)
    read = dict(discard_request_mask=True, kv_groups=groups if len(groups) > 1 or groups[0].sliding_window else (),
                mrope=bool(getattr(model, "uses_mrope", False)))
    spec = vllm_config.speculative_config
    if spec is not None and spec.num_speculative_tokens:
        read.update(num_speculative_tokens=spec.num_speculative_tokens, speculative_method=str(spec.method),
                    async_tokens=bool(scheduler.async_scheduling))
    lora = vllm_config.lora_config
    if lora is not None:
        read["lora"] = LoRAConfig(max_loras=lora.max_loras, specialize_active_lora=lora.specialize_active_lora,
                                  cudagraph_specialize_lora=vllm_config.compilation_config.cudagraph_specialize_lora)
    prep = PrepConfig(max_num_reqs=scheduler.max_num_seqs, max_model_len=model.max_model_len,
                      max_num_batched_tokens=scheduler.max_num_batched_tokens, block_size=groups[0].block_size,
                      num_blocks=kv_cache_config.num_blocks, features=_with_read(features or FeatureConfig(), read),
                      **prep_options)
    return ServingConfig(prep=prep, vocab_size=model.get_vocab_size())


def _kv_groups(kv_cache_config) -> tuple[KVCacheGroupSpec, ...]:
    """jaxprep's spec of each of vLLM's KV-cache groups; a kind of group jaxprep does not read is refused."""
    groups = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec, kind = group.kv_cache_spec, type(group.kv_cache_spec).__name__
        if kind in FULL_ATTENTION_SPECS:
            window = None
        elif kind in SLIDING_WINDOW_SPECS:
            window = spec.sliding_window
        else:
            raise AdapterUsageError(
                f"KVCacheConfig.kv_cache_groups[{g}] is a {kind}: VllmAdapter.from_vllm reads full-attention "
                f"({', '.join(FULL_ATTENTION_SPECS)}) and sliding-window ({', '.join(SLIDING_WINDOW_SPECS)}) groups; "
                "build the ServingConfig yourself (FeatureConfig.kv_groups, FeatureConfig.hybrid) for this model")
        groups.append(KVCacheGroupSpec(block_size=spec.block_size, sliding_window=window,
                                       num_blocks=kv_cache_config.num_blocks))
    if not groups:
        raise AdapterUsageError("KVCacheConfig.kv_cache_groups is empty: the adapter needs the model's KV-cache groups")
    return tuple(groups)


def _with_read(features: FeatureConfig, read: dict) -> FeatureConfig:
    """``features`` with the fields vLLM's configuration decides; one the caller set otherwise is refused."""
    default = FeatureConfig()
    for name, value in read.items():
        given = getattr(features, name)
        if given != getattr(default, name) and given != value:
            raise AdapterUsageError(f"VllmAdapter.from_vllm: FeatureConfig.{name}={given!r} disagrees with vLLM's "
                                    f"configuration, which gives {value!r}: leave it out (it is read from vLLM)")
    return dataclasses.replace(features, **read)


# --- the mistakes of a hand-written door, named ---------------------------------------------------------

def needs_feature(config: ServingConfig, name: str, call: str, why: str) -> None:
    """Raises `AdapterUsageError` unless ``FeatureConfig.<name>`` is on: ``call`` needs it, for ``why``."""
    if not getattr(config.prep.features, name):
        raise AdapterUsageError(f"{call} needs FeatureConfig({name}=True) ({why}); VllmAdapter.from_vllm turns it on, "
                                f"or pass it in the PrepConfig's features")


def check_recorded(recorded: bool) -> None:
    """Raises `AdapterUsageError` when the last prepared step's samples were never recorded: the next step's
    ``input_ids`` read them from the device's token table."""
    if not recorded:
        raise AdapterUsageError(
            "the last step's sampled tokens were never recorded: after each step that has inputs, call "
            "adapter.take_sampled(step, sampled_token_ids) (or adapter.record_sampled) before the next adapter.step; "
            "the next step's input_ids read them from the device")


def check_new_blocks(config: ServingConfig, scheduler_output) -> None:
    """Every new request's blocks in each full-attention group against jaxprep's block size, where the count
    proves the two block sizes differ (slots would land in the wrong blocks): fewer blocks than
    ``cdiv(tokens, PrepConfig.block_size)`` for the tokens it computes or schedules (vLLM's blocks are
    larger), or more than the request's longest sequence could ever use,
    ``cdiv(min(prompt + max_tokens, max_model_len) + K + 1, PrepConfig.block_size)`` (smaller; vLLM allocates
    ``cdiv(tokens + lookahead, its block size)``). Run after the output's own checks (its fields have the
    right types).

    ```
    # vLLM block size 16, PrepConfig.block_size 8: a 19-token prompt -> 2 blocks < cdiv(19, 8) = 3 -> refused
    # vLLM 8, PrepConfig 32: 19 tokens, max_tokens 4 -> 3 blocks > cdiv(19 + 4 + 0 + 1, 32) = 1 -> refused
    ```
    """
    new = scheduler_output.scheduled_new_reqs
    if not new:
        return
    prep, features = config.prep, config.prep.features
    groups = features.kv_groups or (KVCacheGroupSpec(block_size=prep.block_size),)
    scheduled = scheduler_output.num_scheduled_tokens
    for request in new:
        tokens = int(request.num_computed_tokens) + int(scheduled.get(request.req_id, 0))
        longest = _longest_sequence(request, prep.max_model_len) + features.num_speculative_tokens + 1
        for g, group in enumerate(groups):
            if group.sliding_window is not None:
                continue
            blocks, size = len(request.block_ids[g]), group.block_size * features.dcp_world_size  # DCP: virtual blocks
            low, high = cdiv(tokens, size), cdiv(max(tokens, longest), size)
            if low <= blocks <= high:
                continue
            field = "PrepConfig.block_size" if g == 0 else f"FeatureConfig.kv_groups[{g}].block_size"
            if blocks < low:
                what, vllm_is = f"needs {low}", "larger"
            else:
                what, vllm_is = f"its longest sequence ({longest} tokens) needs at most {high}", "smaller"
            raise AdapterUsageError(
                f"NewRequestData {request.req_id!r} computes or schedules {tokens} tokens in {blocks} blocks of "
                f"KV-cache group {g}; at {field}={size} {what}: vLLM's block size is {vllm_is} than jaxprep's "
                "(its KVCacheConfig's kv_cache_spec.block_size, cache_config.block_size); build the adapter with "
                "VllmAdapter.from_vllm(vllm_config, kv_cache_config), which reads it")


def _longest_sequence(request, max_model_len: int) -> int:
    """The most tokens ``request`` (a ``NewRequestData``) can hold: its prompt (and outputs, when re-sent)
    plus ``max_tokens``, within ``max_model_len``."""
    given = request.prefill_token_ids if request.prefill_token_ids is not None else request.prompt_token_ids
    max_tokens = getattr(request.sampling_params, "max_tokens", None)
    if max_tokens is None:
        return max_model_len
    return min(len(given or ()) + max_tokens, max_model_len)


# --- the sampler's output, recorded and handed to vLLM in one call -------------------------------------------

def batch_rows(sampled_token_ids, num_rows: int):
    """``sampled_token_ids`` ``[R]`` or ``[R, n]`` as ``[num_rows, n]``: one column for one token a row, rows past
    ``R`` (padding) filled with -1, which no count takes.

    ```
    # [7, 8], num_rows 4 -> [[7], [8], [-1], [-1]]
    ```
    """
    import jax.numpy as jnp

    sampled = jnp.asarray(sampled_token_ids)
    sampled = sampled[:, None] if sampled.ndim == 1 else sampled
    if sampled.shape[0] > num_rows:
        raise AdapterUsageError(f"take_sampled: {sampled.shape[0]} rows of sampled tokens for a step of {num_rows} "
                                "batch rows (R_pad)")
    if sampled.shape[0] < num_rows:
        sampled = jnp.pad(sampled, ((0, num_rows - sampled.shape[0]), (0, 0)), constant_values=-1)
    return sampled


def sampled_counts(config: ServingConfig, inputs, sampled_token_ids):
    """How many of each batch row's sampled tokens count, on the device: the leading ids >= 0 of its row of
    ``sampled_token_ids`` (vLLM's rejection sampler writes -1 after the accepted tokens), none on a padded
    row or a partial prefill chunk (``discard_request_mask``), as vLLM's runners discard them.

    ```
    # sampled [[7], [8], [0]], idx_mapping [0, 1, -1], discard [F, T, F] -> [1, 0, 0]
    # sampled [[7, 9, -1], [4, -1, -1]] (spec decode, K = 2), nothing discarded -> [2, 1]
    ```
    """
    import jax.numpy as jnp

    needs_feature(config, "discard_request_mask", "VllmAdapter.take_sampled without num_sampled",
                  "a partial prefill chunk's sample is discarded, as vLLM's runners do")
    kept = jnp.cumprod(sampled_token_ids >= 0, axis=1).sum(axis=1, dtype=jnp.int32)
    return jnp.where((inputs.idx_mapping >= 0) & ~inputs.discard_request_mask, kept, 0)


def host_lists(sampled_token_ids, num_sampled, num_rows: int) -> list[list[int]]:
    """Each of the first ``num_rows`` rows' counted tokens as a list, for vLLM's ``ModelRunnerOutput`` (one read
    of each array from the device)."""
    ids, counts = np.asarray(sampled_token_ids), np.asarray(num_sampled)
    return [ids[b, :counts[b]].tolist() for b in range(num_rows)]


__all__ = ["AdapterUsageError", "batch_rows", "check_new_blocks", "check_recorded", "host_lists", "needs_feature",
           "sampled_counts", "serving_config_from_vllm"]
