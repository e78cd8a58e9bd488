"""The feature registry (`jaxprep.features.registry`) as a contract: every bit of the error word belongs to
one owner and has one message, every record names a module of its own, and the inputs the records ask
for are exactly the `BatchState` fields a step with every feature on reads. No compile: host code only."""

import dataclasses

import numpy as np

from jaxprep import PrepConfig, bounds
from jaxprep.features import flags, registry
from jaxprep.features.record import Feature
from jaxprep.state import OPTIONAL_FIELDS
from jaxprep.validate import error_messages
from support.all_features import ALL

CONFIG = PrepConfig(max_num_reqs=5, max_model_len=40, max_num_batched_tokens=32, block_size=4, features=ALL)
CORE_BITS = {bounds.NEGATIVE_COUNT, bounds.PAST_MAX_MODEL_LEN, bounds.BLOCK_ID_OUT_OF_RANGE, bounds.NULL_BLOCK,
             bounds.OVER_BUCKET}
TABLE_BITS = {value for name, value in vars(flags).items() if name.isupper() and isinstance(value, int)}

# the fields the all-features test of test_off_and_combined.py fills by hand (its arrays.update and the
# drafted batch), the sampling rows of vLLM's SamplingStates: the oracle, written apart from the records
ALL_INPUTS = {"num_draft_tokens", "prefill_len", "extra_block_tables", "mrope_positions", "mrope_position_delta",
              "is_token_ids", "prompt_embeds_start", "prev_sampled_token_ids", "prev_batch_rows",
              "prev_draft_token_ids", "mamba_block_table", "num_accepted_tokens", "mamba_checkpoint_offsets",
              "grammar_index", "lora_ids", "lora_slots", "temperature", "top_p", "min_p", "repetition_penalty",
              "frequency_penalty", "presence_penalty", "top_k", "seeds", "seeds_set", "prompt_bin_mask",
              "output_bin_counts"}


def bit_problems(records) -> list[str]:
    """Bits that are not one power of two, claimed twice (by two records, or by a record and the core),
    or numbered in `flags` without a record's message."""
    problems, owner = [], dict.fromkeys(CORE_BITS, "core")
    for record in records:
        for bit in record.messages(CONFIG):
            if bit <= 0 or bit & (bit - 1):
                problems.append(f"{record.name}: {bit} is not one bit")
            if bit in owner:
                problems.append(f"{record.name}: bit {bit} is {owner[bit]}'s")
            owner[bit] = record.name
    problems += [f"bit {bit} of flags.py has no message" for bit in sorted(TABLE_BITS - set(owner))]
    return problems


def test_every_bit_has_one_owner_and_one_message():
    assert bit_problems(registry.FEATURES) == []
    assert set(error_messages(CONFIG, 32)) == CORE_BITS | TABLE_BITS
    assert max(CORE_BITS | TABLE_BITS) < 2**31  # the word is an int32
    # negative controls: a record reusing the core's NULL_BLOCK, and a registry missing the LoRA record
    rogue = Feature(name="rogue", is_on=lambda features: True, messages=lambda config: {bounds.NULL_BLOCK: "x"})
    assert bit_problems((*registry.FEATURES, rogue)) == ["rogue: bit 8 is core's"]
    without_lora = [record for record in registry.FEATURES if record.name != "lora"]
    assert bit_problems(without_lora) == [f"bit {flags.LORA_ID_NOT_LOADED} of flags.py has no message",
                                          f"bit {flags.LORA_SLOTS_INVALID} of flags.py has no message"]


def test_records_are_named_for_their_modules_once():
    names = [record.name for record in registry.FEATURES]
    assert len(names) == len(set(names))
    import jaxprep.features as package

    for record in registry.FEATURES:
        if record is not registry.PREFILL_LEN:
            assert getattr(package, record.name).FEATURE is record


def test_records_ask_for_exactly_the_inputs_every_feature_reads():
    needed = registry.required_fields(ALL)
    assert set(needed) == ALL_INPUTS
    assert set(registry.empty_inputs(CONFIG)) == ALL_INPUTS
    assert set(OPTIONAL_FIELDS) >= ALL_INPUTS
    # negative control: with M-RoPE and async scheduling off, their inputs are not asked for
    fewer = dataclasses.replace(ALL, mrope=False, async_tokens=False)
    assert ALL_INPUTS - set(registry.required_fields(fewer)) == {
        "mrope_positions", "mrope_position_delta", "prev_sampled_token_ids", "prev_batch_rows",
        "prev_draft_token_ids"}
    # prefill_len names the last switch on that reads it (as the missing-field error says)
    assert needed["prefill_len"] == "hybrid"
    empty = registry.empty_inputs(CONFIG)
    assert empty["prev_batch_rows"].dtype == np.int32 and (empty["prev_batch_rows"] == -1).all()


def step_order_problems(features, order) -> list[str]:
    """Records that add outputs to the step (a metadata function of their own) but are missing from the
    step's build order, and records listed there twice."""
    default = dataclasses.fields(Feature)[-1].default
    names = [record.name for record in order]
    problems = [f"{record.name} builds outputs but is not in STEP_ORDER" for record in features
                if record.metadata is not default and record not in order]
    return problems + [f"{name} is in STEP_ORDER twice" for name in sorted({n for n in names if names.count(n) > 1})]


def test_every_feature_that_builds_outputs_is_in_the_step_order_once():
    assert step_order_problems(registry.FEATURES, registry.STEP_ORDER) == []
    assert registry.STEP_ORDER[-1].name == "ubatch"  # it splits the finished step
    # negative controls: the order without LoRA, and with spec decode twice
    without_lora = tuple(record for record in registry.STEP_ORDER if record.name != "lora")
    assert step_order_problems(registry.FEATURES, without_lora) == ["lora builds outputs but is not in STEP_ORDER"]
    twice = (*registry.STEP_ORDER, registry.FEATURES[0])
    assert step_order_problems(registry.FEATURES, twice) == ["spec_decode is in STEP_ORDER twice"]
