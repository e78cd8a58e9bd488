"""Random mixed steps prepared by jaxprep, with random queries and a random paged cache, for the attention tests."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxprep import BatchState, PrepConfig, prepare_padded
from jaxprep.reference.attention import paged_attention_reference
from support.batches import numpy_batches

CONFIG = PrepConfig(max_num_reqs=4, max_model_len=40, max_num_batched_tokens=32, block_size=4, num_blocks=48)


@dataclasses.dataclass
class AttentionCase:
    inputs: object  # the prepared StepInputs
    q: jnp.ndarray  # [T, H, D]
    k_cache: jnp.ndarray  # [num_blocks * block_size, K, D]
    v_cache: jnp.ndarray
    block_size: int = CONFIG.block_size

    def reference(self, inputs=None) -> np.ndarray:
        """NumPy attention [T, H, D] over the cache as ``inputs`` (default: the case's own step) describe it."""
        step = inputs or self.inputs
        meta = step.attn_metadata
        return paged_attention_reference(
            np.asarray(self.q), np.asarray(self.k_cache), np.asarray(self.v_cache),
            query_start_loc=np.asarray(meta.query_start_loc), seq_lens=np.asarray(meta.seq_lens),
            positions=np.asarray(step.positions), block_table=np.asarray(meta.block_table),
            num_actual_tokens=int(meta.num_actual_tokens), block_size=self.block_size)


def attention_cases(seed: int, count: int, *, num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16,
                    config: PrepConfig = CONFIG):
    """``count`` random mixed batches (decodes, prefill chunks, holes, full budget) prepared by
    `prepare_padded`, each with Gaussian q and a Gaussian cache (every slot filled, the null block too)."""
    rng = np.random.default_rng(seed)
    stream = numpy_batches(config, seed)
    for _ in range(count):
        arrays = next(stream)
        bucket = config.bucket_for(int(arrays["num_scheduled_tokens"].sum()))
        inputs = prepare_padded(BatchState.from_numpy(**arrays), config, bucket)
        slots = config.num_blocks * config.block_size

        def normal(*shape):
            return jnp.asarray(rng.standard_normal(shape), jnp.float32)

        yield AttentionCase(inputs, normal(bucket, num_heads, head_dim), normal(slots, num_kv_heads, head_dim),
                            normal(slots, num_kv_heads, head_dim), config.block_size)


def with_metadata(inputs, **fields):
    """``inputs`` with some attention-metadata fields replaced (a negative control's shifted step)."""
    meta = dataclasses.replace(inputs.attn_metadata, **fields)
    return dataclasses.replace(inputs, attn_metadata=meta)


def shifted_block(inputs, num_blocks: int = CONFIG.num_blocks) -> object:
    """The step with row 0's first block id moved to the next block: a shifted slot of every token of row 0."""
    table = np.asarray(inputs.attn_metadata.block_table).copy()
    table[0, 0] = table[0, 0] % (num_blocks - 1) + 1
    return with_metadata(inputs, block_table=jnp.asarray(table))


def longer_row(inputs) -> object:
    """The step with row 0 one token further along (its seq_lens and its tokens' positions + 1): every
    token of row 0 sees one key more, whichever of the two a consumer reads."""
    meta = inputs.attn_metadata
    start, end = (int(x) for x in np.asarray(meta.query_start_loc)[:2])
    positions = np.asarray(inputs.positions).copy()
    positions[start:end] += 1
    seq_lens = np.asarray(meta.seq_lens).copy()
    seq_lens[0] += 1
    return dataclasses.replace(with_metadata(inputs, seq_lens=jnp.asarray(seq_lens)), positions=jnp.asarray(positions))
