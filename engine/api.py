"""The embedded API, in vLLM's shape: ``LLM``, ``SamplingParams``, ``RequestOutput``.

    from engine import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint")          # backend="auto" | "numpy" | "cuda"
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from functools import partial
from typing import Any

from engine.args import EngineArgs
from engine.engine import LLMEngine, RequestError
from engine.outputs import CompletionOutput, RequestOutput, StreamOutput
from engine.progress import progress
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "StreamOutput"]

Prompt = str | Sequence[int] | dict[str, Any]


def _normalize_prompts(prompts: Prompt | Sequence[Prompt]) -> list[str | list[int]]:
    """A string, a list of token ids, a {"prompt"/"prompt_token_ids": ...} dict, or a list of
    any of those."""
    def one(p: Any) -> str | list[int]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return list(p["prompt_token_ids"])
            if "prompt" in p:
                return str(p["prompt"])
            raise RequestError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
        if isinstance(p, str):
            return p
        if isinstance(p, Sequence) and all(isinstance(t, int) for t in p):
            return list(p)
        raise RequestError(f"a prompt must be a string or a list of token ids, got "
                           f"{type(p).__name__}")

    if isinstance(prompts, str | dict):
        return [one(prompts)]
    if isinstance(prompts, Sequence) and prompts and all(isinstance(t, int) for t in prompts):
        return [one(prompts)]
    return [one(p) for p in prompts]


class LLM:
    def __init__(self, model: str | None = None, backend: str = "auto",
                 engine_core: str = "thread", **options: Any) -> None:
        """``engine_core``: "thread" (default: the scheduler and executor in this process, the
        lowest latency at batch 1) or "process" (the engine core in a child process, as the
        server runs it; a script using it needs the ``if __name__ == "__main__":`` guard of
        multiprocessing's spawn start method)."""
        args = EngineArgs.from_kwargs(model=model or "", backend=backend, **options)
        if engine_core == "process":
            from engine.core.client import MultiprocessEngine

            self.engine: LLMEngine | MultiprocessEngine = MultiprocessEngine(args)
        elif engine_core == "thread":
            self.engine = LLMEngine(args)
        else:
            raise ValueError(f"engine_core={engine_core!r}: use 'thread' or 'process'")

    def shutdown(self) -> None:
        """Stop the engine core process (engine_core="process"); a no-op otherwise."""
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def _add_all(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        plist = _normalize_prompts(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(plist)
        else:
            params = list(sampling_params)
            if len(params) != len(plist):
                raise RequestError(f"got {len(params)} SamplingParams for {len(plist)} prompts")
        ids: list[str] = []
        try:
            for p, sp in zip(plist, params, strict=True):
                ids.append(self.engine.add_request(p, sp).request_id)
        except BaseException:  # all or nothing: a bad prompt (or Ctrl-C) leaves no orphans
            self._abort_all(ids)
            raise
        return ids

    def _abort_all(self, ids: Sequence[str]) -> None:
        """Abort what is still running of ``ids`` and forget them (pages freed)."""
        for rid in ids:
            self.engine.abort(rid)
            self.engine.pop_finished(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable[..., Any] = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts.

        ``use_tqdm`` (vLLM's): a progress bar over finished requests on stderr, drawn when
        stderr is a terminal; False for none; a callable is used in tqdm's place
        (``use_tqdm(total=..., desc=..., unit=...)``)."""
        bar_of = _progress_factory(use_tqdm)
        ids = self._add_all(prompts, sampling_params)
        eng = self.engine
        try:
            pending = set(ids)
            with closing(bar_of(total=len(ids), desc="Processed prompts", unit="req")) as bar:
                while pending:
                    eng.step()
                    still = {r for r in pending if not eng.requests[r].is_finished}
                    if len(still) < len(pending):
                        bar.update(len(pending) - len(still))
                    pending = still
            return [eng.output(eng.requests[r]) for r in ids]
        finally:  # done, failed or interrupted (KeyboardInterrupt too): nothing left running
            self._abort_all(ids)

    def stream(self, prompts: Prompt | Sequence[Prompt],
               sampling_params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[StreamOutput]:
        """Yield incremental text and tokens as they are generated (all prompts interleaved).
        Closing the iterator early aborts what is still running."""
        ids = self._add_all(prompts, sampling_params)
        eng = self.engine
        index = {r: i for i, r in enumerate(ids)}
        pending = set(ids)
        try:
            while pending:
                for req in eng.step():
                    rid = req.request_id
                    if rid not in pending:
                        continue
                    d = eng.delta(req)
                    yield StreamOutput(rid, index[rid], d.text, d.token_ids, d.finished,
                                       d.finish_reason, eng.output(req))
                    if req.is_finished:
                        pending.discard(rid)
                        eng.pop_finished(rid)
        finally:
            self._abort_all(list(pending))

    def chat(self, messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             add_generation_prompt: bool = True, use_tqdm: bool | Callable[..., Any] = True,
             **kwargs: Any) -> list[RequestOutput]:
        """Apply the checkpoint's chat template (jinja2, as transformers does) and generate.
        ``messages`` is one conversation or a list of them; template variables such as Qwen3's
        ``enable_thinking`` go in ``chat_template_kwargs`` (or as keyword arguments)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tk = {**(chat_template_kwargs or {}), **kwargs}
        chat = self.engine.input_processor.chat
        prompts = [chat(conv, add_generation_prompt, **tk) for conv in convs]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)


def _progress_factory(use_tqdm: object) -> Callable[..., Any]:
    """What ``generate`` makes its bar with: ``progress`` (tqdm, enabled or not), or the
    caller's callable. Refuses anything else, naming the field."""
    if isinstance(use_tqdm, bool):
        return partial(progress, enable=use_tqdm)
    if callable(use_tqdm):
        return use_tqdm
    raise TypeError(f"use_tqdm must be a bool or a callable that makes a tqdm-like bar, got "
                    f"{type(use_tqdm).__name__} ({use_tqdm!r:.40})")
