"""Padding constants: the values every padded entry of a prepared step holds.

They are written once here and tested as a contract (tests/test_padding_contract.py).
"""

INT32_MAX = 2**31 - 1
"""Largest int32: slot ids, counts and flat indices must stay at or below it."""

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

PAD_EMBEDS_INDEX = 0
"""``prompt_embeds.embeds_indices`` entry of a token id (or padded) token: a safe in-bounds index, unused."""

PAD_DISCARD = True
"""``discard_request_mask`` entry of a padded batch row: nothing of it is sampled."""

NO_PREV_ROW = -1
"""`BatchState.prev_batch_rows` entry of a request that was not sampled last step."""
