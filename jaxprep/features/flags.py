"""The feature bits of the error word (`StepInputs.errors`): the one table that keeps them apart.

`jaxprep.validate` checks a state on the host and names the field, the row and the bound; a
serving loop that skips it still gets every bound on the device, one bit per bound, at the cost of
a few elementwise ops over the state rows and one reduction for all of them
(`jaxprep.validate.flag_rows`). Each feature's record (`jaxprep.features.record.Feature`) holds its
bounds as row flags beside its host check (``spec_decode.check_drafts``, ``lora.check_lora_inputs``,
...), on the same rows, so a state that passes `jaxprep.validate` sets no bit, and the messages of
its bits; this module only numbers the bits (the core's are `jaxprep.bounds`).

Row-level bounds come back as ``(bit, bad rows)``: a flagged row leaves the step's batch (its
tokens and request row become padding), so nothing a bad row drives is read or written. Token-level
bounds (a KV group's block of a scheduled token, an M-RoPE position) are flagged where the token is
known (`kv_groups`, `mrope`): the token gets its padding values there.
"""

# the core's bits (NEGATIVE_COUNT .. OVER_BUCKET, 1 << 0 .. 1 << 4) are jaxprep.bounds'
# the feature inputs
KV_GROUP_BLOCK_OUT_OF_RANGE = 1 << 5
KV_GROUP_NULL_BLOCK = 1 << 6
PREV_BATCH_ROW_OUT_OF_RANGE = 1 << 7
DRAFTS_OUT_OF_RANGE = 1 << 8
DRAFTS_PAST_SCHEDULED = 1 << 9
LORA_ID_NOT_LOADED = 1 << 10
LORA_SLOTS_INVALID = 1 << 11
MROPE_POSITION_MISSING = 1 << 12
PREFILL_LEN_OUT_OF_RANGE = 1 << 13
PROMPT_EMBEDS_START_OUT_OF_RANGE = 1 << 14
TEMPERATURE_OUT_OF_RANGE = 1 << 15
TOP_K_OUT_OF_RANGE = 1 << 16
TOP_P_OUT_OF_RANGE = 1 << 17
MIN_P_OUT_OF_RANGE = 1 << 18
REPETITION_PENALTY_OUT_OF_RANGE = 1 << 19
FREQUENCY_PENALTY_NOT_FINITE = 1 << 20
PRESENCE_PENALTY_NOT_FINITE = 1 << 21
MAMBA_STATE_BLOCK_INVALID = 1 << 22
NUM_ACCEPTED_TOKENS_OUT_OF_RANGE = 1 << 23
MAMBA_CHECKPOINT_OUT_OF_RANGE = 1 << 24
GRAMMAR_INDEX_INVALID = 1 << 25
ROW_MASK_TOO_NARROW = 1 << 26
