"""The embedded API, in vLLM's shape: ``LLM``, ``SamplingParams``, ``RequestOutput``.

    from engine import LLM, SamplingParams
    llm = LLM(model="/path/to/checkpoint")          # backend="auto" | "numpy" | "cuda"
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from engine.args import EngineArgs
from engine.engine import LLMEngine, RequestError
from engine.outputs import CompletionOutput, RequestOutput, StreamOutput
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
    def __init__(self, model: str | None = None, backend: str = "auto", **options: Any) -> None:
        self.engine = LLMEngine(EngineArgs.from_kwargs(model=model or "", backend=backend,
                                                       **options))

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
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run prompts to completion; outputs in the order of the prompts."""
        ids = self._add_all(prompts, sampling_params)
        eng = self.engine
        try:
            pending = set(ids)
            while pending:
                eng.step()
                pending = {r for r in pending if not eng.requests[r].is_finished}
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
             add_generation_prompt: bool = True, **kwargs: Any) -> list[RequestOutput]:
        """Apply the checkpoint's chat template (jinja2, as transformers does) and generate.
        ``messages`` is one conversation or a list of them; template variables such as Qwen3's
        ``enable_thinking`` go in ``chat_template_kwargs`` (or as keyword arguments)."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tk = {**(chat_template_kwargs or {}), **kwargs}
        chat = self.engine.input_processor.chat
        prompts = [chat(conv, add_generation_prompt, **tk) for conv in convs]
        return self.generate(prompts, sampling_params)
