"""One long prompt through a real-shape model: prefill time, decode s/step and peak RSS, jaxprep's serving
loop against transformers' ``generate``, each in its own process (peak RSS is per process).

    PYTHONPATH=. python benchmarks/bench_long_prompt.py --mode build --dir CKPT
    PYTHONPATH=. python benchmarks/bench_long_prompt.py --mode jax --dir CKPT [--prompt-len 1500] [--max-tokens 9]
    PYTHONPATH=. python benchmarks/bench_long_prompt.py --mode transformers --dir CKPT

The checkpoint is Qwen3-0.6B's shape cut to ``--layers`` layers (hidden 1024, 16 heads over 8 KV
heads of 128, intermediate 3072, vocab 151936, tied embeddings), random weights saved by transformers
in float32. ``jax`` serves the prompt with `jaxprep.serving.Engine` (budget ``--budget`` tokens a step,
so a 1500-token prompt is prefilled in chunks, one decode step per dispatch): every bucket is compiled
first (reported apart), then prefill = the dispatches up to the first output token, decode = the
mean of the dispatches after it. ``transformers``: prefill = ``generate(max_new_tokens=1)``,
decode = (``generate(max_new_tokens=N)`` - prefill) / (N - 1). Greedy tokens are printed by both.
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

QWEN3_SHAPE = {"vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16,
               "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
               "tie_word_embeddings": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}


def peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # ru_maxrss is KiB on Linux


def prompt(length: int, vocab: int) -> list[int]:
    return np.random.default_rng(0).integers(3, vocab, length).tolist()


def build(args) -> None:
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen3Config(num_hidden_layers=args.layers, **QWEN3_SHAPE)
    transformers.Qwen3ForCausalLM(config).eval().save_pretrained(args.dir)
    print(f"built {args.dir}: {args.layers} layers; peak RSS {peak_rss_gib():.2f} GiB")


def run_jax(args) -> None:
    from jaxprep.config import PrepConfig, cdiv
    from jaxprep.models import load_model
    from jaxprep.serving import Engine, Request, ServingConfig

    model, params = load_model(args.dir)
    max_model_len = args.max_model_len or cdiv(args.prompt_len + args.max_tokens, args.block_size) * args.block_size
    prep = PrepConfig(max_num_reqs=1, max_model_len=max_model_len, max_num_batched_tokens=args.budget,
                      block_size=args.block_size, num_blocks=1 + cdiv(args.prompt_len + args.max_tokens,
                                                                      args.block_size))
    engine = Engine(ServingConfig(prep=prep, eos_token_id=-1, decode_steps=1), model, params=params)
    compile_s = engine.warmup()
    engine.submit([Request(request_id=0, prompt_token_ids=prompt(args.prompt_len, model.vocab_size),
                           max_tokens=args.max_tokens)])
    times, start = [], time.perf_counter()
    engine.run(on_step=lambda e: times.append(time.perf_counter()))
    output = engine.finished[0].output_token_ids
    steps = np.diff([start] + times)
    prefill_steps = len(steps) - (len(output) - 1)
    print(f"jax: max_model_len {max_model_len}, budget {args.budget}; compile {compile_s:.1f} s; "
          f"prefill {steps[:prefill_steps].sum():.1f} s ({prefill_steps} dispatches); "
          f"decode {steps[prefill_steps:].mean():.3f} s/step; peak RSS {peak_rss_gib():.2f} GiB; tokens {output}")


def run_transformers(args) -> None:
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(args.dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt(args.prompt_len, model.config.vocab_size)])
    with torch.no_grad():
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        out = model.generate(ids, max_new_tokens=args.max_tokens, do_sample=False)
        total = time.perf_counter() - start
    decode = (total - prefill) / (args.max_tokens - 1)
    print(f"transformers: prefill {prefill:.1f} s; decode {decode:.3f} s/step; peak RSS {peak_rss_gib():.2f} GiB; "
          f"tokens {out[0, args.prompt_len:].tolist()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("build", "jax", "transformers"), required=True)
    parser.add_argument("--dir", required=True, help="checkpoint directory (written by --mode build)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=1500)
    parser.add_argument("--max-tokens", type=int, default=9)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-model-len", type=int, default=None, help="default: prompt + max tokens, in blocks")
    args = parser.parse_args()
    {"build": build, "jax": run_jax, "transformers": run_transformers}[args.mode](args)


if __name__ == "__main__":
    main()
