"""Padding constants: the values every padded entry of a prepared step holds.

They are written once here and tested as a contract (tests/core/test_padding_contract.py).
"""

INT32_MAX = 2**31 - 1
"""Largest int32: the bound of slot ids, pool rows and every other index jaxprep computes (the one
definition: every module that bounds an int32 imports it from here)."""
INT32_MIN = -INT32_MAX - 1
"""Smallest int32."""

PAD_SLOT_ID = -1
"""Slot of a padded token: it writes no KV (vLLM's ``PAD_SLOT_ID``)."""

NULL_BLOCK_ID = 0
"""Block id 0 is vLLM's reserved null block: never allocated to a request."""

PAD_POSITION = 0
"""Position of a padded token."""

PAD_INPUT_ID = 0
"""Input id of a padded token."""

PAD_SEQ_LEN = 0
"""``seq_lens`` entry of a padded batch row."""

PAD_STATE_ROW = -1
"""``idx_mapping`` entry of a padded batch row: it maps to no state row."""

PAD_LOGITS_INDEX = 0
"""``logits_indices`` entry of a padded batch row: a safe in-bounds index whose logit is ignored."""

# Optional features (jaxprep.FeatureConfig)

MROPE_MISSING_POSITION = -1
"""`BatchState.mrope_positions` entry not filled in yet: reading it for a scheduled token is an error."""

MROPE_POSITION_LIMIT = 2**24
"""M-RoPE positions lie in ``[0, MROPE_POSITION_LIMIT)``: a rotary embedding turns a position into an
angle in float32 (``position * inv_freq``), which holds every integer exactly only below 2**24."""

PAD_EMBEDS_INDEX = 0
"""``prompt_embeds.embeds_indices`` entry of a token id (or padded) token: a safe in-bounds index, unused."""

PAD_DISCARD = True
"""``discard_request_mask`` entry of a padded batch row: nothing of it is sampled."""

NO_PREV_ROW = -1
"""`BatchState.prev_batch_rows` entry of a request that was not sampled last step."""

PLACEHOLDER_TOKEN_ID = -1
"""Token id the host writes where it does not know the token yet (vLLM's async scheduler writes
``[-1] * K`` as every scheduled draft, `vllm/v1/core/sched/async_scheduler.py`). ``input_ids``
clamps it to `PAD_INPUT_ID`; ``spec_decode.draft_token_ids`` keeps it, as vLLM V1 gathers the drafts
before its clamp: the rejection sampler never accepts a draft -1."""

# LoRA (jaxprep.features.lora)

NO_LORA_ID = 0
"""Request-level "no adapter" (vLLM ``NO_LORA_ID``): `BatchState.lora_ids` entry, and the pad of
``token_lora_mapping`` / ``prompt_lora_mapping``."""

EMPTY_LORA_SLOT = -1
"""`BatchState.lora_slots` entry of a slot that holds no adapter (vLLM's ``None``)."""

NO_LORA_SLOT = -1
"""Slot-level "no adapter" (vLLM's -1): ``token_lora_indices`` / ``sampler_indices`` of a token or
logits row without LoRA, and their pad."""

PAD_SAMPLER_INDEX_PADDED = -1
"""``sampler_indices_padded`` entry of a padded logits row: selects no row."""

PAD_EMBEDDINGS_INDEX_OFFSET = 0
"""``embeddings_indices`` entry of a padded token: the offset of a token without LoRA."""

PAD_ACTIVE_LORA_ID = -1
"""``active_lora_ids`` entry past the active ones (vLLM resets the buffer to -1 every step)."""

PAD_NUM_TOKENS_PER_LORA = 0
"""``num_tokens_per_lora`` entry past the active ones (vLLM's reset value)."""

PAD_LORA_TOKEN_START_LOC = 0
"""``lora_token_start_loc`` entry past ``1 + num active`` (vLLM's reset value)."""

# Logits indirection (jaxprep.features.logits_indirection)

PAD_LOCAL_POS = 0
"""``expanded_local_pos`` entry of a padded logits row."""

PAD_NUM_DRAFT_TOKENS = 0
"""``num_draft_tokens_per_req`` entry of a padded batch row."""
# EAGLE / MTP drafter inputs (jaxprep.features.drafter)

DRAFT_REJECTED_INPUT_ID = 0
"""Draft ``input_ids`` at a rejected token's place: vLLM leaves its buffer stale there (the draft
model still runs on it, the KV it writes there is overwritten later)."""

DRAFT_REJECTED_POSITION = 0
"""Draft ``positions`` at a rejected token's place: stale in vLLM, like `DRAFT_REJECTED_INPUT_ID`."""

PAD_LAST_TOKEN_INDEX = 0
"""``last_token_indices`` entry of a padded batch row (vLLM writes 0)."""

PAD_SAMPLE_SRC_POSITION = 0
"""``sample_src_positions`` (the draft's sampling key) of a padded batch row: stale in vLLM."""

PAD_NEXT_PREFILL_TOKEN = 0
"""``next_prefill_tokens`` of a row whose prompt ends with this step, or a padded row (vLLM writes 0)."""

# Hybrid Mamba / linear-attention metadata (jaxprep.features.hybrid)

PAD_STATE_INDEX = 0
"""State index (Mamba state block) of a padded row: the null block, as vLLM pads FULL-graph decode rows."""

PAD_NUM_ACCEPTED_TOKENS = 1
"""``num_accepted_tokens`` of a padded decode row: 1, the neutral value vLLM pads with."""

NO_DECODE_DRAFTS = -1
"""``num_decode_draft_tokens`` of a row that is not a decode (and of a padded row), as in vLLM V2."""

PAD_CHUNK_SEQ_IDX = 0
"""``seq_idx`` of a padded (zero-length) chunk: an in-bounds prefill index whose state nobody reads."""

PAD_LAST_CHUNK_INDEX = 0
"""``last_chunk_indices`` of a padded prefill row: an in-bounds chunk index whose state nobody reads."""

NO_CHECKPOINT_CHUNK = -1
"""``checkpoint_chunk_indices`` of a prefill row without a checkpoint (and of a padded row), as in vLLM."""

# Structured outputs (jaxprep.features.grammar)

NO_GRAMMAR = -1
"""`BatchState.grammar_index` of a request with no bitmask rows this step; also a logits row's
``bitmask_rows`` entry when it is left untouched, and a padded ``mapping`` entry."""

# Sampling (jaxprep.features.sampling): the neutral value of each per-request sampling parameter. A padded
# logits row reads these (a plain argmax with seed 0, as vLLM's gumbel kernel reads a row with idx < 0), and
# so does a state slot no request has written (vLLM V2's initial SamplingStates values); a padded row's
# top_k is the vocabulary size V.

PAD_TEMPERATURE = 0.0
"""Greedy."""

PAD_TOP_P = 1.0
PAD_MIN_P = 0.0
PAD_SEED = 0
"""Both int32 words of the seed."""

PAD_REPETITION_PENALTY = 1.0
PAD_FREQUENCY_PENALTY = 0.0
PAD_PRESENCE_PENALTY = 0.0
