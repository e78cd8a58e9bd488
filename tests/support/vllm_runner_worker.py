"""Runs vLLM 0.33.0's own code for the runner features on random batches, compares jaxprep; prints a JSON report.

Started by tests/features/test_vllm_runner_parity.py in a subprocess with ``TRITON_INTERPRET=1`` and
``CUDA_VISIBLE_DEVICES=""`` (vLLM's Triton kernels then run on the CPU), set before Python starts.
For every batch, jaxprep prepares the step with the features on, and vLLM computes the same
quantities from the same target step:

- drafter: ``_prepare_prefill_inputs_kernel`` (target ``next_prefill_tokens``),
  ``get_num_sampled_and_rejected``, the speculator's ``prepare_prefill_inputs``,
  ``prepare_decode_inputs`` and ``update_draft_inputs`` on buffers pre-filled with a sentinel, so
  entries vLLM leaves stale are told apart (they must hold jaxprep's pad constants);
- grammar: ``expand_idx_mapping``, ``grammar_invalid_drafts`` and
  ``StructuredOutputsWorker.apply_grammar_bitmask`` (CUDA streams stubbed out);
- hybrid: ``Mamba2AttentionMetadataBuilder.build`` (its ``_compute_common_metadata``,
  ``split_decodes_and_prefills``, ``mamba_get_block_table_tensor`` and ``_compute_chunk_metadata``)
  on a ``CommonAttentionMetadata`` of the step, with V2's ``is_prefilling`` and draft counts;
- micro-batches: V2 ``create_ubatch_slices``, ``_slice_query_start_loc`` and ``_slice_seq_lens``.
"""

from __future__ import annotations

import json
import os
import sys
import types
from unittest import mock

import numpy as np

if os.environ.get("TRITON_INTERPRET") != "1" or os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    sys.exit("run with TRITON_INTERPRET=1 and CUDA_VISIBLE_DEVICES='' set before Python starts")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package

import jax.numpy as jnp
import torch

import jaxprep._constants as pads
from jaxprep import FeatureConfig, PrepConfig
from jaxprep.features import DrafterConfig, HybridConfig
from jaxprep.features.drafter import draft_decode_advance, draft_decode_start, draft_prefill
from jaxprep.features.grammar import apply_grammar_bitmask, grammar_invalid_drafts
from support.feature_batches import build_feature_batch, run_step

SENTINEL = -7777
VOCAB = 80
NUM_BATCHES = int(os.environ.get("PARITY_BATCHES", "8"))
CONTROL_BATCHES = int(os.environ.get("PARITY_CONTROL_BATCHES", "1"))
"""Batches per configuration of the negative control, run after the real comparison in the same process."""
ITEMS = ("drafter", "grammar", "hybrid", "ubatch")
CORRUPT: tuple[str, ...] = ()  # negative control: items whose jaxprep values are shifted by 1 (`corrupted`)
CONFIGS = {
    "eagle, K 3, hybrid none + checkpoints": FeatureConfig(
        num_speculative_tokens=3, reorder="v2", drafter=DrafterConfig(), structured_outputs=True, num_ubatches=2,
        hybrid=HybridConfig(num_speculative_blocks=3, chunk_size=8, checkpoints=True)),
    "gemma4, K 2, hybrid align": FeatureConfig(
        num_speculative_tokens=2, reorder="v2", drafter=DrafterConfig(advance_draft_positions=False),
        structured_outputs=True, num_ubatches=2,
        hybrid=HybridConfig(mode="align", block_size=8, num_speculative_blocks=2, chunk_size=4)),
    "no spec, hybrid none": FeatureConfig(structured_outputs=True, num_ubatches=2, hybrid=HybridConfig(chunk_size=8)),
}


def t(values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(np.asarray(values).tolist(), dtype=dtype)


def compare(report: list, item: str, name: str, got, want, written=None) -> None:
    """``got`` (jaxprep) equals ``want`` (vLLM) where vLLM wrote; elsewhere ``got`` is checked by the caller."""
    got, want = np.asarray(got), np.asarray(want)
    if item in CORRUPT:
        got = got + 1
    mask = np.ones(want.shape, bool) if written is None else written
    if got.shape != want.shape or not np.array_equal(got[mask], want[mask]):
        report.append(f"{item}: {name}: jaxprep {got.ravel()[:16].tolist()} vLLM {want.ravel()[:16].tolist()}")


def batch_arrays(config: PrepConfig, rng) -> dict:
    """A drawn batch plus the hybrid and grammar inputs of ``config``'s features."""
    features = config.features
    arrays = build_feature_batch(config, lambda lo, hi: int(rng.integers(lo, hi + 1)),
                                 max_drafts=features.num_speculative_tokens)
    rows, hybrid = config.max_num_reqs, features.hybrid
    width = hybrid.table_width(config.max_model_len)
    arrays["mamba_block_table"] = (1 + np.arange(rows * width, dtype=np.int32)).reshape(rows, width)
    arrays["num_accepted_tokens"] = rng.integers(1, 2 + features.num_speculative_tokens, rows).astype(np.int32)
    scheduled = arrays["num_scheduled_tokens"]
    arrays["mamba_checkpoint_offsets"] = np.array([rng.integers(0, s) if s > 1 and rng.random() < 0.5 else 0
                                                   for s in scheduled], np.int32)
    order = [int(r) for r in rng.permutation(np.flatnonzero(scheduled > 0)) if rng.random() < 0.7]
    arrays["grammar_index"] = np.full(rows, -1, np.int32)
    arrays["grammar_index"][order] = np.arange(len(order))
    if not hybrid.checkpoints:
        del arrays["mamba_checkpoint_offsets"]
    if not features.spec_decode:
        del arrays["num_accepted_tokens"]
    return arrays


class StepView:
    """The target step's per-row arrays as vLLM's runner holds them (batch order, unpadded)."""

    def __init__(self, step, arrays: dict, config: PrepConfig):
        meta = step.attn_metadata
        self.num_reqs, self.num_tokens = int(meta.num_reqs), int(meta.num_actual_tokens)
        self.r_pad, self.t_pad = step.num_reqs_padded, step.num_tokens_padded
        self.idx = np.asarray(step.idx_mapping)[: self.num_reqs]
        self.qsl = np.asarray(meta.query_start_loc)[: self.num_reqs + 1]
        self.seq_lens = np.asarray(meta.seq_lens)[: self.num_reqs]
        k = config.features.num_speculative_tokens
        self.drafts = arrays["num_draft_tokens"][self.idx] if k else np.zeros(self.num_reqs, np.int32)
        self.cu_num_logits = np.concatenate([[0], np.cumsum(self.drafts + 1)]).astype(np.int32)


def check_drafter(step, arrays, config, view: StepView, rng, report: list) -> None:
    from vllm.v1.worker.gpu.input_batch import get_num_sampled_and_rejected
    from vllm.v1.worker.gpu.input_batch import prepare_prefill_inputs as target_prefill_inputs

    rows = config.max_num_reqs
    next_tokens = torch.full((1, rows), SENTINEL, dtype=torch.int32)
    target_prefill_inputs(t(np.zeros(view.t_pad)), next_tokens, t(view.idx), t(view.qsl), t(arrays["token_ids"]),
                          t(arrays["prefill_len"]), t(arrays["num_computed_tokens"]))
    written = next_tokens[0, torch.from_numpy(view.idx.copy())].numpy()
    compare(report, "drafter", "next_prefill_tokens", np.asarray(step.drafter.next_prefill_tokens)[: view.num_reqs],
            written, written != SENTINEL)
    raw = np.array([rng.integers(1, d + 2) for d in view.drafts], np.int32)
    sampled, rejected = get_num_sampled_and_rejected(t(raw), t(view.seq_lens), t(view.cu_num_logits), t(view.idx),
                                                     t(arrays["prefill_len"]))
    last_sampled = rng.integers(1, 50_000, rows).astype(np.int32)
    draft = draft_prefill(step, jnp.asarray(np.pad(raw, (0, view.r_pad - view.num_reqs))), jnp.asarray(last_sampled))
    compare(report, "drafter", "num_sampled", np.asarray(draft.num_sampled)[: view.num_reqs], sampled.numpy())
    compare(report, "drafter", "num_rejected", np.asarray(draft.num_rejected)[: view.num_reqs], rejected.numpy())
    buffers = check_draft_prefill(step, draft, view, sampled, rejected, last_sampled, next_tokens, report)
    check_draft_decodes(step, draft, config, view, rejected, buffers, rng, report)


def check_draft_prefill(step, draft, view, sampled, rejected, last_sampled, next_tokens, report):
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import prepare_prefill_inputs

    buffers = types.SimpleNamespace(
        input_ids=torch.full((view.t_pad,), SENTINEL, dtype=torch.int32),
        positions=torch.full((view.t_pad,), SENTINEL, dtype=torch.int64),
        query_start_loc=torch.full((view.r_pad + 1,), SENTINEL, dtype=torch.int32),
        seq_lens=torch.full((view.r_pad,), SENTINEL, dtype=torch.int32))
    target = types.SimpleNamespace(num_reqs=view.num_reqs, input_ids=t(step.input_ids),
                                   positions=t(step.positions, torch.int64), idx_mapping=t(view.idx),
                                   query_start_loc=t(view.qsl), seq_lens=t(view.seq_lens))
    last = torch.full((view.r_pad,), SENTINEL, dtype=torch.int64)
    prepare_prefill_inputs(last, torch.zeros((), dtype=torch.int64), buffers, target, sampled, rejected,
                           t(last_sampled, torch.int64)[:, None], next_tokens, view.r_pad)
    for name, pad in (("input_ids", pads.DRAFT_REJECTED_INPUT_ID), ("positions", pads.DRAFT_REJECTED_POSITION)):
        vllm = getattr(buffers, name).numpy()
        ours = np.asarray(getattr(draft, name))
        compare(report, "drafter", name, ours, vllm, vllm != SENTINEL)
        stale = (vllm == SENTINEL) & (np.arange(view.t_pad) < view.num_tokens)
        if not (ours[stale] == pad).all():
            report.append(f"drafter: {name}: stale entries {ours[stale].tolist()} are not the pad {pad}")
    for name in ("query_start_loc", "seq_lens"):
        compare(report, "drafter", name, getattr(draft, name), getattr(buffers, name).numpy())
    compare(report, "drafter", "last_token_indices", draft.last_token_indices, last.numpy())
    # _prefill: the last accepted token's position, and the sampling key one past it
    positions = buffers.positions[last[: view.num_reqs]]
    buffers.positions[: view.num_reqs] = positions
    compare(report, "drafter", "decode_positions", np.asarray(draft.decode_positions)[: view.num_reqs], positions)
    compare(report, "drafter", "sample_src_positions", np.asarray(draft.sample_src_positions)[: view.num_reqs],
            positions + 1)
    return buffers


def check_draft_decodes(step, draft, config, view, rejected, buffers, rng, report) -> None:
    from vllm.v1.worker.gpu.spec_decode.target_dependent_ar.speculator import prepare_decode_inputs, update_draft_inputs

    features, n, r_pad = config.features, view.num_reqs, view.r_pad
    k, advance = features.num_speculative_tokens, features.drafter.advance_draft_positions
    draft_tokens = torch.zeros((r_pad, k), dtype=torch.int64)
    draft_tokens[:n, 0] = torch.from_numpy(rng.integers(1, 50_000, n))
    sample_src = torch.full((r_pad,), SENTINEL, dtype=torch.int64)
    sample_src[:n] = buffers.positions[:n] + 1
    prepare_decode_inputs(draft_tokens[:n, 0], t(view.seq_lens), rejected, buffers, sample_src,
                          config.max_model_len, r_pad, advance_draft_positions=advance)
    ours = draft_decode_start(draft, jnp.asarray(draft_tokens[:, 0].numpy(), jnp.int32), step, config=config)
    compare_decode(ours, buffers, sample_src, n, "step 1", report)
    for number in range(1, k - 1):
        tokens = torch.from_numpy(rng.integers(1, 50_000, n))
        update_draft_inputs(tokens, torch.tensor(number), torch.zeros((n, 4)), draft_tokens, torch.zeros((r_pad, 4)),
                            buffers, sample_src, n, config.max_model_len, k, advance_draft_positions=advance)
        ours = draft_decode_advance(ours, jnp.asarray(np.pad(tokens.numpy(), (0, r_pad - n)), jnp.int32), step,
                                    config=config)
        compare_decode(ours, buffers, sample_src, n, f"step {number + 1}", report)


def compare_decode(ours, buffers, sample_src, n: int, label: str, report: list) -> None:
    for name in ("input_ids", "positions"):
        compare(report, "drafter", f"{label} {name}", np.asarray(getattr(ours, name))[:n],
                getattr(buffers, name)[:n].numpy())
    compare(report, "drafter", f"{label} seq_lens", ours.seq_lens, buffers.seq_lens.numpy())
    compare(report, "drafter", f"{label} query_start_loc", ours.query_start_loc, buffers.query_start_loc.numpy())
    compare(report, "drafter", f"{label} sample_src_positions", np.asarray(ours.sample_src_positions)[:n],
            sample_src[:n].numpy())


class _Stream:
    def wait_stream(self, other):
        pass


class _KernelStandIn:
    """``_apply_grammar_bitmask_kernel[grid](...)`` where Triton's interpreter cannot run it (its masked
    store rejects the unpacked bitmask): the kernel's row indexing, and xgrammar's own CPU masking (the
    code the kernel was adapted from) for the bits."""

    def __getitem__(self, grid):
        return self.run

    @staticmethod
    def run(logits, logits_stride, mapping, cu_num_logits, bitmask, bitmask_stride, vocab_size, MASK_STRIDE,
            BLOCK_SIZE):
        import xgrammar

        for k, entry in enumerate(mapping.tolist()):
            req, position = divmod(entry, MASK_STRIDE)
            first, end = int(cu_num_logits[req]), int(cu_num_logits[req + 1])
            if position < end - first:
                xgrammar.apply_token_bitmask_inplace(logits[first + position:first + position + 1], bitmask[k:k + 1])


def check_grammar(step, arrays, config, view: StepView, rng, report: list) -> None:
    from vllm.v1.worker.gpu import structured_outputs
    from vllm.v1.worker.gpu.input_batch import expand_idx_mapping

    stride = 1 + config.features.num_speculative_tokens
    req_ids = [f"req{row}" for row in view.idx]
    order = np.argsort(arrays["grammar_index"])
    grammar_req_ids = [f"req{row}" for row in order if arrays["grammar_index"][row] >= 0]
    num_logits = int(view.cu_num_logits[-1])
    _, local_pos = expand_idx_mapping(t(view.idx), num_logits, t(view.cu_num_logits), stride)
    batch = types.SimpleNamespace(req_ids=req_ids, num_reqs=view.num_reqs, num_draft_tokens=int(view.drafts.sum()),
                                  num_draft_tokens_per_req=view.drafts if view.drafts.sum() else None,
                                  expanded_local_pos=local_pos, cu_num_logits=t(view.cu_num_logits))
    acceptable = [int(rng.integers(0, stride)) for _ in grammar_req_ids] if rng.random() < 0.7 else None
    want = structured_outputs.grammar_invalid_drafts(batch, grammar_req_ids, acceptable)
    invalid, any_invalid = grammar_invalid_drafts(step.grammar, None if acceptable is None
                                                  else jnp.asarray(acceptable + [0], jnp.int32))
    if bool(any_invalid) != (want is not None):
        report.append(f"grammar: any_invalid {bool(any_invalid)}, vLLM returned {want}")
    elif want is not None:
        compare(report, "grammar", "invalid", np.asarray(invalid)[:num_logits], want.numpy())
    logits = rng.standard_normal((step.grammar.bitmask_rows.shape[0], VOCAB)).astype(np.float32)
    bitmask = rng.integers(-(2**31), 2**31, (max(len(grammar_req_ids), 1) * stride, 3)).astype(np.int32)
    vllm_logits = torch.from_numpy(logits.copy())
    with mock.patch.object(torch.cuda, "Stream", _Stream), mock.patch.object(torch.cuda, "stream"), \
            mock.patch.object(torch.cuda, "current_stream", _Stream), \
            mock.patch.object(structured_outputs, "_apply_grammar_bitmask_kernel", _KernelStandIn()):
        worker = structured_outputs.StructuredOutputsWorker(logits.shape[0], VOCAB, torch.device("cpu"), stride)
        worker.apply_grammar_bitmask(vllm_logits, batch, grammar_req_ids, bitmask[: len(grammar_req_ids) * stride])
    ours = apply_grammar_bitmask(jnp.asarray(logits), jnp.asarray(bitmask), step.grammar)
    compare(report, "grammar", "masked logits", np.asarray(ours), vllm_logits.numpy())


def check_hybrid(step, arrays, config, view: StepView, report: list) -> None:
    vllm_meta = vllm_hybrid_metadata(step, arrays, config, view)
    ours, hybrid = step.hybrid, config.features.hybrid
    split = [vllm_meta.num_decodes, vllm_meta.num_prefills, vllm_meta.num_decode_tokens, vllm_meta.num_prefill_tokens]
    compare(report, "hybrid", "split", ours.split, split)
    nd, npf = vllm_meta.num_decodes, vllm_meta.num_prefills
    if npf:
        compare(report, "hybrid", "query_start_loc_p", np.asarray(ours.query_start_loc_p)[: npf + 1],
                vllm_meta.query_start_loc_p.numpy())
        compare(report, "hybrid", "has_initial_states_p", np.asarray(ours.has_initial_states_p)[:npf],
                vllm_meta.has_initial_states_p.numpy())
        compare(report, "hybrid", "state_indices_p", np.asarray(ours.state_indices_p)[:npf],
                vllm_meta.state_indices_tensor_p.numpy())
        check_chunks(ours.chunks, vllm_meta, hybrid, npf, report)
    compare(report, "hybrid", "state_indices_d", np.asarray(ours.state_indices_d)[:nd],
            vllm_meta.state_indices_tensor_d.numpy())
    if config.features.spec_decode and nd:
        compare(report, "hybrid", "query_start_loc_d", np.asarray(ours.query_start_loc_d)[: nd + 1],
                vllm_meta.query_start_loc_d.numpy())
        compare(report, "hybrid", "num_accepted_tokens", np.asarray(ours.num_accepted_tokens)[:nd],
                vllm_meta.num_accepted_tokens.numpy())


def check_chunks(chunks, vllm_meta, hybrid, npf: int, report: list) -> None:
    cu = vllm_meta.cu_chunk_seqlen_p.numpy()
    num = len(cu) - 1
    compare(report, "hybrid", "num_chunks", int(chunks.num_chunks), num)
    compare(report, "hybrid", "cu_chunk_seqlen", np.asarray(chunks.cu_chunk_seqlen)[: num + 1], cu)
    compare(report, "hybrid", "seq_idx", np.asarray(chunks.seq_idx)[:num], vllm_meta.seq_idx_p.numpy())
    compare(report, "hybrid", "last_chunk_indices", np.asarray(chunks.last_chunk_indices)[:npf],
            vllm_meta.last_chunk_indices_p.numpy())
    if hybrid.checkpoints and vllm_meta.checkpoint_chunk_idx is not None:  # vLLM: max(index, 0), None if none
        compare(report, "hybrid", "checkpoint_chunk_indices",
                np.maximum(np.asarray(chunks.checkpoint_chunk_indices)[:npf], 0),
                vllm_meta.checkpoint_chunk_idx.numpy())


def vllm_hybrid_metadata(step, arrays, config, view: StepView):
    """vLLM's Mamba2 builder on the step, with V2's per-row flags (``gather_batch_req_state``, ``prepare_attn``)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.mamba2_attn import Mamba2AttentionMetadataBuilder
    from vllm.v1.kv_cache_interface import MambaSpec

    hybrid, k = config.features.hybrid, config.features.num_speculative_tokens
    rows = view.idx
    computed, prefill_len = arrays["num_computed_tokens"][rows], arrays["prefill_len"][rows]
    scheduled = np.diff(view.qsl)
    prefilling = computed < prefill_len
    runs_as_decode = prefilling & (scheduled - view.drafts == 1) & (np.minimum(computed, prefill_len) > 0)
    prefilling = prefilling & ~runs_as_decode
    builder = object.__new__(Mamba2AttentionMetadataBuilder)
    spec = MambaSpec(block_size=hybrid.block_size or 16, shapes=((1,),), dtypes=(torch.float32,),
                     mamba_cache_mode=hybrid.mode, num_speculative_blocks=hybrid.num_speculative_blocks)
    offsets = arrays.get("mamba_checkpoint_offsets")
    builder.__dict__.update(
        kv_cache_spec=spec, num_spec_tokens=k, use_spec_decode=k > 0, reorder_batch_threshold=1 + k,
        needs_causal_conv1d_metadata=False, use_replayssm=False, use_flashinfer_replayssm=False,
        decode_bc_pre_scratch=None, chunk_size=hybrid.chunk_size, decode_cudagraph_max_bs=view.r_pad,
        vllm_config=types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode=hybrid.mode)),
        compilation_config=types.SimpleNamespace(cudagraph_mode=types.SimpleNamespace(
            has_full_cudagraphs=lambda: False)),
        checkpoint_builder=types.SimpleNamespace(
            build=lambda m, request_rows: checkpoints(offsets, rows, request_rows)))
    table = t(arrays["mamba_block_table"][rows])
    common = CommonAttentionMetadata(
        query_start_loc=t(view.qsl), query_start_loc_cpu=t(view.qsl), seq_lens=t(view.seq_lens),
        num_reqs=view.num_reqs, num_actual_tokens=view.num_tokens, max_query_len=int(scheduled.max()),
        max_seq_len=int(view.seq_lens.max()), block_table_tensor=table, slot_mapping=torch.zeros(0),
        is_prefilling=torch.from_numpy(prefilling), seq_lens_cpu_upper_bound=t(view.seq_lens))
    kwargs = {}
    if k > 0:
        is_decode = ~prefilling & (scheduled > 0) & (scheduled <= k + 1)
        kwargs = dict(num_accepted_tokens=t(arrays["num_accepted_tokens"][rows]),
                      num_decode_draft_tokens_cpu=t(np.where(is_decode, view.drafts, -1)))
    return builder.build(0, common, **kwargs)


def checkpoints(offsets, rows, request_rows):
    """Stands in for ``MambaPrefillCheckpointBuilder.build``: the prefill rows' offsets, None when all are 0."""
    if offsets is None or not any(offsets[rows][r] for r in request_rows):
        return None
    return types.SimpleNamespace(offsets=[int(offsets[rows][r]) for r in request_rows])


def check_ubatches(step, view: StepView, report: list) -> None:
    from vllm.v1.worker.gpu.ubatch_utils import _slice_query_start_loc, _slice_seq_lens, create_ubatch_slices

    ubatches = step.ubatches
    if not bool(ubatches.should_ubatch):
        return
    meta = step.attn_metadata
    batch = types.SimpleNamespace(num_scheduled_tokens=np.diff(view.qsl), num_tokens_after_padding=view.t_pad,
                                  num_reqs_after_padding=view.r_pad, num_reqs=view.num_reqs)
    qsl, seq_lens = t(meta.query_start_loc), t(meta.seq_lens)
    for ours, piece in zip(ubatches.batches, create_ubatch_slices(batch, len(ubatches.batches)), strict=True):
        start, stop = piece.request_slice.start, piece.request_slice.stop
        tokens = piece.token_slice.stop - piece.token_slice.start
        n = min(stop - start, ours.num_reqs_padded)
        want_qsl = _slice_query_start_loc(qsl, torch.zeros(stop - start + 1, dtype=torch.int32), start, stop,
                                          piece.token_slice.start, tokens)
        want_lens = _slice_seq_lens(seq_lens, torch.zeros(stop - start, dtype=torch.int32), qsl, start, stop,
                                    piece.token_slice.stop)
        compare(report, "ubatch", "query_start_loc", np.asarray(ours.attn_metadata.query_start_loc)[: n + 1],
                want_qsl[: n + 1].numpy())
        compare(report, "ubatch", "seq_lens", np.asarray(ours.attn_metadata.seq_lens)[:n], want_lens[:n].numpy())
        compare(report, "ubatch", "tokens", ours.num_tokens_padded, tokens)
        compare(report, "ubatch", "num_reqs", int(ours.attn_metadata.num_reqs),
                max(0, min(stop, view.num_reqs) - start))


def no_pinned_memory() -> None:
    """vLLM stages host copies in pinned memory when it believes it can; with no GPU it cannot."""
    import vllm.utils.torch_utils
    from vllm.v1.worker.gpu import structured_outputs

    vllm.utils.torch_utils.PIN_MEMORY = structured_outputs.PIN_MEMORY = False


def main() -> int:
    """Prints ``REPORT`` + JSON: the comparison over ``NUM_BATCHES`` batches per configuration, and under
    ``control`` the same over ``CONTROL_BATCHES`` batches with every item's jaxprep values shifted by one
    (each item must then differ). One process runs both: vLLM's import and jaxprep's compiles once."""
    global CORRUPT
    no_pinned_memory()
    report = compare_batches(NUM_BATCHES)
    CORRUPT = ITEMS
    try:
        report["control"] = compare_batches(CONTROL_BATCHES)
    finally:
        CORRUPT = ()
    print("REPORT " + json.dumps(report))
    return 0


def compare_batches(num_batches: int) -> dict:
    """Every configuration of `CONFIGS` over ``num_batches`` random batches against vLLM's code."""
    report = {"cases": {}, "mismatches": [], "covered": {"chunks": 0, "rejections": 0, "invalid": 0, "straddles": 0,
                                                       "checkpoints": 0, "prefill_chunks": 0}}
    for label, features in CONFIGS.items():
        config = PrepConfig(max_num_reqs=6, max_model_len=48, max_num_batched_tokens=40, block_size=4,
                            features=features)
        rng = np.random.default_rng(sum(map(ord, label)))
        for _ in range(num_batches):
            arrays = batch_arrays(config, rng)
            step = run_step(arrays, config, "jit")
            view = StepView(step, arrays, config)
            mismatches = []
            if features.drafter is not None:
                check_drafter(step, arrays, config, view, rng, mismatches)
            check_grammar(step, arrays, config, view, rng, mismatches)
            check_hybrid(step, arrays, config, view, mismatches)
            check_ubatches(step, view, mismatches)
            report["mismatches"] += [f"[{label}] {m}" for m in mismatches]
            report["cases"][label] = report["cases"].get(label, 0) + 1
            count_coverage(report["covered"], step, arrays, view)
    return report


def count_coverage(covered: dict, step, arrays: dict, view: StepView) -> None:
    """What the drawn batches exercised (the test asserts each was seen)."""
    covered["chunks"] += int(step.hybrid.chunks.num_chunks) > 1
    covered["prefill_chunks"] += bool(np.asarray(step.hybrid.is_prefilling).any())
    covered["checkpoints"] += bool(step.hybrid.chunks.checkpoint_chunk_indices is not None
                                   and (np.asarray(step.hybrid.chunks.checkpoint_chunk_indices) >= 0).any())
    covered["rejections"] += bool(view.drafts.any())
    covered["invalid"] += bool((arrays["grammar_index"] >= 0).any())
    first = step.ubatches.batches[0].attn_metadata
    covered["straddles"] += bool(step.ubatches.should_ubatch) and int(first.num_actual_tokens) > 0 and \
        int(np.asarray(first.query_start_loc)[int(first.num_reqs)]) == step.ubatches.batches[0].num_tokens_padded


if __name__ == "__main__":
    sys.exit(main())
