"""The HTTP front end: OpenAI-compatible endpoints in front of the scheduler, over the ZeroMQ client.

__main__.py       `python -m api`: ApiConfig, logging, uvloop, the server until SIGTERM, then the drain
server.py         the aiohttp app: routes, error/access-log middleware, the API key, /health, /v1/models,
                  /metrics, drain() (SIGTERM: 503 for new requests, shutdown_timeout_s for the rest)
handlers.py       /v1/completions and /v1/chat/completions: one JSON body or server-sent events; a stream
                  whose client stops reading is aborted (max_buffered_tokens, stream_write_timeout_s)
request_body.py   the body as strict JSON: no NaN/Infinity, no lone surrogates, no RecursionError
protocol.py       request bodies -> prompts (token ids) and SamplingParams; what is refused and why
fields.py         typed, bounded access to a body's fields, and the bounds themselves
generation.py     one HTTP request's scheduler requests merged into one stream of choices; usage
openai_format.py  response bodies and stream chunks, logprobs in both OpenAI shapes
model.py          the tokenizer, loaded from --model at start; the served model's name and limits, learnt
                  from the scheduler once a worker is ready (503 while it serves another checkpoint)
state.py          what handlers share: config, client, model, counters, tokenizer thread, requests in flight
errors.py         ApiError and OpenAI's error body (the 401s word for word)
dashboard.py      /dashboard: the KV cache's live view (static/dashboard/), its sign-in, its event stream

With ApiConfig.api_key set, every route but /health and /metrics needs `Authorization: Bearer <key>`.
"""
