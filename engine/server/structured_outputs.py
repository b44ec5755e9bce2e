"""The request fields of logits processing and structured output, as OpenAI and vLLM spell them,
onto SamplingParams (engine/logits_processors.py, engine/structured/).

Structured output comes from one of: ``response_format`` (``json_object``; ``json_schema`` with
``json_schema.schema``; ``text`` is no constraint), vLLM's ``structured_outputs`` extra field
(``json``, ``regex``, ``choice``, ``grammar``, ``json_object``, ``whitespace_pattern``,
``disable_any_whitespace``) or its older ``guided_json`` / ``guided_regex`` / ``guided_choice``
/ ``guided_grammar`` (+ ``guided_whitespace_pattern``). More than one is a 400. A field vLLM
accepts that cuteinfer does not implement is a 400 naming it (never a silent no-op).
"""

from __future__ import annotations

from typing import Any

from engine.sampling_params import StructuredOutputsParams

# vLLM request fields cuteinfer does not implement, and the value that means "not used"
UNSUPPORTED: dict[str, Any] = {
    "use_beam_search": False, "length_penalty": 1.0, "logits_processors": None,
    "guided_decoding_backend": None, "structural_tag": None, "truncate_prompt_tokens": None,
    "vllm_xargs": None, "spaces_between_special_tokens": True, "guided_json_object": None,
}
STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object", "whitespace_pattern",
                   "disable_any_whitespace"}
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice",
          "guided_grammar": "grammar"}


class FieldError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_unsupported(extra: dict[str, Any] | None) -> None:
    for name, off in UNSUPPORTED.items():
        if extra and name in extra and extra[name] not in (None, off):
            raise FieldError(f"{name} is not supported by this server", name)


def _response_format(rf: dict[str, Any]) -> dict[str, Any] | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        js = rf.get("json_schema")
        schema = js.get("schema") if isinstance(js, dict) else None
        if not isinstance(schema, dict | str):
            raise FieldError("response_format json_schema needs json_schema.schema (a JSON "
                             "schema object)", "response_format")
        return {"json": schema}
    raise FieldError(f"response_format type {kind!r} is not supported (use text, json_object "
                     "or json_schema)", "response_format")


def structured_outputs(body: Any) -> StructuredOutputsParams | dict | None:
    """The request's structured output (None: unconstrained), from whichever field sets it;
    left as a dict for SamplingParams to check (its errors name the field)."""
    extra = body.model_extra or {}
    sources: dict[str, dict[str, Any]] = {}
    rf = getattr(body, "response_format", None)
    if rf is not None:
        so = _response_format(rf)
        if so is not None:
            sources["response_format"] = so
    so = extra.get("structured_outputs")
    if so is not None:
        if not isinstance(so, dict):
            raise FieldError("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(so) - STRUCTURED_KEYS)
        if unknown:
            raise FieldError(f"structured_outputs.{unknown[0]} is not supported (supported: "
                             f"{', '.join(sorted(STRUCTURED_KEYS))})",
                             f"structured_outputs.{unknown[0]}")
        sources["structured_outputs"] = {k: v for k, v in so.items() if v is not None}
    guided = {GUIDED[k]: extra[k] for k in GUIDED if extra.get(k) is not None}
    if guided:
        ws = extra.get("guided_whitespace_pattern")
        sources["guided_*"] = {**guided, **({"whitespace_pattern": ws} if ws else {})}
    if len(sources) > 1:
        names = sorted(sources)
        raise FieldError(f"structured output is set by both {names[0]} and {names[1]}: send "
                         "one", names[1])
    return next(iter(sources.values()), None)


def processor_kwargs(body: Any) -> dict[str, Any]:
    """SamplingParams keyword arguments of the request's logits processors."""
    extra = body.model_extra or {}
    check_unsupported(extra)
    kw: dict[str, Any] = {
        "presence_penalty": body.presence_penalty or 0.0,
        "frequency_penalty": body.frequency_penalty or 0.0,
        "logit_bias": body.logit_bias or None,
        "structured_outputs": structured_outputs(body),
    }
    if body.repetition_penalty is not None:
        kw["repetition_penalty"] = body.repetition_penalty
    for name in ("min_tokens", "bad_words", "allowed_token_ids"):
        v = getattr(body, name, None)
        if v is not None:
            kw[name] = v
    return kw
