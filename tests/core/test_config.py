"""The bucket ladder and block-table width."""

import pytest

from jaxprep import PrepConfig, default_token_buckets
from jaxprep.config import block_table_width


@pytest.mark.parametrize("budget", [1, 7, 8, 10, 64, 100, 300, 512, 2048, 8192, 16384, 16640])
def test_default_ladder_includes_and_never_exceeds_budget(budget):
    ladder = default_token_buckets(budget)
    assert ladder[-1] == budget
    assert all(0 < b <= budget for b in ladder)
    assert list(ladder) == sorted(set(ladder))


@pytest.mark.parametrize("budget", [512, 8192, 16384])
def test_default_ladder_pads_at_most_half_above_64(budget):
    ladder = default_token_buckets(budget)
    for n in range(65, budget + 1, 7):
        bucket = next(b for b in ladder if b >= n)
        assert bucket <= 1.5 * n, (n, bucket)


def test_default_ladder_size_at_8192():
    assert len(default_token_buckets(8192)) == 18


def test_ladder_example():
    assert default_token_buckets(300) == (8, 16, 32, 64, 96, 128, 192, 256, 300)


def test_bucket_for_picks_the_smallest_bucket_holding_the_step():
    config = PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=300, block_size=16)
    assert [config.bucket_for(n) for n in (1, 8, 9, 65, 256, 257, 300)] == [8, 8, 16, 96, 256, 300, 300]
    with pytest.raises(ValueError, match=r"num_tokens=301 must lie in \[1, max_num_batched_tokens=300\]"):
        config.bucket_for(301)
    with pytest.raises(ValueError, match="num_tokens=0"):
        config.bucket_for(0)


def test_block_table_width_matches_vllm_alignment():
    """docs/semantics.md#block-table-width: B=2, M=12 -> 64 columns; B=16, M=240 -> 16 columns."""
    assert block_table_width(12, 2) == 64
    assert block_table_width(240, 16) == 16
    assert block_table_width(4096, 16) == 256
    assert block_table_width(100, 3) == 128  # alignment 128 / gcd(128, 3) = 128


def test_config_is_hashable_and_static():
    a = PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=300, block_size=16)
    b = PrepConfig(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=300, block_size=16)
    assert a == b and hash(a) == hash(b)
    assert a.num_reqs_padded(8) == 4 and a.num_reqs_padded(2) == 2


def test_kernel_must_be_one_of_the_paths():
    with pytest.raises(ValueError, match=r"PrepConfig.kernel must be one of \('xla', 'pallas', 'auto'\), got 'triton'"):
        PrepConfig(max_num_reqs=2, max_model_len=16, max_num_batched_tokens=8, block_size=4, kernel="triton")


def test_the_kernel_defaults_to_auto():
    assert PrepConfig(max_num_reqs=2, max_model_len=16, max_num_batched_tokens=8, block_size=4).kernel == "auto"


def test_pallas_refuses_the_features_the_kernels_do_not_cover_naming_them_and_auto_keeps_them_on_xla():
    """Spec decode and runner V2 run on the kernels; any other feature keeps the step on XLA under "auto"
    (lowered for CUDA: no Triton call) and is named when "pallas" refuses it. Control: the covered
    features alone lower to the Triton kernels."""
    from jaxprep import BatchState, FeatureConfig, LoRAConfig, prepare_padded
    from support.kernels import TRITON_CALL, lowering_target

    def config(features, kernel="auto"):
        return PrepConfig(max_num_reqs=2, max_model_len=16, max_num_batched_tokens=8, block_size=4, kernel=kernel,
                          features=features)

    uncovered = FeatureConfig(num_speculative_tokens=1, runner="v2", discard_request_mask=True,
                              lora=LoRAConfig(max_loras=2))
    with pytest.raises(ValueError, match="do not cover FeatureConfig discard_request_mask, lora: turn them off"):
        config(uncovered, "pallas")
    covered = FeatureConfig(num_speculative_tokens=1, runner="v2", speculative_method="mtp", mask_kv_len=8)
    assert config(covered, "pallas").kernel == "pallas"
    for features, on_kernels in ((uncovered, False), (covered, True)):
        auto = config(features)
        with lowering_target("cuda"):
            text = prepare_padded.trace(BatchState.empty(auto), auto, 8).lower(lowering_platforms=("cuda",)).as_text()
        assert (TRITON_CALL in text) == on_kernels and ("stablehlo.gather" in text) != on_kernels, features


def test_importing_jaxprep_does_not_import_the_triton_backend():
    import subprocess
    import sys

    code = "import sys, jaxprep, jaxprep.serving; print('jax.experimental.pallas.triton' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_module_available_finds_without_importing_and_survives_a_missing_parent():
    from jaxprep.bounds import module_available

    assert module_available("jax.experimental.pallas")
    assert not module_available("jax.no_such_module") and not module_available("no_such_package.sub")
