"""One layer's paged attention at Qwen3-0.6B's attention shape: `jaxprep.attention.paged_attention`
against the former gather-all path, same process, same step.

    PYTHONPATH=. python benchmarks/bench_paged_attention.py [--context 1500] [--max-model-len 1520 ...]
        [--paged-only] [--default-runtime]

q [T, 16, 128], a cache of 8 KV heads of 128, block size 16, one request whose context is
``--context`` tokens: a decode step (1 token, bucket 8) and a prefill chunk (the last 256 tokens,
bucket 256), at each ``--max-model-len``. Compile apart, then the median of 3 runs each; outputs are
checked equal first. ``--paged-only`` skips the gather-all path (slow at large max_model_len).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

sys.path.insert(0, "benchmarks")
from common import add_runtime_argument, configure_benchmark_runtime

BLOCK, HEADS, KV_HEADS, HEAD_DIM = 16, 16, 8, 128


def one_request_step(num_tokens_padded: int, num_tokens: int, context: int, max_model_len: int):
    import jax.numpy as jnp

    from jaxprep.metadata import AttentionMetadata, StepInputs

    width = -(-max_model_len // BLOCK)
    table = np.zeros((1, width), np.int32)
    table[0, : -(-context // BLOCK)] = np.arange(1, -(-context // BLOCK) + 1)
    positions = np.zeros(num_tokens_padded, np.int32)
    positions[:num_tokens] = np.arange(context - num_tokens, context)
    meta = AttentionMetadata(
        query_start_loc=jnp.asarray([0, num_tokens], jnp.int32), seq_lens=jnp.asarray([context], jnp.int32),
        slot_mapping=jnp.zeros(num_tokens_padded, jnp.int32), block_table=jnp.asarray(table),
        num_actual_tokens=jnp.int32(num_tokens), num_reqs=jnp.int32(1), max_query_len=jnp.int32(num_tokens),
        max_seq_len=jnp.int32(context))
    return StepInputs(input_ids=jnp.zeros(num_tokens_padded, jnp.int32), positions=jnp.asarray(positions),
                      logits_indices=jnp.zeros(1, jnp.int32), idx_mapping=jnp.zeros(1, jnp.int32),
                      attn_metadata=meta, errors=jnp.int32(0), num_tokens_padded=num_tokens_padded)


def median_s(fn, *args) -> float:
    fn(*args).block_until_ready()
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1500)
    parser.add_argument("--max-model-len", type=int, nargs="+", default=[1520])
    parser.add_argument("--paged-only", action="store_true")
    add_runtime_argument(parser)
    args = parser.parse_args()
    print(configure_benchmark_runtime())
    import jax
    import jax.numpy as jnp

    from jaxprep.attention import gather_all_attention, paged_attention

    rng = np.random.default_rng(0)
    num_slots = (-(-args.context // BLOCK) + 1) * BLOCK
    k_cache, v_cache = (jnp.asarray(rng.standard_normal((num_slots, KV_HEADS, HEAD_DIM)), jnp.float32) for _ in "kv")
    new = jax.jit(lambda *a: paged_attention(*a, block_size=BLOCK))
    for max_model_len in args.max_model_len:
        old = jax.jit(lambda *a, m=max_model_len: gather_all_attention(*a, block_size=BLOCK, max_model_len=m))
        for name, bucket, tokens in (("decode", 8, 1), ("prefill chunk", 256, 256)):
            inputs = one_request_step(bucket, tokens, args.context, max_model_len)
            q = jnp.asarray(rng.standard_normal((bucket, HEADS, HEAD_DIM)), jnp.float32)
            line = f"{name} ({tokens} tokens, bucket {bucket}, context {args.context}, max_model_len {max_model_len}): "
            t_new = median_s(new, q, k_cache, v_cache, inputs)
            if args.paged_only:
                print(line + f"paged {t_new * 1e3:.1f} ms")
                continue
            np.testing.assert_allclose(np.asarray(new(q, k_cache, v_cache, inputs))[:tokens],
                                       np.asarray(old(q, k_cache, v_cache, inputs))[:tokens], atol=1e-4)
            t_old = median_s(old, q, k_cache, v_cache, inputs)
            print(line + f"paged {t_new * 1e3:.1f} ms, gather-all {t_old * 1e3:.1f} ms, ratio {t_new / t_old:.3f}")


if __name__ == "__main__":
    main()
