"""The HTTP front end: OpenAI-compatible endpoints in front of the scheduler, over the ZeroMQ client.

__main__.py       `python -m api`: ApiConfig, logging, uvloop, the server until SIGTERM
server.py         the aiohttp app: routes, error/log middleware, /health, /v1/models, /metrics
handlers.py       /v1/completions and /v1/chat/completions: one JSON body or server-sent events
protocol.py       request bodies -> prompts (token ids) and SamplingParams; what is refused and why
generation.py     one HTTP request's scheduler requests merged into one stream of choices; usage
openai_format.py  response bodies and stream chunks, logprobs in both OpenAI shapes
model.py          the served model (name, limits, tokenizer), learnt from the scheduler when ready
state.py          what handlers share: config, client, model, counters
errors.py         ApiError and OpenAI's error body
"""
