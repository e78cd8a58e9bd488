"""JAX's own Pallas paged-attention kernels fed by jaxprep's prepared step, against the NumPy oracle.

The GPU kernel runs in Pallas interpret mode on CPU. The TPU ragged kernel cannot run in interpret mode
on jax 0.10.2 (a strict xfail records the failure), so its input contract (layout, kv_lens, page_indices,
cu_q_lens, num_seqs) is checked through the kernel module's own reference, `ref_ragged_paged_attention`.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxprep.attention import (
    auto_kind,
    gpu_paged_attention,
    to_gpu_pages,
    to_tpu_kv_pages,
    tpu_ragged_paged_attention,
)
from jaxprep.attention.pallas import gpu_kernel_table
from support.attention_batches import CONFIG, attention_cases, longer_row, shifted_block

ATOL = 2e-5
B = CONFIG.block_size


def test_layout_conversions_match_indexing():
    """pages[k, b, o] is slot b * B + o of head k; kv_pages[b, o, 2k] is K and [b, o, 2k + 1] is V."""
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((6 * B, 3, 8)).astype(np.float32) for _ in range(2))
    pages = np.asarray(to_gpu_pages(jnp.asarray(k), B))
    kv_pages = np.asarray(to_tpu_kv_pages(jnp.asarray(k), jnp.asarray(v), B))
    assert pages.shape == (3, 6, B, 8) and kv_pages.shape == (6, B, 6, 8)
    for block, offset, head in [(0, 0, 0), (4, 3, 2), (5, 1, 1)]:
        slot = block * B + offset
        np.testing.assert_array_equal(pages[head, block, offset], k[slot, head])
        np.testing.assert_array_equal(kv_pages[block, offset, 2 * head], k[slot, head])
        np.testing.assert_array_equal(kv_pages[block, offset, 2 * head + 1], v[slot, head])


@jax.jit
def gpu_interpret(q, k_cache, v_cache, inputs):
    return gpu_paged_attention(q, k_cache, v_cache, inputs, block_size=B, interpret=True)


def test_gpu_kernel_fed_by_the_step_matches_reference():
    """A random mixed step through the Pallas GPU decode kernel (one kernel sequence per query token);
    negative controls: a shifted block or a row one token longer must change row 0's tokens."""
    case = next(attention_cases(seed=21, count=1))
    np.testing.assert_allclose(np.asarray(gpu_interpret(case.q, case.k_cache, case.v_cache, case.inputs)),
                               case.reference(), atol=ATOL)
    start, end = (int(x) for x in np.asarray(case.inputs.attn_metadata.query_start_loc)[:2])
    for shifted in (shifted_block(case.inputs), longer_row(case.inputs)):
        out = np.asarray(gpu_interpret(case.q, case.k_cache, case.v_cache, shifted))[start:end]
        assert np.abs(out - case.reference()[start:end]).max() > 1e-3


def ragged_reference(case, inputs):
    """`ref_ragged_paged_attention` (JAX's own reference of the TPU kernel) on jaxprep's step, as
    `tpu_ragged_paged_attention` feeds the kernel; rows past num_reqs are not computed by it."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import ref_ragged_paged_attention

    meta = inputs.attn_metadata
    with jax.default_matmul_precision("highest"):  # its einsums carry no precision: TF32 on a recent GPU
        out = ref_ragged_paged_attention(case.q, to_tpu_kv_pages(case.k_cache, case.v_cache, B), meta.seq_lens,
                                         meta.block_table, meta.query_start_loc, meta.num_reqs.reshape(1),
                                         sm_scale=case.q.shape[-1] ** -0.5)
    return np.asarray(out)


def test_tpu_kernel_contract_matches_reference():
    """The TPU kernel's inputs built from jaxprep's step (query_start_loc, seq_lens, block_table, num_reqs,
    interleaved kv_pages), through the kernel module's reference, equal the oracle on the real tokens;
    shifted block or length: row 0 differs. (The reference loops in Python over the requests: eager, slow.)"""
    case = next(attention_cases(seed=22, count=1))
    n = int(case.inputs.attn_metadata.num_actual_tokens)
    np.testing.assert_allclose(ragged_reference(case, case.inputs), case.reference()[:n], atol=ATOL)
    start, end = (int(x) for x in np.asarray(case.inputs.attn_metadata.query_start_loc)[:2])
    for shifted in (shifted_block(case.inputs), longer_row(case.inputs)):
        out = ragged_reference(case, shifted)[start:end]
        assert np.abs(out - case.reference()[start:end]).max() > 1e-3


@pytest.mark.xfail(raises=Exception, strict=True,
                   reason="jax 0.10.2: the TPU interpreter cannot read the kernel's reshaped KV scratch ref "
                          "(kernel.py `cur_async_copy_kv.wait().reshape(...)`: 'ReshapeTransform' object has "
                          "no attribute 'indices'); remove this mark when it runs")
def test_tpu_kernel_in_interpret_mode():
    """The real TPU kernel under `pltpu.force_tpu_interpret_mode()` (head_dim 128: the kernel's lane width)."""
    from jax.experimental.pallas import tpu as pltpu

    case = next(attention_cases(seed=23, count=1, num_heads=2, num_kv_heads=1, head_dim=128))
    with pltpu.force_tpu_interpret_mode():
        out = tpu_ragged_paged_attention(case.q, case.k_cache, case.v_cache, case.inputs, block_size=B,
                                         num_kv_pages_per_block=2, num_queries_per_block=4)
    np.testing.assert_allclose(np.asarray(out), case.reference(), atol=ATOL)


def test_auto_picks_the_kernel_only_where_it_runs():
    """jaxprep's ragged kernel on GPU, JAX's ragged kernel on TPU, where the shapes fit; the XLA paged
    attention elsewhere."""
    assert auto_kind(16, 8, 128, backend="gpu") == "ragged"
    assert auto_kind(4, 8, 128, backend="gpu") == "ragged"  # any block size: keys are gathered slot by slot
    assert auto_kind(16, 8, 80, backend="gpu") == "xla"  # Triton blocks: head_dim a power of 2
    assert auto_kind(16, 8, 128, backend="tpu") == "pallas_tpu"
    assert auto_kind(16, 8, 128, backend="cpu") == "xla"
    assert auto_kind(16, 8, 64, backend="tpu") == "xla"  # the TPU kernel wants head_dim % 128 == 0


def test_gpu_kernel_table_sizes():
    """pages_per_compute_block a power of 2 dividing each of k_splits equal splits of the padded width."""
    for width, expected in [(5, (4, 2, 8)), (40, (8, 5, 40)), (1, (1, 1, 1)), (2048, (8, 16, 2048))]:
        table, k_splits, per_block = gpu_kernel_table(jnp.zeros((3, width), jnp.int32))
        assert (per_block, k_splits, table.shape[1]) == expected


def test_gpu_kernel_dots_are_traced_at_highest_precision():
    """The kernel's own dots take no precision (Triton's default for float32 is TF32); jaxprep traces
    them under "highest", so both of them (q.k and p.v) carry Precision.HIGHEST."""
    case = next(attention_cases(seed=24, count=1))
    text = str(jax.make_jaxpr(lambda *a: gpu_paged_attention(*a, block_size=B))(
        case.q, case.k_cache, case.v_cache, case.inputs))
    dots = [text[match.start(): match.start() + 200] for match in re.finditer(r"dot_general\[", text)]
    assert len(dots) >= 2 and all("precision=(Precision.HIGHEST, Precision.HIGHEST)" in dot for dot in dots)


def test_auto_falls_back_to_xla_on_gpu_once_jax_drops_the_triton_backend(monkeypatch):
    import jaxprep.attention as attention

    monkeypatch.setattr(attention, "triton_backend_available", lambda: False)
    assert attention.auto_kind(16, 8, 128, backend="gpu") == "xla"
    monkeypatch.setattr(attention, "triton_backend_available", lambda: True)  # control: the same shapes pick it
    assert attention.auto_kind(16, 8, 128, backend="gpu") == "ragged"


def test_the_kernels_deprecation_warning_is_silenced_and_no_other(monkeypatch):
    """jax 0.11's module warns at import that it is deprecated: that warning alone is silenced."""
    import sys
    import types
    import warnings

    from jaxprep.attention import pallas

    def fake_module(message: str) -> types.ModuleType:
        module = types.ModuleType(pallas.GPU_KERNEL_MODULE)
        module.paged_attention = "the kernel"
        warnings.warn(message, DeprecationWarning, stacklevel=1)  # what importing jax 0.11's module does
        return module

    class Finder:  # imports the kernel's module afresh, as a first import in a process would
        def __init__(self, message):
            self.message = message

        def find_spec(self, name, path=None, target=None):
            if name != pallas.GPU_KERNEL_MODULE:
                return None
            import importlib.machinery

            loader = types.SimpleNamespace(create_module=lambda spec: fake_module(self.message),
                                           exec_module=lambda module: None)
            return importlib.machinery.ModuleSpec(name, loader)

    for message, silenced in [(f"{pallas.GPU_KERNEL_MODULE} is deprecated.", True), ("something else", False)]:
        monkeypatch.delitem(sys.modules, pallas.GPU_KERNEL_MODULE, raising=False)
        monkeypatch.setattr(sys, "meta_path", [Finder(message), *sys.meta_path])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert pallas._gpu_kernel() == "the kernel"
        assert (not caught) == silenced, [str(w.message) for w in caught]
