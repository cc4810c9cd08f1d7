"""The HTTP front end: OpenAI-compatible endpoints in front of the scheduler, over the ZeroMQ client.

__main__.py       `python -m pagedserve.api`: ApiConfig, logging, uvloop, the server until SIGTERM, the drain
server.py         the aiohttp app: routes, error/access-log middleware, the API key, /health, /v1/models,
                  /metrics, drain() (SIGTERM: 503 for new requests, shutdown_timeout_s for the rest)
handlers.py       /v1/completions and /v1/chat/completions: one JSON body or server-sent events; a stream
                  whose client stops reading is aborted (max_buffered_tokens, stream_write_timeout_s), a
                  non-stream answer is capped (max_response_tokens); large bodies parsed in the tokenizer pool
responses/        /v1/responses (OpenAI's Responses API) translated onto chat; its bounded store
messages/         /v1/messages and count_tokens (Anthropic's Messages API) translated onto chat
output_blocks.py  a chat choice as blocks (reasoning, text, tool calls): their items and content blocks
request_body.py   the body as strict JSON (msgspec first): no NaN/Infinity or lone surrogates, bounded depth
request_fields.py  fields a body may have: unknown ones ignored (X-Ignored-Fields) or, strict, refused
limits.py         what one HTTP client may hold: header, body and keep-alive deadlines, the connection cap
                  with its reserve for /health and authenticated clients (a protocol in front of aiohttp's)
protocol.py       request bodies -> prompts (token ids) and SamplingParams; what is refused and why
chat.py           chat messages (tool results, tool calls, reasoning), tools and documents -> the prompt
chat_template.py  --chat-template, a request's own template (sandboxed child process), chat_template_kwargs
tools.py          tools, tool_choice, parallel_tool_calls: the schema `required`/named are held to, the parser
tool_parsers/     tool calls read out of a choice's text (8 formats), and the format a chat template writes
reasoning.py      <think>...</think> returned as `reasoning` (--reasoning-parser qwen3, deepseek_r1)
chat_output.py    a chat choice read through those parsers: message, stream deltas, finish_reason
fields.py         typed, bounded access to a body's fields, and the bounds themselves
sampling_fields.py  penalties, min_p, min_tokens, logit_bias, bad_words, allowed_token_ids; the defaults
                  of what a request leaves out (generation_config.py: the checkpoint's generation_config.json)
structured_fields.py  response_format / structured_outputs / guided_* -> StructuredOutput, checked by xgrammar
generation.py     one HTTP request's scheduler requests merged into one stream of choices; usage
openai_format.py  response bodies and stream chunks, logprobs in both OpenAI shapes
scoring.py        what a response shows of its prompt: echo, prompt_logprobs, return_tokens_as_token_ids
                  and the text options (include_stop_str_in_output, skip_special_tokens, ...)
model.py          the tokenizer, loaded from --model at start; the served model's name and limits, learnt
                  from the scheduler once a worker is ready (503 while it serves another checkpoint)
state.py          what handlers share: config, client, model, counters, tokenizer pool, requests in flight
errors.py         ApiError and OpenAI's error body (the 401s word for word)
auth.py           API keys (--api-key, --api-key-file, reloaded) and their tenants: each tenant's prefix-cache
                  salt; wrong keys throttled per client address (429)
tokenization.py   POST /tokenize and /detokenize (vLLM's), by the served model's tokenizer
render.py         what routers ask: POST /v1/completions/render and /v1/chat/completions/render (the
                  prompt's token ids, vLLM's shape), GET /kv_event_sources and /get_server_info
version.py        GET /version
cors.py           CORS (vLLM's --allowed-origins & co.): preflights before the API key, origin headers
request_id.py     X-Request-Id: the client's or a fresh one, echoed on every response, in the response id
scheduling.py     `priority`, refused under the scheduler's fcfs policy (it would change nothing)
dashboard.py      /dashboard: the KV cache's live view (static/dashboard/), its sign-in and revocable
                  sessions, its event stream

With API keys set (auth.py), every route but /health and /metrics needs `Authorization: Bearer <key>`
(or `x-api-key: <key>`, as Anthropic's clients send it).
"""
