"""vLLM's structured output kinds -> llguidance grammar text, checked without a tokenizer.

    json (a JSON schema) | json_object  -> llguidance's JSON schema grammar
    regex                               -> a one-rule Lark grammar over the regex
    choice                              -> ``start: "a" | "b" | ...`` (exact strings)
    grammar                             -> a Lark grammar, as llguidance reads it

JSON whitespace: by default compact with ``", "`` and ``": "`` separators (what json.dumps and
most training data write). llguidance's flexible default allows unbounded runs of whitespace,
and a model that starts one may never close the object (vLLM grew ``disable_any_whitespace`` for
that); ``whitespace_pattern`` opts back in to a pattern of the caller's.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.sampling_params import StructuredOutputsParams


MAX_GRAMMAR_CHARS = 1 << 18  # a JSON schema, regex or grammar, serialized
MAX_CHOICES = 1024


class GrammarError(ValueError):
    """A schema, regex or grammar llguidance refuses (the message is llguidance's)."""


def _json_options(p: StructuredOutputsParams) -> dict:
    if p.whitespace_pattern is not None:
        return {"whitespace_flexible": True, "whitespace_pattern": p.whitespace_pattern}
    if p.disable_any_whitespace:
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    return {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(p: StructuredOutputsParams) -> str:
    """The llguidance grammar of ``p``, validated (GrammarError otherwise)."""
    kind = p.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else p.json
        if isinstance(schema, dict):
            try:
                schema = json.dumps(schema)
            except (TypeError, ValueError) as e:
                raise GrammarError(f"the schema is not JSON: {e}") from None
        if not isinstance(schema, str):
            raise GrammarError("must be a JSON schema (an object, or its JSON text)")
        if len(schema) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"at most {MAX_GRAMMAR_CHARS} characters")
        return _checked("json", schema, json.dumps(_json_options(p), sort_keys=True))
    if kind == "choice":
        c = p.choice
        if not isinstance(c, list | tuple) or not c or not all(isinstance(x, str) and x
                                                               for x in c):
            raise GrammarError("must be a non-empty list of non-empty strings")
        if len(c) > MAX_CHOICES or sum(len(x) for x in c) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"at most {MAX_CHOICES} choices of {MAX_GRAMMAR_CHARS} characters "
                               "in all")
        return _checked("lark", "start: " + " | ".join(json.dumps(x) for x in c), "")
    text = p.regex if kind == "regex" else p.grammar
    if not isinstance(text, str) or not text:
        raise GrammarError("must be a non-empty string")
    if len(text) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"at most {MAX_GRAMMAR_CHARS} characters")
    return _checked(kind, text, "")


@lru_cache(maxsize=256)
def _checked(kind: str, text: str, options: str) -> str:
    """Compiled to llguidance's grammar text and validated, once per (kind, text, options)."""
    from llguidance import LLMatcher

    try:
        if kind == "json":
            g = LLMatcher.grammar_from_json_schema(text, overrides=json.loads(options))
        elif kind == "regex":
            g = LLMatcher.grammar_from_regex(text)
        else:
            g = LLMatcher.grammar_from_lark(text)
    except ValueError as e:
        raise GrammarError(str(e)) from None
    err = LLMatcher.validate_grammar(g)
    if err:
        raise GrammarError(err.strip().splitlines()[0][:500])
    return g
