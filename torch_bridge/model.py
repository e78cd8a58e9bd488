"""A torch forward of a Llama-family checkpoint (Llama, Qwen2, Qwen3) that reads jaxprep's bridged step.

The other half of a torch-side serving loop: jaxprep prepares the step (positions, slot mapping,
block tables, logits indices), `torch_bridge.to_torch` hands it over, and this model runs it over
a paged KV cache in plain torch, float32:

```python
model = TorchDecoder.from_pretrained("path/to/checkpoint")        # config.json + *.safetensors
kv_caches = model.new_kv_caches(num_blocks, block_size)
inputs = torch_bridge.to_torch(jaxprep.prepare_inputs(state, config))
logits = model.forward(inputs, kv_caches)                        # [num_reqs_padded, vocab_size]
next_ids = greedy_sample(logits, inputs)                          # [num_reqs] int64
```

Each layer follows transformers' ``LlamaDecoderLayer`` (and Qwen2's q/k/v biases, Qwen3's per-head
q/k RMSNorm): RMSNorm, q/k/v projections, RoPE at ``positions`` with the checkpoint's RoPE type
(``default``, ``linear``, ``llama3``: the inverse frequencies of `jaxprep.models.RopeConfig`), the
new K/V written at ``slot_mapping`` (`torch_bridge.paged_attention.write_kv_cache`), causal
attention over each request's cached K/V through its block-table row (`paged_attention`), o_proj,
SwiGLU MLP; the final norm and the LM head run on the rows of ``logits_indices`` only.
The config parsing (`jaxprep.models.read_config`) and its checks are shared with the JAX model.
"""

from __future__ import annotations

import glob
import os

from jaxprep.models.config import DecoderConfig, read_config
from jaxprep.models.errors import CheckpointError
from jaxprep.models.load import LAYER_PREFIX, checkpoint_shapes, layer_shapes
from torch_bridge._torch import torch
from torch_bridge.paged_attention import paged_attention, write_kv_cache

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]
"""Per layer (key_cache, value_cache), each [num_blocks, block_size, num_kv_heads, head_dim] float32."""


class TorchDecoder:
    """A checkpoint's weights as float32 torch tensors on ``device``, and its forward over a bridged step."""

    def __init__(self, config: DecoderConfig, weights: dict[str, torch.Tensor], device="cpu"):
        expected = checkpoint_shapes(config)
        for name, shape in expected.items():
            if name not in weights:
                raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
            if tuple(weights[name].shape) != shape:
                raise CheckpointError(f"tensor {name!r} has shape {tuple(weights[name].shape)}, the config needs "
                                      f"{shape}")
        self.config, self.device = config, torch.device(device)
        self.weights = {name: weights[name].to(self.device, torch.float32) for name in expected}
        self.layers = [{name: self.weights[f"{LAYER_PREFIX}.{i}.{name}"] for name in layer_shapes(config)}
                       for i in range(config.num_layers)]
        head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        self.lm_head = self.weights[head]
        self.inv_freq = torch.from_numpy(config.inv_freq()).to(self.device)  # [head_dim // 2] float32

    @classmethod
    def from_pretrained(cls, directory: str, device="cpu") -> TorchDecoder:
        """Reads ``directory``/config.json and every ``*.safetensors`` file in it (one file or shards)."""
        from safetensors.torch import load_file

        files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
        if not files:
            raise CheckpointError(f"{directory} holds no *.safetensors file")
        weights = {}
        for file in files:
            weights.update(load_file(file))
        return cls(read_config(directory), weights, device)

    def new_kv_caches(self, num_blocks: int, block_size: int) -> KVCaches:
        """Zeroed paged caches, one (key, value) pair per layer, in `torch_bridge.paged_attention`'s layout."""
        shape = (num_blocks, block_size, self.config.num_kv_heads, self.config.head_dim)
        return [(torch.zeros(shape, device=self.device), torch.zeros(shape, device=self.device))
                for _ in range(self.config.num_layers)]

    @torch.no_grad()
    def forward(self, inputs, kv_caches: KVCaches) -> torch.Tensor:
        """One step over the padded token batch of ``inputs`` (a `TorchStepInputs`): writes every
        layer's K/V at ``slot_mapping`` into ``kv_caches`` (in place) and returns the logits
        [num_reqs_padded, vocab_size] float32 at ``logits_indices`` (rows past ``num_reqs`` are padding)."""
        self._check_device(inputs)
        meta = inputs.attn_metadata
        x = self.weights["model.embed_tokens.weight"][inputs.input_ids.long()]  # [T_pad, D]
        cos, sin = self._rope_tables(inputs.positions)
        for layer, (key_cache, value_cache) in zip(self.layers, kv_caches, strict=True):
            q, k, v = self._qkv(layer, x, cos, sin)
            write_kv_cache(k, v, key_cache, value_cache, meta.slot_mapping)
            attn = paged_attention(q, key_cache, value_cache, meta, scale=self.config.head_dim ** -0.5)
            x = x + _linear(layer, "self_attn.o_proj", attn.flatten(1))
            x = x + self._mlp(layer, x)
        last = x[inputs.logits_indices.long()]  # [R_pad, D]
        return _rms_norm(last, self.weights["model.norm.weight"], self.config.rms_norm_eps) @ self.lm_head.T

    def _check_device(self, inputs) -> None:
        """The step's device-side fields must be where the weights are (JAX may hold the step on a GPU
        while the weights are on the CPU): a ValueError naming the field and both devices."""
        meta = inputs.attn_metadata
        fields = (("input_ids", inputs.input_ids), ("positions", inputs.positions),
                  ("logits_indices", inputs.logits_indices), ("attn_metadata.slot_mapping", meta.slot_mapping),
                  ("attn_metadata.block_table_tensor", meta.block_table_tensor))
        for name, tensor in fields:
            if tensor.device.type != self.device.type:
                raise ValueError(f"TorchDecoder.forward: inputs.{name} is on {tensor.device}, the model's weights on "
                                 f"{self.device}: bridge the step to the model's device "
                                 "(torch_bridge.to_torch(step, device=model.device))")

    def _rope_tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T_pad, 1, head_dim] of each token's position (transformers' ``cat(freqs, freqs)``)."""
        freqs = positions.to(self.device, torch.float32)[:, None] * self.inv_freq[None, :]  # [T_pad, Dh/2]
        angles = torch.cat([freqs, freqs], dim=-1)[:, None, :]
        return angles.cos(), angles.sin()

    def _qkv(self, layer: dict, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q [T, H, Dh], k and v [T, H_kv, Dh] of hidden states x [T, D]; q and k rotated."""
        config, tokens = self.config, x.shape[0]
        h = _rms_norm(x, layer["input_layernorm.weight"], config.rms_norm_eps)
        q = _linear(layer, "self_attn.q_proj", h).view(tokens, config.num_heads, config.head_dim)
        k = _linear(layer, "self_attn.k_proj", h).view(tokens, config.num_kv_heads, config.head_dim)
        v = _linear(layer, "self_attn.v_proj", h).view(tokens, config.num_kv_heads, config.head_dim)
        if config.qk_norm:  # Qwen3: RMSNorm over each head, before RoPE
            q = _rms_norm(q, layer["self_attn.q_norm.weight"], config.rms_norm_eps)
            k = _rms_norm(k, layer["self_attn.k_norm.weight"], config.rms_norm_eps)
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin, v

    def _mlp(self, layer: dict, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of the post-attention norm: down(silu(gate(h)) * up(h))."""
        h = _rms_norm(x, layer["post_attention_layernorm.weight"], self.config.rms_norm_eps)
        gated = torch.nn.functional.silu(_linear(layer, "mlp.gate_proj", h)) * _linear(layer, "mlp.up_proj", h)
        return _linear(layer, "mlp.down_proj", gated)


def greedy_sample(logits: torch.Tensor, inputs) -> torch.Tensor:
    """The argmax token [num_reqs] int64 of each real batch row (rows past ``num_reqs`` are padding).
    Batch row b belongs to state row ``inputs.idx_mapping[b]``."""
    return logits[: inputs.attn_metadata.num_reqs].argmax(dim=-1)


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2) + eps) over the last axis (transformers' ``LlamaRMSNorm``)."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _linear(layer: dict, name: str, x: torch.Tensor) -> torch.Tensor:
    """x [T, in] through weight [out, in] (transformers' layout), plus the bias if the checkpoint has one."""
    return torch.nn.functional.linear(x, layer[name + ".weight"], layer.get(name + ".bias"))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last axis: RoPE rotates pair (i, i + Dh/2)."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
