"""tpu-inference 0.32.0's own code on random steps, against `jaxprep.layouts.tpu_inference` and the NumPy
transcription of `tests/support/tpu_inference_runner.py`; prints one JSON line.

Run in a fresh process: ``python tests/support/tpu_inference_source.py DIR``, DIR holding the
``tpu_inference`` package (``pip install --no-deps --target DIR tpu-inference==0.32.0``; never into the
environment: the wheel also installs top-level ``tests`` and ``tools`` packages). What runs is theirs:

- ``TPUModelRunner._init_inputs``, ``_prepare_input_metadata`` and ``_prepare_inputs``, read out of
  `tpu_inference/runner/tpu_runner.py` with `ast` and run on a stand-in runner (the module itself
  needs flax, torchax and more), with their real ``InputBatch``, ``DeviceBuffer``, bucket functions
  and ``AttentionMetadata``; ``device_array`` is the identity (as their own CPU tests patch it) and
  the sampling metadata is left out;
- ``PersistentBatchManager._reorder_batch``;
- the RPA v3 kernel module: ``get_kv_cache_shape``, ``merge_kv``, ``static_validate_inputs``,
  ``dynamic_validate_inputs``, ``ref_ragged_paged_attention``, and the kernel itself in Pallas' TPU
  interpret mode (its failure, on a jax that cannot interpret it, is reported, not raised).

Their package ``__init__`` is not run (it polls GCE metadata for ~30 s and imports vLLM's platform);
``torchax.ops.mappings`` is a stand-in module (tpu_inference/utils.py imports three names from it
that none of the code above calls).
"""

from __future__ import annotations

import ast
import json
import os
import sys
import types

import numpy as np


def import_tpu_inference(folder: str) -> None:
    package = types.ModuleType("tpu_inference")
    package.__path__ = [os.path.join(folder, "tpu_inference")]
    sys.modules["tpu_inference"] = package
    for name in ("torchax", "torchax.ops", "torchax.ops.mappings"):
        sys.modules.setdefault(name, types.ModuleType(name))
    mappings = sys.modules["torchax.ops.mappings"]
    for name in ("j2t_dtype", "t2j", "t2j_dtype"):
        setattr(mappings, name, None)


def runner_methods(folder: str, names: tuple[str, ...], namespace: dict) -> dict:
    """``TPUModelRunner``'s methods ``names``, compiled from their source with ``namespace`` as globals."""
    path = os.path.join(folder, "tpu_inference", "runner", "tpu_runner.py")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    runner = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TPUModelRunner")
    methods = [node for node in runner.body if isinstance(node, ast.FunctionDef) and node.name in names]
    assert sorted(m.name for m in methods) == sorted(names), [m.name for m in methods]
    exec(compile(ast.Module(body=methods, type_ignores=[]), path, "exec"), namespace)
    return {name: namespace[name] for name in names}


def their_runner(folder: str, config):
    """A stand-in ``TPUModelRunner`` set up by their ``_init_inputs`` for jaxprep's ``config`` (dp 1, float32)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from tpu_inference import envs
    from tpu_inference import utils as common_utils
    from tpu_inference.layers.common import attention_metadata
    from tpu_inference.layers.common.sharding import MESH_AXIS_NAMES, ShardingAxisName
    from tpu_inference.runner import utils as runner_utils
    from tpu_inference.runner.input_batch import InputBatch

    namespace = dict(
        np=np, jax=jax, jnp=jnp, NamedSharding=NamedSharding, PartitionSpec=PartitionSpec, envs=envs,
        ShardingAxisName=ShardingAxisName, runner_utils=runner_utils, common_utils=common_utils,
        cdiv=lambda a, b: -(-a // b), next_power_of_2=lambda x: 1 if x <= 1 else 1 << (x - 1).bit_length(),
        MIN_NUM_SEQS=8, InputBatch=InputBatch, to_jax_dtype=common_utils.to_jax_dtype,
        device_array=lambda mesh, arrays, sharding=None: arrays,
        TPUSupportedSamplingMetadata=types.SimpleNamespace(from_input_batch=lambda *args, **kwargs: None),
        AttentionMetadata=attention_metadata.AttentionMetadata,
        SharedAttentionMetadata=attention_metadata.SharedAttentionMetadata)
    methods = runner_methods(folder, ("_init_inputs", "_prepare_input_metadata", "_prepare_inputs"), namespace)
    model_config = types.SimpleNamespace(max_model_len=config.max_model_len, get_sliding_window=lambda: None,
                                         get_vocab_size=lambda: 128)
    self = types.SimpleNamespace(
        model_config=model_config, cache_config=types.SimpleNamespace(block_size=config.block_size, cache_dtype="auto"),
        scheduler_config=types.SimpleNamespace(max_num_seqs=config.max_num_reqs, async_scheduling=False,
                                               max_num_batched_tokens=config.max_num_batched_tokens),
        vllm_config=types.SimpleNamespace(additional_config={}, parallel_config=None, speculative_config=None,
                                          sharding_config=types.SimpleNamespace(prefill_cp_size=1)),
        speculative_config=None, dp_size=1, dtype=jnp.float32, uses_mrope=False, enable_continue_decode=False,
        _pre_async_results=None, phase_based_profiler=None, aggregated_stats_logger=None, lora_config=None,
        mesh=jax.make_mesh((1,) * len(MESH_AXIS_NAMES), MESH_AXIS_NAMES),
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[object()], has_mamba_layers=False))
    for name, method in methods.items():
        setattr(self, name, types.MethodType(method, self))
    self._init_inputs()
    return self


def their_step(folder: str, config, arrays: dict) -> dict:
    """Their ``_reorder_batch`` and ``_prepare_inputs`` on the rows with work (request id = state row)."""
    from tpu_inference.runner.persistent_batch_manager import PersistentBatchManager

    self = their_runner(folder, config)
    batch = self.input_batch
    rows = [int(r) for r in np.flatnonzero(arrays["num_scheduled_tokens"])]
    table = batch.block_table[0]
    for index, row in enumerate(rows):  # InputBatch.add_request's arrays, without a request object
        batch._req_ids.append(row)
        batch.req_output_token_ids.append([])
        batch.req_id_to_index[row] = index
        end = int(arrays["num_computed_tokens"][row] + arrays["num_scheduled_tokens"][row])
        batch.token_ids_cpu[index, :end] = arrays["token_ids"][row, :end]
        batch.num_tokens[index] = batch.num_tokens_no_spec[index] = end
        batch.num_computed_tokens_cpu[index] = arrays["num_computed_tokens"][row]
        table.add_row(list(arrays["block_table"][row, :table.max_num_blocks_per_req]), index)
    scheduled = {row: int(arrays["num_scheduled_tokens"][row]) for row in rows}
    output = types.SimpleNamespace(num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                                   scheduled_spec_decode_tokens={}, has_structured_output_requests=False)
    manager = PersistentBatchManager({}, batch, {}, uses_mrope=False, model_config=None, is_last_rank=True)
    manager._reorder_batch(output)
    (input_ids, positions, attn, _, logits_indices, *_rest) = self._prepare_inputs(output)
    return dict(input_ids=input_ids, positions=positions, query_start_loc=attn.query_start_loc,
                seq_lens=attn.seq_lens, block_tables=attn.block_tables,
                request_distribution=attn.request_distribution, logits_indices=logits_indices,
                padded_num_reqs=attn.padded_num_reqs, req_ids=list(batch.req_ids[:batch.num_reqs]))


def kernel_checks(seed: int = 0) -> dict:
    """Their kernel module against the transcription and fed by the layout; the real kernel in interpret mode."""
    import jax.numpy as jnp
    from jax.experimental.pallas import tpu as pltpu
    from tpu_inference.kernels.ragged_paged_attention.v3 import kernel

    from support import tpu_inference_runner as transcription
    from support.tpu_inference_layouts import attention_case

    case = attention_case(seed)
    out = {"cache_shape_equal": kernel.get_kv_cache_shape(*case.cache_shape_args) == case.v3_cache.shape,
           "merge_kv_equal": bool(np.array_equal(np.asarray(kernel.merge_kv(*map(jnp.asarray, case.kv))),
                                                 transcription.merge_kv(*case.kv)))}
    args = (*map(jnp.asarray, case.qkv), jnp.asarray(case.v3_cache), *map(jnp.asarray, case.kernel_inputs))
    kernel.static_validate_inputs(*args, sm_scale=case.sm_scale)
    theirs, their_cache = kernel.ref_ragged_paged_attention(*args, sm_scale=case.sm_scale)
    total = case.total
    out["reference_vs_transcription"] = float(np.abs(np.asarray(theirs)[:total] - case.reference_out).max())
    out["reference_cache_equal"] = bool(np.array_equal(np.asarray(their_cache), case.reference_cache))
    out["reference_vs_jaxprep_oracle"] = float(np.abs(np.asarray(theirs)[:total] - case.oracle_out).max())
    try:
        with pltpu.force_tpu_interpret_mode():
            real, real_cache = kernel.ragged_paged_attention(
                *args, sm_scale=case.sm_scale, vmem_limit_bytes=64 << 20,
                d_block_sizes=(8, 8, 8, 8), p_block_sizes=(8, 8, 8, 8), m_block_sizes=(8, 8, 8, 8))
        out["kernel_vs_oracle"] = float(np.abs(np.asarray(real)[:total] - case.oracle_out).max())
        out["kernel_cache_equal"] = bool(np.array_equal(np.asarray(real_cache), case.reference_cache))
    except Exception as error:  # reported: the jax installed may not interpret the kernel
        out["kernel_error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"
    return out


def main(folder: str, steps: int = 40) -> dict:
    import_tpu_inference(folder)
    from support.tpu_inference_layouts import CONFIGS, jaxprep_layout, random_state, runner_for

    summary = {"steps": 0, "layout_mismatches": [], "transcription_mismatches": [], "swapped_steps": 0,
               "control_mismatches": []}
    for name, config in CONFIGS.items():
        rng = np.random.default_rng(7)
        for i in range(steps):
            arrays = random_state(config, rng)
            theirs = their_step(folder, config, arrays)
            mine = runner_for(config, arrays)
            summary["layout_mismatches"] += [f"{name} step {i}: {field}"
                                             for field in differing(theirs, jaxprep_layout(config, arrays))]
            summary["transcription_mismatches"] += [f"{name} step {i}: {field}"
                                                    for field in differing(theirs, mine[0].step(mine[1]))]
            summary["steps"] += 1
            rows = [int(r) for r in np.flatnonzero(arrays["num_scheduled_tokens"])]
            stable = sorted(rows, key=lambda r: arrays["num_scheduled_tokens"][r] > 1)
            summary["swapped_steps"] += theirs["req_ids"] != stable
            if i == 0:  # negative control: the layout of a step whose first request has one token more computed
                control = dict(arrays, num_computed_tokens=arrays["num_computed_tokens"].copy())
                control["num_computed_tokens"][rows[0]] -= 1 if control["num_computed_tokens"][rows[0]] else -1
                summary["control_mismatches"] += differing(theirs, jaxprep_layout(config, control))
    summary.update(kernel_checks())
    return summary


def differing(theirs: dict, ours: dict) -> list[str]:
    """The fields (by the runner's names) where two steps differ in shape or value."""
    bad = []
    for field in ("input_ids", "positions", "query_start_loc", "seq_lens", "block_tables", "request_distribution",
                  "logits_indices", "padded_num_reqs", "req_ids"):
        their_value, our_value = np.asarray(theirs[field]), np.asarray(ours[field])
        if field == "req_ids":
            our_value = our_value[:len(their_value)]
        if their_value.shape != our_value.shape or not np.array_equal(their_value, our_value):
            bad.append(field)
    return bad


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
