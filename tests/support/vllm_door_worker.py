"""Issue 31, vLLM's door: vLLM 0.33.0's real ``Scheduler`` through `jaxprep.serving.host.vllm.VllmAdapter` in the
situations the parity worker does not cover, each step compared with vLLM V1's own runner; and vLLM's own
outputs and jaxprep's own update buffers corrupted, the whole state compared before and after.

Started by tests/serving/test_vllm_door.py in a subprocess (``TRITON_INTERPRET=1``, ``CUDA_VISIBLE_DEVICES=""``,
as tests/support/vllm_adapter_worker.py, whose comparisons it reuses). Runs, each in both runner modes
(``VLLM_USE_V2_MODEL_RUNNER=0/1``) unless noted, tiny shapes:

- ``pad spec decode`` / ``pad via prefix cache``: n-gram drafts (K = 2) with the sync scheduler; 1-3-token
  prompts arriving while others decode, or prompts the prefix cache covers but for their last token: vLLM
  pads them with ``[-1] * K`` placeholder drafts (``pad_spec_decode``). Every field of the parity worker is
  compared with V1's ``_update_states`` + ``_prepare_inputs``, and in V2 mode with MRV2's kernels;
- ``M-RoPE text``: ``FeatureConfig(mrope=True)``, chunked prefill and preemption; V1's runner with
  ``uses_mrope`` on and vLLM's own Qwen2-VL ``get_mrope_input_positions`` as its model's (the rest of the model
  is not needed): ``mrope_positions`` compared per request, on top of every other field;
- ``structured outputs``: requests with a grammar (a fake one in vLLM's real ``StructuredOutputManager``: its
  bitmask layout and ``GrammarOutput`` are vLLM's, its rows depend on the request and its state), n-gram
  drafts: per request, the logits rows vLLM V1's ``apply_grammar_bitmask`` masks on zero logits against the
  rows jaxprep's ``apply_grammar_bitmask`` masks with the step's ``GrammarMetadata`` and the
  ``GrammarOutput``'s bitmask; a control with the bitmask's request blocks reversed must disagree;
- ``M-RoPE image`` (V1 mode, hand-built outputs: vLLM's scheduler needs a multimodal model to schedule
  images): a request with an image and one without, in two prefill chunks, then decodes; the adapter's
  ``mrope_positions`` hook from `jaxprep.qwen2vl_prompt_positions` against V1's runner with Qwen2-VL's code;
- corruption (in ``pad spec decode``, V1 mode, fixed seed): before each real step, some of vLLM's
  ``SchedulerOutput``s deep-copied with one field broken (`CORRUPTIONS`) must be refused with a
  ``ValueError`` and leave the device state, the host mirror and the adapter's maps equal to before, bit for
  bit; and one word of the step's real packed update buffer, applied to a copy of the state, must either
  set a bit of the error word with nothing else changed, or leave every value the device keeps in bounds.

Every compared field is compared again shifted by one (the parity worker's controls): the report counts
the steps that caught the shift.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: the support package

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jaxprep
from jaxprep.features.grammar import apply_grammar_bitmask
from jaxprep.serving import ServingConfig
from jaxprep.serving.host.vllm import VllmAdapter
from jaxprep.serving.state import ERROR_BITS
from jaxprep.serving.transitions import apply_packed
from jaxprep.serving.update_packing import HEADER_WORDS, pack_step
from support.vllm_adapter_worker import (
    FIELDS,
    Comparison,
    as_v1_output,
    compare_step,
    host_step,
    record,
    v2_kernels,
)
from support.vllm_scheduler import VOCAB_SIZE, Requests, Workload, fake_token, make_scheduler
from support.vllm_v1_runner import V1Runner

PAD = Workload("pad spec decode", num_steps=14, max_num_seqs=6, max_model_len=64, num_blocks=40,
               num_speculative_tokens=2, num_requests=8, prompt_lens=(1, 3), max_tokens=(4, 9), seed=3)
PAD_PREFIX = Workload("pad via prefix cache", num_steps=10, max_num_seqs=6, max_model_len=64, num_blocks=40,
                      num_speculative_tokens=2, num_requests=5, prompt_lens=(17, 17), shared_prefix=16,
                      prefix_caching=True, max_tokens=(3, 6), seed=4)
MROPE = Workload("M-RoPE text", num_steps=12, max_num_seqs=4, max_model_len=64, num_blocks=9,
                 max_num_batched_tokens=16, num_requests=6, prompt_lens=(8, 20), max_tokens=(6, 12), seed=5)
GRAMMAR = Workload("structured outputs", num_steps=10, max_num_seqs=4, max_model_len=64, num_blocks=40,
                   num_speculative_tokens=2, num_requests=4, prompt_lens=(3, 10), max_tokens=(4, 8), seed=6)
EXTRA_FIELDS = ("mrope_positions", "grammar_mask")


def door_config(work: Workload, **features) -> ServingConfig:
    """vLLM's sizes; one token bucket (the budget vLLM may raise to fit the drafts: 48)."""
    prep = jaxprep.PrepConfig(max_num_reqs=work.max_num_seqs, max_model_len=work.max_model_len,
                              max_num_batched_tokens=48, block_size=work.block_size, num_blocks=work.num_blocks,
                              features=jaxprep.FeatureConfig(discard_request_mask=True, **features),
                              token_buckets=(48,))
    return ServingConfig(prep=prep, vocab_size=VOCAB_SIZE)


# --- structured outputs: a fake grammar inside vLLM's real manager ---------------------------------------

class FakeGrammar:
    """vLLM's ``StructuredOutputGrammar`` interface; accepts everything, its bitmask row allows the tokens with
    ``(t * (3 + seed) + position) % 5 != 0``, so each request and each draft position has its own row."""

    def __init__(self, seed: int):
        self.seed, self.position = seed, 0

    def accept_tokens(self, request_id, tokens) -> bool:
        self.position += len(tokens)
        return True

    def validate_tokens(self, tokens):
        return list(tokens)

    def rollback(self, num_tokens: int) -> None:
        self.position -= num_tokens

    def fill_bitmask(self, bitmask, index: int) -> None:
        words = bitmask.shape[1]
        allowed = (np.arange(words * 32) * (3 + self.seed) + self.position) % 5 != 0
        bits = allowed.reshape(words, 32).astype(np.uint64) << np.arange(32, dtype=np.uint64)
        bitmask[index] = torch.from_numpy(bits.sum(axis=1).astype(np.uint32).view(np.int32))

    def is_terminated(self) -> bool:
        return False

    def reset(self) -> None:
        self.position = 0


class FakeBackend:
    def __init__(self):
        self.compiled = 0

    def compile_grammar(self, request_type, grammar_spec, stop_token_ids=None):
        self.compiled += 1
        return FakeGrammar(self.compiled)

    def allocate_token_bitmask(self, num_rows: int):
        return torch.full((num_rows, (VOCAB_SIZE + 31) // 32), -1, dtype=torch.int32)

    def destroy(self) -> None:
        pass


def with_grammar(scheduler, requests: Requests):
    """``requests.make`` with a grammar on every other request (a regex, compiled by `FakeBackend`)."""
    from vllm.sampling_params import SamplingParams, StructuredOutputsParams
    from vllm.v1.request import Request

    manager = scheduler.structured_output_manager
    manager.backend, manager.backend_name, manager._use_async_grammar_compilation = FakeBackend(), "xgrammar", False

    def make():
        plain = requests.make()
        if requests.made % 2:
            return plain
        params = SamplingParams(max_tokens=plain.sampling_params.max_tokens, ignore_eos=True, temperature=0.0,
                                structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
        params.structured_outputs._backend = "xgrammar"
        request = Request(plain.request_id, plain.prompt_token_ids, params, None, block_hasher=requests.block_hasher)
        manager.grammar_init(request)
        return request

    return make


def grammar_masks(so, grammar_output, runner: V1Runner, vllm: dict, step, reverse: bool = False) -> dict:
    """Per request: its logits rows' allowed tokens (0/1, [D + 1, V]) as V1's ``apply_grammar_bitmask`` and as
    jaxprep's ``apply_grammar_bitmask`` mask zero logits; ``reverse``: jaxprep's with the request blocks of the
    bitmask reversed (a control)."""
    from vllm.v1.structured_output.utils import apply_grammar_bitmask as v1_apply

    drafts = vllm.get("spec", {}).get("num_draft_tokens", np.zeros(len(vllm["req_ids"]), np.int32))
    theirs = torch.zeros((int((drafts + 1).sum()), VOCAB_SIZE), dtype=torch.float32)
    v1_apply(so, grammar_output, runner.runner.input_batch, theirs)
    bitmask = step.grammar_bitmask
    if reverse:
        stride = bitmask.shape[0] // len(grammar_output.structured_output_request_ids)
        bitmask = bitmask.reshape(-1, stride, bitmask.shape[1])[::-1].reshape(bitmask.shape)
    grammar = step.inputs.grammar
    ours = np.asarray(apply_grammar_bitmask(jnp.zeros((grammar.bitmask_rows.shape[0], VOCAB_SIZE), jnp.float32),
                                            jnp.asarray(bitmask), grammar))
    spec = step.inputs.spec_decode
    cu_ours = np.asarray(spec.cu_num_sampled_tokens) if spec is not None else np.arange(1, len(step.req_ids) + 1)
    cu_theirs = np.cumsum(drafts + 1)
    out = {}
    for i, req_id in enumerate(vllm["req_ids"]):
        b = step.req_id_to_index[req_id]
        mine = ours[(cu_ours[b - 1] if b else 0):cu_ours[b]]
        other = theirs.numpy()[(cu_theirs[i - 1] if i else 0):cu_theirs[i]]
        out[req_id] = (np.isfinite(mine).astype(np.int64), np.isfinite(other).astype(np.int64))
    return out


# --- M-RoPE: V1's runner with Qwen2-VL's position code ----------------------------------------------------

def qwen2vl_position_code() -> dict:
    """vLLM's own ``Qwen2VLForConditionalGeneration.get_mrope_input_positions`` and ``iter_mm_grid_thw``, read
    from vLLM's source file and compiled alone: importing the model module needs torchvision, which only its
    image processor uses."""
    import ast
    import collections.abc
    import importlib.util

    from vllm.multimodal.inputs import MultiModalFeatureSpec

    path = importlib.util.find_spec("vllm.model_executor.models.qwen2_vl").origin
    with open(path) as source:
        tree = ast.parse(source.read())
    model = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen2VLForConditionalGeneration")
    methods = [n for n in model.body if isinstance(n, ast.FunctionDef)
               and n.name in ("get_mrope_input_positions", "iter_mm_grid_thw")]
    namespace = dict(np=np, torch=torch, Iterator=collections.abc.Iterator, MultiModalFeatureSpec=MultiModalFeatureSpec)
    exec(compile(ast.Module(body=methods, type_ignores=[]), path, "exec"), namespace)
    return {name: namespace[name] for name in ("get_mrope_input_positions", "iter_mm_grid_thw")}


def enable_mrope(runner: V1Runner) -> None:
    """V1's runner computes M-RoPE positions (``uses_mrope``) with vLLM's Qwen2-VL ``get_mrope_input_positions``
    (merge size 2): its model is a stand-in that has only that code."""
    code = qwen2vl_position_code()

    class Qwen2VLPositions:
        supports_mrope = True
        config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2, tokens_per_second=1.0))
        get_mrope_input_positions = code["get_mrope_input_positions"]
        iter_mm_grid_thw = code["iter_mm_grid_thw"]

    inner = runner.runner
    inner.uses_mrope = True
    inner.mrope_positions = inner._make_buffer((3, inner.max_num_tokens + 1), dtype=torch.int64)
    inner.model = Qwen2VLPositions()


def extra_compare(cmp: Comparison, number: int, step, ours: dict, vllm: dict, extras: dict) -> None:
    """M-RoPE positions and grammar masks, per request, through ``cmp`` (so its shift control applies)."""
    for i, req_id in enumerate(vllm["req_ids"]):
        b = step.req_id_to_index[req_id]
        mine = slice(ours["qsl"][b], ours["qsl"][b + 1])
        theirs = slice(vllm["query_start_loc"][i], vllm["query_start_loc"][i + 1])
        if "mrope" in extras:
            cmp.check(number, req_id, "mrope_positions", np.asarray(step.inputs.mrope_positions)[:, mine],
                      extras["mrope"][:, theirs])
        if req_id in extras.get("grammar", {}):
            cmp.check(number, req_id, "grammar_mask", *extras["grammar"][req_id])


def controls(caught: dict, label: str, number: int, adapter, step, ours, vllm, v2, extras) -> None:
    for field in FIELDS + EXTRA_FIELDS:
        shifted = Comparison(label, corrupt=field)
        compare_step(shifted, number, adapter, step, ours, vllm, v2)
        extra_compare(shifted, number, step, ours, vllm, extras)
        if shifted.compared:
            seen = caught.setdefault(field, [0, 0])
            seen[0] += 1
            seen[1] += bool(shifted.mismatches)


# --- one run -----------------------------------------------------------------------------------------------

def run(work: Workload, v2_mode: bool, report: dict, features: dict, *, mrope=False, grammar=False,
        corrupt: np.random.Generator | None = None) -> None:
    from vllm.v1.outputs import DraftTokenIds

    started = time.perf_counter()
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if v2_mode else "0"
    scheduler, requests, runner = make_scheduler(work), Requests(work), V1Runner(work)
    if mrope:
        enable_mrope(runner)
    make = with_grammar(scheduler, requests) if grammar else requests.make
    label = f"{work.name} [{'V2' if v2_mode else 'V1'}]"
    adapter, cmp = VllmAdapter(door_config(work, **features)), Comparison(label)
    queue = [str(name) for name in corrupt.permutation(list(CORRUPTIONS))] if corrupt is not None else []
    stats = dict(steps=0, placeholders=0, padded_new=0, padded_prefix_hit=0, preempted=0, grammar_rows=0,
                 grammar_reversed_caught=0, grammar_reversed=0)
    for number in range(work.num_steps):
        if number % 3 == 0:
            for _ in range(min(work.arrivals_per_step, work.num_requests - requests.made)):
                scheduler.add_request(make())
        so = scheduler.schedule()
        grammar_output = scheduler.get_grammar_bitmask(so) if grammar else None
        coverage(stats, so, grammar_output)
        if corrupt is not None:
            corrupt_outputs(report["corruption"], adapter, so, corrupt, queue)
        if so.total_num_scheduled_tokens == 0:
            adapter.step(so, grammar_output)
            runner.update_only(so, v2_mode)
            continue
        if corrupt is not None:
            corrupt_buffer(report["buffers"], adapter, so, grammar_output, corrupt)
            before = snapshot(adapter)
        step = adapter.step(so, grammar_output)
        if corrupt is not None:  # control: the snapshot sees what a real step changes
            report["corruption_controls"].append(bool(differences(before, snapshot(adapter))))
        vllm = runner.prepare(as_v1_output(so) if v2_mode else so, v2_mode)
        v2 = v2_kernels(so, vllm, runner, work.num_speculative_tokens) if v2_mode else None
        extras = {}
        if mrope:
            extras["mrope"] = runner.runner.mrope_positions.cpu[:, :so.total_num_scheduled_tokens].numpy().copy()
        if grammar_output is not None:
            extras["grammar"] = grammar_masks(so, grammar_output, runner, vllm, step)
            if len(grammar_output.structured_output_request_ids) > 1:  # the blocks reversed must disagree
                reversed_masks = grammar_masks(so, grammar_output, runner, vllm, step, reverse=True)
                stats["grammar_reversed"] += 1
                stats["grammar_reversed_caught"] += any(not np.array_equal(*pair) for pair in reversed_masks.values())
        ours = host_step(adapter, step)
        compare_step(cmp, number, adapter, step, ours, vllm, v2)
        extra_compare(cmp, number, step, ours, vllm, extras)
        controls(report["caught"], label, number, adapter, step, ours, vllm, v2, extras)
        sampled = runner.sampled(vllm)
        runner.record(so, vllm, sampled)
        by_id = dict(zip(vllm["req_ids"], sampled))
        record(adapter, step, by_id, 1 + work.num_speculative_tokens)
        scheduler.update_from_output(so, adapter.runner_output(step, [by_id[r] for r in step.req_ids]))
        if work.num_speculative_tokens:
            scheduler.update_draft_token_ids(DraftTokenIds(*runner.propose_drafts(vllm, sampled)))
    errors = adapter.batch.errors()
    if any(errors.values()):
        cmp.mismatches.append(f"[{label}] device error bits {errors}")
    report["runs"][label] = dict(stats, compared=sorted(cmp.compared), seconds=round(time.perf_counter() - started, 1))
    report["mismatches"] += cmp.mismatches[:40]


def coverage(stats: dict, so, grammar_output) -> None:
    """Steps, placeholder drafts (and the requests padded with them: new, or a prefix-cache hit), preemptions,
    grammar bitmask rows."""
    stats["steps"] += 1
    stats["preempted"] += len(so.preempted_req_ids or ())
    new = {n.req_id: n for n in so.scheduled_new_reqs}
    for req_id, ids in so.scheduled_spec_decode_tokens.items():
        if -1 in ids:
            stats["placeholders"] += ids.count(-1)
            if req_id in new:
                stats["padded_prefix_hit" if new[req_id].num_computed_tokens else "padded_new"] += 1
    if grammar_output is not None:
        stats["grammar_rows"] += grammar_output.grammar_bitmask.shape[0]


# --- M-RoPE with an image: hand-built outputs ---------------------------------------------------------------

def image_positions(new) -> tuple[np.ndarray, int]:
    """The adapter's ``mrope_positions`` hook: jaxprep's Qwen2-VL positions from the request's features."""
    segments, start = [], 0
    for feature in sorted(new.mm_features, key=lambda f: f.mm_position.offset):
        segments += [feature.mm_position.offset - start, ("image", tuple(feature.data["image_grid_thw"].data.tolist()))]
        start = feature.mm_position.offset + feature.mm_position.length
    segments.append(len(new.prompt_token_ids) - start)
    return jaxprep.qwen2vl_prompt_positions(segments, spatial_merge_size=2)


def run_image(report: dict) -> None:
    """``m``: 3 text tokens, an image of grid (1, 4, 4) (4 tokens at merge size 2), 5 text tokens; ``t``: 6 text
    tokens. Step 0: m's first 6 tokens and all of t; step 1: m's other 6; steps 2-3: both decode."""
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    work = Workload("M-RoPE image", num_steps=4, max_num_seqs=4, max_model_len=64, num_blocks=12)
    runner = V1Runner(work)
    enable_mrope(runner)
    adapter = VllmAdapter(door_config(work, mrope=True), mrope_positions=image_positions)
    image = MultiModalFeatureSpec(data={"image_grid_thw": SimpleNamespace(data=torch.tensor([1, 4, 4]))},
                                  modality="image", identifier="image-0",
                                  mm_position=PlaceholderRange(offset=3, length=4))
    prompts = {"m": [11, 12, 13, 99, 99, 99, 99, 14, 15, 16, 17, 18], "t": [21, 22, 23, 24, 25, 26]}
    blocks = {"m": [1, 2], "t": [3, 4]}

    def new(req_id, features):
        return NewRequestData(req_id=req_id, prompt_token_ids=prompts[req_id], mm_features=features,
                              sampling_params=SamplingParams(max_tokens=4, temperature=0.0), pooling_params=None,
                              block_ids=(blocks[req_id],), num_computed_tokens=0, lora_request=None)

    def output(scheduled, new_reqs=(), cached=()):
        cached_data = CachedRequestData(req_ids=[c[0] for c in cached], resumed_req_ids=set(), new_token_ids=[],
                                        all_token_ids={}, new_block_ids=[None] * len(cached),
                                        num_computed_tokens=[c[1] for c in cached],
                                        num_output_tokens=[c[2] for c in cached])
        return SchedulerOutput(scheduled_new_reqs=list(new_reqs), scheduled_cached_reqs=cached_data,
                               num_scheduled_tokens=scheduled, total_num_scheduled_tokens=sum(scheduled.values()),
                               scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={}, finished_req_ids=set(),
                               free_encoder_mm_hashes=[])

    outputs = [output({"m": 6, "t": 6}, [new("m", [image]), new("t", [])]),
               output({"m": 6, "t": 1}, cached=[("m", 6, 0), ("t", 6, 1)]),
               output({"m": 1, "t": 1}, cached=[("m", 12, 1), ("t", 7, 2)]),
               output({"m": 1, "t": 1}, cached=[("m", 13, 2), ("t", 8, 3)])]
    cmp, label = Comparison("M-RoPE image [V1]"), "M-RoPE image [V1]"
    for number, so in enumerate(outputs):
        step = adapter.step(so)
        vllm = runner.prepare(so)
        extras = {"mrope": runner.runner.mrope_positions.cpu[:, :so.total_num_scheduled_tokens].numpy().copy()}
        ours = host_step(adapter, step)
        compare_step(cmp, number, adapter, step, ours, vllm)
        extra_compare(cmp, number, step, ours, vllm, extras)
        controls(report["caught"], label, number, adapter, step, ours, vllm, None, extras)
        sampled = [[fake_token(r, int(vllm["seq_lens"][i]))] if not vllm["discard"][i] else []
                   for i, r in enumerate(vllm["req_ids"])]
        runner.record(so, vllm, sampled)
        record(adapter, step, dict(zip(vllm["req_ids"], sampled)), 1)
    report["runs"][label] = dict(steps=len(outputs), compared=sorted(cmp.compared),
                                 image_delta=int(image_positions(outputs[0].scheduled_new_reqs[0])[1]))
    report["mismatches"] += cmp.mismatches[:40]


# --- corruption --------------------------------------------------------------------------------------------

def _pick(rng, items):
    items = list(items)
    return items[int(rng.integers(len(items)))] if items else None


def _counts(so, rng, value):
    req_id = _pick(rng, so.num_scheduled_tokens)
    so.num_scheduled_tokens[req_id] = value(so.num_scheduled_tokens[req_id])


def _cached_list(name, cut):
    def corrupt(so, rng):
        cached = so.scheduled_cached_reqs
        if not cached.req_ids:
            return False
        setattr(cached, name, cut(list(getattr(cached, name))))
    return corrupt


def _new_req(change):
    def corrupt(so, rng):
        new = _pick(rng, so.scheduled_new_reqs)
        if new is None:
            return False
        return change(new, so)
    return corrupt


def _running(change):
    def corrupt(so, rng):
        cached = so.scheduled_cached_reqs
        running = [r for r in cached.req_ids if r not in cached.resumed_req_ids]
        if not running:
            return False
        return change(so, _pick(rng, running))
    return corrupt


def _spec(ids):
    """Drafts ``ids`` for a running request, its count and the total raised to fit them (1 + D)."""
    def change(so, req_id):
        so.scheduled_spec_decode_tokens[req_id] = ids
        so.num_scheduled_tokens[req_id] = len(ids) + 1
        so.total_num_scheduled_tokens = sum(so.num_scheduled_tokens.values())
    return _running(change)


def _add_unknown(so) -> None:
    """An unknown id scheduled beside the others (the total raised to match)."""
    so.num_scheduled_tokens["zz"] = 1
    so.total_num_scheduled_tokens += 1


def _rename(so, rng):
    """A scheduled request's id replaced by an unknown one in num_scheduled_tokens (the counts still add up)."""
    req_id = _pick(rng, so.num_scheduled_tokens)
    so.num_scheduled_tokens["zz"] = so.num_scheduled_tokens.pop(req_id)


CORRUPTIONS = {
    "num_scheduled_tokens 1.5": lambda so, rng: _counts(so, rng, lambda n: n + 0.5),
    "num_scheduled_tokens 0.5": lambda so, rng: _counts(so, rng, lambda n: 0.5),
    "num_scheduled_tokens 0": lambda so, rng: _counts(so, rng, lambda n: 0),
    "num_scheduled_tokens -1": lambda so, rng: _counts(so, rng, lambda n: -1),
    "total_num_scheduled_tokens + 1": lambda so, rng: setattr(so, "total_num_scheduled_tokens",
                                                              so.total_num_scheduled_tokens + 1),
    "total_num_scheduled_tokens float": lambda so, rng: setattr(so, "total_num_scheduled_tokens",
                                                                so.total_num_scheduled_tokens + 0.5),
    "unknown id added to num_scheduled_tokens": lambda so, rng: _add_unknown(so),
    "unknown id in place of a scheduled one": _rename,
"unknown id in drafts": lambda so, rng: so.scheduled_spec_decode_tokens.update(zz=[5]),
    "K + 1 drafts": _spec([5, 6, 7]),
    "fractional draft id": _spec([5.5]),
    "draft id past the vocabulary": _spec([VOCAB_SIZE + 3]),
    "draft id below -1": _spec([-2]),
    "placeholders on a running request": _running(lambda so, r: so.scheduled_spec_decode_tokens.update({r: [-1, -1]})
                                                  or so.num_scheduled_tokens.__setitem__(r, 3)
                                                  or setattr(so, "total_num_scheduled_tokens",
                                                             sum(so.num_scheduled_tokens.values()))),
    "CachedRequestData.num_computed_tokens short": _cached_list("num_computed_tokens", lambda v: v[:-1]),
    "CachedRequestData.new_block_ids short": _cached_list("new_block_ids", lambda v: v[:-1]),
    "CachedRequestData.num_computed_tokens fractional": _cached_list("num_computed_tokens",
                                                                     lambda v: [v[0] + 0.5] + v[1:]),
    "CachedRequestData.num_computed_tokens past the tokens": _cached_list("num_computed_tokens",
                                                                          lambda v: [v[0] + 1000] + v[1:]),
    "CachedRequestData.req_ids unknown": _cached_list("req_ids", lambda v: ["zz"] + v[1:]),
    "resumed_req_ids not in req_ids": lambda so, rng: setattr(so.scheduled_cached_reqs, "resumed_req_ids", {"zz"}),
    "flat block_ids": _new_req(lambda new, so: setattr(new, "block_ids", list(new.block_ids[0]) or [1])),
    "block_ids with an extra group": _new_req(lambda new, so: setattr(new, "block_ids", (*new.block_ids, [1]))),
    "block id outside the cache": _new_req(lambda new, so: setattr(new, "block_ids", ([10_000],))),
    "NewRequestData.num_computed_tokens 0.5": _new_req(lambda new, so: setattr(new, "num_computed_tokens", 0.5)),
    "prompt token id past the vocabulary": _new_req(lambda new, so: setattr(new, "prompt_token_ids",
                                                                            [VOCAB_SIZE + 7] + new.prompt_token_ids[1:])
                                                    or setattr(new, "prefill_token_ids", None)),
    "a new request twice": _new_req(lambda new, so: so.scheduled_new_reqs.append(copy.deepcopy(new))),
    "has_structured_output_requests without a GrammarOutput": lambda so, rng: setattr(
        so, "has_structured_output_requests", True),
    "a scheduled request finished": _running(lambda so, r: so.finished_req_ids.add(r)),
    "a scheduled request preempted": _running(lambda so, r: setattr(so, "preempted_req_ids", {r})),
}
"""One field of vLLM's ``SchedulerOutput`` broken; a corruption that does not apply to the output returns False."""


def snapshot(adapter: VllmAdapter) -> dict:
    batch = adapter.batch
    return dict(state_object=batch.state, state=batch.state.to_numpy(),
                mirror={name: value.copy() for name, value in vars(batch.rows).items()},
                rows=dict(adapter.rows), admitted={k: id(v) for k, v in adapter.admitted.items()},
                free=list(adapter._free), verifying=dict(adapter._verifying), last=id(adapter._last),
                h2d=batch.h2d_bytes, lora=None if adapter._lora_slots is None else adapter._lora_slots.copy())


def differences(before: dict, after: dict) -> list[str]:
    out = [name for name in ("rows", "admitted", "free", "verifying", "last", "h2d") if before[name] != after[name]]
    if before["state_object"] is not after["state_object"]:
        out.append("state (another object: something was dispatched)")
    out += [f"state.{k}" for k in before["state"] if not np.array_equal(before["state"][k], after["state"][k])]
    out += [f"mirror.{k}" for k in before["mirror"] if not np.array_equal(before["mirror"][k], after["mirror"][k])]
    return out


def corrupt_outputs(report: dict, adapter: VllmAdapter, so, rng: np.random.Generator, queue: list) -> None:
    """Up to three corruptions of ``so`` (each on a deep copy) tried before the real step, those longest untried
    first (``queue``: every kind, in the order to try; one that does not apply to this output waits); each must
    be refused with a ``ValueError`` and nothing changed."""
    applied = 0
    for name in list(queue):
        if applied == 3:
            break
        broken = copy.deepcopy(so)
        if CORRUPTIONS[name](broken, rng) is False:
            continue
        queue.remove(name)
        queue.append(name)
        applied += 1
        before = snapshot(adapter)
        entry = report.setdefault(name, dict(cases=0, refused=0, unchanged=0, messages=[]))
        entry["cases"] += 1
        try:
            adapter.step(broken)
        except ValueError as error:
            entry["refused"] += 1
            if len(entry["messages"]) < 2:
                entry["messages"].append(f"{type(error).__name__}: {str(error)[:160]}")
        except Exception as error:
            entry["messages"].append(f"UNNAMED {type(error).__name__}: {str(error)[:160]}")
        changed = differences(before, snapshot(adapter))
        entry["unchanged"] += not changed
        if changed:
            entry["messages"].append(f"changed: {changed[:6]}")


BAD_WORDS = (-(2 ** 31), -5, -1, 0, 1, 2, 7, 255, 5000, 2 ** 31 - 1)


def corrupt_buffer(report: dict, adapter: VllmAdapter, so, grammar_output, rng: np.random.Generator) -> None:
    """One word of the step's real packed buffer (header or content) replaced, applied to a copy of the state:
    flagged with nothing else changed, or every kept value in bounds (`out_of_bounds`)."""
    updates = adapter.updates(so, grammar_output)
    buffers = pack_step(adapter.config, updates, adapter.batch.rows.table_blocks).buffers
    clean = apply_packed(jax.tree.map(jnp.copy, adapter.batch.state), buffers[0], config=adapter.config)
    report["clean_flagged"] += bool(int(clean.errors[0]) & (ERROR_BITS["packed_counts"] | ERROR_BITS["packed_values"]))
    for _ in range(2):
        buffer = buffers[int(rng.integers(len(buffers)))].copy()
        used = max(HEADER_WORDS, int(np.flatnonzero(buffer)[-1]) + 1 if buffer.any() else 0)
        word = int(rng.integers(used))
        old = int(buffer[word])
        new = _pick(rng, [w for w in BAD_WORDS + (old + 1, old - 1) if w != old and -2**31 <= w < 2**31])
        buffer[word] = new
        state = jax.tree.map(jnp.copy, adapter.batch.state)
        before = state.to_numpy()
        after = apply_packed(state, buffer, config=adapter.config).to_numpy()
        flagged = int(after["errors"][0]) & (ERROR_BITS["packed_counts"] | ERROR_BITS["packed_values"])
        report["cases"] += 1
        if flagged:
            report["flagged"] += 1
            changed = [k for k in before if k != "errors" and not np.array_equal(before[k], after[k])]
            if changed:
                report["failures"].append(f"word {word}: {old} -> {new} flagged but wrote {changed[:4]}")
        else:
            problems = out_of_bounds(after, adapter.config)
            if problems:
                report["failures"].append(f"word {word}: {old} -> {new} not flagged and {problems[:4]}")


def out_of_bounds(state: dict, config: ServingConfig) -> list[str]:
    """What a state holds outside the bounds the device reads it within: per busy row 1 <= num_tokens <=
    stop_len <= max_model_len and 0 <= num_computed_tokens <= num_tokens, its tokens in the vocabulary; free rows
    all 0; block ids in [0, num_blocks), group 0's column count within the width; counts non-negative."""
    length, busy = config.max_model_len, state["num_tokens"] > 0
    tokens, computed, stop = state["num_tokens"], state["num_computed_tokens"], state["stop_len"]
    problems = []
    if ((tokens < 0) | (tokens > length)).any():
        problems.append("num_tokens")
    if (busy & ((stop < tokens) | (stop > length))).any() or (~busy & (stop != 0)).any():
        problems.append("stop_len")
    if (busy & ((computed < 0) | (computed > tokens))).any() or (~busy & (computed != 0)).any():
        problems.append("num_computed_tokens")
    table = state["token_ids"]
    columns = np.arange(table.shape[1])[None, :] < tokens[:, None]
    if (columns & ((table < 0) | (table >= config.token_id_bound))).any():
        problems.append("token_ids")
    if ((state["block_table"] < 0) | (state["block_table"] > config.prep.max_block_id)).any():
        problems.append("block_table")
    if ((state["num_blocks"] < 0) | (state["num_blocks"] > config.max_blocks_per_req)).any():
        problems.append("num_blocks")
    for name in ("num_scheduled_tokens", "num_draft_tokens"):
        if (state[name] < 0).any():
            problems.append(name)
    return problems


def main() -> int:
    report = {"runs": {}, "mismatches": [], "caught": {}, "corruption": {}, "corruption_kinds": list(CORRUPTIONS),
              "corruption_controls": [], "buffers": dict(cases=0, flagged=0, failures=[], clean_flagged=0)}
    spec = dict(num_speculative_tokens=2)
    for v2_mode in (False, True):
        run(PAD, v2_mode, report, spec, corrupt=None if v2_mode else np.random.default_rng(31))
        run(PAD_PREFIX, v2_mode, report, spec)
        run(MROPE, v2_mode, report, dict(mrope=True), mrope=True)
        run(GRAMMAR, v2_mode, report, dict(spec, structured_outputs=True), grammar=True)
    run_image(report)
    bad = {name: value.copy() for name, value in VllmAdapter(door_config(PAD)).batch.state.to_numpy().items()}
    bad["num_tokens"][0] = PAD.max_model_len + 1  # control: out_of_bounds sees a row past max_model_len
    report["buffers"]["bounds_control"] = out_of_bounds(bad, door_config(PAD))
    print("REPORT " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
