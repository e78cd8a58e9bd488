"""Tiny random checkpoints saved by transformers itself, and transformers' greedy tokens as the oracle.

Every checkpoint is 2 layers, hidden 64, 4 heads over 2 KV heads, vocab 320, intermediate 128, built
with a fixed seed; the norm weights and biases (which transformers initialises to exactly 1 and 0)
are perturbed so that a loader that drops them fails.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import transformers

TINY = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "initializer_range": 0.1, "bos_token_id": 1, "eos_token_id": 2}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
FAMILIES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3": ("Qwen3Config", "Qwen3ForCausalLM")}
NEAR_TIE = 1e-5
"""A greedy pick whose logit is this close to transformers' top logit is a near-tie, not a mismatch."""


@dataclasses.dataclass(frozen=True)
class Spec:
    family: str
    config: dict
    dtype: torch.dtype = torch.float32
    max_shard_size: str | None = None
    seed: int = 0


SPECS = {
    "llama-llama3-rope": Spec("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-linear-rope-tied": Spec("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0,
                                                                 "factor": 2.0}, "tie_word_embeddings": True}),
    "qwen2": Spec("qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3": Spec("qwen3", {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}),
    "qwen3-bf16": Spec("qwen3", {"head_dim": 32}, dtype=torch.bfloat16, seed=1),
    # the architecture of llama-llama3-rope (so its executables are reused), other weights, 14 shards
    "llama-sharded": Spec("llama", {"rope_parameters": LLAMA3_ROPE}, max_shard_size="40KB", seed=2),
}


BF16_SPECS = {
    "qwen3-bf16": SPECS["qwen3-bf16"],
    "llama-llama3-rope-bf16": Spec("llama", {"rope_parameters": LLAMA3_ROPE}, dtype=torch.bfloat16, seed=3),
}
"""bf16 checkpoints served with ``dtype="bfloat16"`` and compared with transformers in bf16."""


def save_checkpoint(spec: Spec, directory: str) -> None:
    """Builds the model with ``spec.seed`` and saves it with ``save_pretrained``."""
    config_class, model_class = (getattr(transformers, name) for name in FAMILIES[spec.family])
    torch.manual_seed(spec.seed)
    model = model_class(config_class(**TINY, **spec.config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.2 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.2)
    model.to(spec.dtype).save_pretrained(directory, **({"max_shard_size": spec.max_shard_size}
                                                      if spec.max_shard_size else {}))



def saved_checkpoints(tmp_path_factory):
    """name -> directory of that checkpoint of `SPECS`, each saved once (the body of a module fixture)."""
    directories = {}

    def get(name: str) -> str:
        if name not in directories:
            directories[name] = str(tmp_path_factory.mktemp(name))
            save_checkpoint(SPECS[name], directories[name])
        return directories[name]

    return get

def reference_model(directory: str):
    """transformers' own model of the checkpoint, computing in float32 (bf16 weights upcast exactly)."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()


@dataclasses.dataclass
class GreedyCheck:
    num_requests: int = 0
    num_tokens: int = 0  # tokens compared
    mismatches: int = 0  # requests whose first differing token is not a near-tie
    near_ties: int = 0  # requests whose first differing token is within NEAR_TIE of transformers' top logit


def hf_greedy(hf_model, request):
    """``(prompt ids [1, n], the output of hf_model.generate(do_sample=False))`` for one request on its
    own, with the logits of every generated position."""
    ids = torch.tensor([request.prompt_token_ids])
    with torch.no_grad():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=request.max_tokens,
                                do_sample=False, output_logits=True, return_dict_in_generate=True)
    return ids, out


def compare_greedy(hf_model, requests) -> GreedyCheck:
    """Each request's tokens against ``hf_model.generate(do_sample=False)`` run on its prompt alone.

    At the first differing token the comparison of that request stops (the sequences diverge): it
    counts as a near-tie if our token's logit is within NEAR_TIE of transformers' top logit there."""
    check = GreedyCheck()
    for request in requests:
        ids, out = hf_greedy(hf_model, request)
        expected = out.sequences[0, ids.shape[1]:].tolist()
        ours = request.output_token_ids
        check.num_requests += 1
        check.num_tokens += len(ours)
        differ = [j for j in range(min(len(ours), len(expected))) if ours[j] != expected[j]]
        if not differ:
            check.mismatches += len(ours) != len(expected)
            continue
        logits = out.logits[differ[0]][0].numpy()
        gap = float(logits.max() - logits[ours[differ[0]]])
        print(f"request {request.request_id}: token {differ[0]} differs ({ours[differ[0]]} vs "
              f"{expected[differ[0]]}), logit gap {gap:.2e}")
        if gap <= NEAR_TIE:
            check.near_ties += 1
        else:
            check.mismatches += 1
    return check


def hf_logits(hf_model, token_ids) -> np.ndarray:
    """transformers' logits [L, V] of one sequence."""
    with torch.no_grad():
        return hf_model(torch.tensor([list(token_ids)])).logits[0].float().numpy()


@dataclasses.dataclass
class Bf16GreedyCheck(GreedyCheck):
    near_tie_positions: int = 0  # compared positions where transformers' bf16 top-2 margin is within bf16 noise


def bf16_reference_models(directory: str):
    """transformers' model of the checkpoint in bfloat16 and in float32 (the latter measures bf16 noise)."""
    return transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval(), \
        reference_model(directory)


def compare_greedy_bf16(hf_models, requests) -> Bf16GreedyCheck:
    """Each request's tokens against transformers' ``generate(do_sample=False)`` in bfloat16, token by
    token up to the first difference; ``hf_models``: `bf16_reference_models`.

    bf16 noise, per request: the largest difference between transformers' own logits in bf16 and in
    float32 over the request's whole sequence (what rounding to bf16 alone does to this model).
    A position whose bf16 top-2 logit margin is within that noise is a near-tie: greedy may pick
    either token there. A difference at a position whose margin exceeds the noise is a mismatch."""
    hf_bf16, hf_f32 = hf_models
    check = Bf16GreedyCheck()
    for request in requests:
        ids, out = hf_greedy(hf_bf16, request)
        with torch.no_grad():
            noise = float((hf_bf16(out.sequences).logits.float() - hf_f32(out.sequences).logits).abs().max())
        expected, ours = out.sequences[0, ids.shape[1]:].tolist(), request.output_token_ids
        margins = [float(np.diff(np.sort(step[0].float().numpy())[-2:])[0]) for step in out.logits]
        check.num_requests += 1
        differ = [j for j in range(min(len(ours), len(expected))) if ours[j] != expected[j]]
        compared = differ[0] + 1 if differ else min(len(ours), len(expected))
        check.num_tokens += compared
        check.near_tie_positions += sum(m <= noise for m in margins[:compared])
        if not differ:
            check.mismatches += len(ours) != len(expected)
        elif margins[differ[0]] <= noise:
            check.near_ties += 1
        else:
            print(f"request {request.request_id}: token {differ[0]} differs ({ours[differ[0]]} vs "
                  f"{expected[differ[0]]}), bf16 margin {margins[differ[0]]:.3f} > noise {noise:.3f}")
            check.mismatches += 1
    return check
