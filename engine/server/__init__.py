"""OpenAI-compatible HTTP server (the ``server`` extra): ``cuteinfer serve``.

    cli.py           the serve subcommand (engine options shared with generate)
    launch.py        OpenAIServer: uvicorn + the engine thread; exit 1 when the engine dies
    app.py           FastAPI routes, /health, /metrics, OpenAI error JSON for every refusal
    auth.py          --api-key: Bearer auth middleware, per-key prefix-cache namespaces
    serving.py       completions, chat, /tokenize, /detokenize: prompt -> engine requests
    choices.py       ChoiceGroup: the n engine requests of each prompt, merged into one stream
    responses.py     a ChoiceGroup's deltas -> OpenAI's JSON or SSE chunks
    tools.py         tool calling: tools / tool_choice checks, prefill, the conversation
    tool_parsers.py  the Hermes (Qwen3) and Llama 3 JSON tool-call parsers, whole and streamed
    protocol.py      request bodies (strict pydantic) -> SamplingParams
    render.py        usage, logprobs and SSE event shapes
    async_engine.py  the engine thread (owns LLMEngine), command queue, watchdog, snapshot
    stream.py        RequestStream / StreamDelta: the asyncio side of one request
    metrics.py       prometheus-client metrics (vLLM's names, cuteinfer: prefix)
    testing.py       helpers for the server tests (tiny checkpoints, a server on a free port)
"""
