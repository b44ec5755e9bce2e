"""OpenAI-compatible HTTP server (the ``server`` extra): ``cuteinfer serve``.

    cli.py           the serve subcommand (engine options shared with generate)
    launch.py        OpenAIServer: uvicorn + the engine thread; exit 1 when the engine dies
    app.py           FastAPI routes, /health, /metrics, OpenAI error JSON for every refusal
    serving.py       /v1/completions and /v1/chat/completions: prompt -> engine -> JSON or SSE
    protocol.py      request bodies (strict pydantic) -> SamplingParams
    render.py        usage, logprobs and SSE event shapes
    async_engine.py  the engine thread (owns LLMEngine), command queue, watchdog, snapshot
    stream.py        RequestStream / StreamDelta: the asyncio side of one request
    metrics.py       prometheus-client metrics
    testing.py       helpers for the server tests (tiny checkpoints, a server on a free port)
"""
