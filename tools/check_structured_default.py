"""Structured output through the official ``openai`` client against ``cuteinfer``'s server on the
embedded default model (SmolLM2-135M-Instruct): a JSON schema at temperature 0.7, a choice and a
regex, 20 seeds each (issue 17's check on a model that is not the tests' random one).

    python -m tools.check_structured_default [--backend numpy|cuda] [--out f.json]

Prints one JSON line: how many of the 20 outputs validate, per kind, and the first failures.
"""

from __future__ import annotations

import argparse
import json
import re
import time

from tools.report import emit


def main() -> None:
    import openai

    from engine.server.testing import make_engine, running_server
    from tests.test_server_structured import SCHEMA, valid

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    t0 = time.time()
    eng = make_engine("", backend=a.backend, max_model_len=512, max_num_seqs=8)
    res: dict = {"backend": a.backend, "model": "SmolLM2-135M-Instruct (embedded default)"}
    choices, phone = ["yes", "no", "maybe later"], r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                 "strict": True}}
    with running_server(eng, served_model_name="default") as s:
        c = openai.OpenAI(base_url=f"{s.url}/v1", api_key="x", max_retries=0, timeout=300)
        ok = {"json_schema": 0, "choice": 0, "regex": 0}
        bad: list = []
        for seed in range(20):
            r = c.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Describe a person as "
                                                                       "JSON."}],
                response_format=rf, temperature=0.7, seed=seed, max_tokens=96)
            ch = r.choices[0]
            try:
                good = ch.finish_reason == "stop" and valid(json.loads(ch.message.content))
            except ValueError:
                good = False
            ok["json_schema"] += good
            if not good:
                bad.append(("json_schema", seed, ch.finish_reason, ch.message.content))
            r = c.chat.completions.create(
                model="default", messages=[{"role": "user", "content": "Will it rain?"}],
                temperature=0.7, seed=seed, max_tokens=16,
                extra_body={"structured_outputs": {"choice": choices}})
            ok["choice"] += r.choices[0].message.content in choices
            q = c.completions.create(model="default", prompt="Call me at", temperature=0.7,
                                     seed=seed, max_tokens=24, extra_body={"guided_regex": phone})
            ok["regex"] += (bool(re.fullmatch(phone, q.choices[0].text))
                            and q.choices[0].finish_reason == "stop")
    res.update(ok=ok, of=20, failures=bad[:3], wall_s=round(time.time() - t0, 1))
    emit(res, a.out, indent=None)


if __name__ == "__main__":
    main()
