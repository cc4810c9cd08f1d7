"""Configuration of each process, and the one place that reads flags and the environment.

Every field of a process's config is a command-line flag (`max_num_seqs` -> `--max-num-seqs`) and an
environment variable (`PAGEDSERVE_MAX_NUM_SEQS`); the flag wins over the variable, the variable over the
default. Processes started together by honcho therefore share settings through the environment, and a flag
meant for another process is simply not one of this process's fields.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Literal

from pagedserve.common.flags import ENV_PREFIX as ENV_PREFIX  # the processes' flags: common/flags.py
from pagedserve.common.flags import add_config_args as add_config_args
from pagedserve.common.flags import check_choices, json_string_list
from pagedserve.common.flags import choices_of as choices_of
from pagedserve.common.flags import config_from_args as config_from_args
from pagedserve.common.flags import field_descriptions as field_descriptions
from pagedserve.common.flags import parse_config as parse_config
from pagedserve.common.kv_events_config import parse_kv_events_config
from pagedserve.common.speculative import parse_speculative_config

DEFAULT_SCHEDULER_ADDRESS = "tcp://127.0.0.1:5570"  # clients (api, ZeroMQ users) <-> scheduler
DEFAULT_WORKER_ADDRESS = "tcp://127.0.0.1:5571"  # scheduler <-> workers
DEFAULT_MODEL_DIR = "models/tiny-llama"  # what scripts/start makes and serves when no model is given
# The cluster's CURVE key pair (common/security.py): made on first start, readable by its owner only
DEFAULT_CLUSTER_KEY_FILE = "~/.config/pagedserve/cluster_key"
# Batch limits: the scheduler batches within them; the worker sizes its CUDA graphs and memory profile by them
DEFAULT_MAX_NUM_SEQS = 512
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
MAX_GRAMMAR_THREADS = 64

# Modes: the values a field may take, checked when a config is made and offered as a flag's choices.
PreemptionMode = Literal["recompute", "swap", "auto"]
SchedulingPolicy = Literal["fcfs", "priority"]
KVPolicy = Literal["paged", "reserved", "reserved-max"]
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
KVCacheDtype = Literal["auto", "fp8", "fp8_e4m3"]
AttentionBackendName = Literal["auto", "torch", "triton"]
Quantization = Literal["", "fp8"]
GenerationConfigMode = Literal["auto", "none"]
TPAllReduce = Literal["auto", "nccl", "one-shot", "no-copy", "fused"]
LoadFormat = Literal["auto", "dummy"]
# Pages served from this machine (a local web UI) may call the api; no other site may read its answers
_LOCAL_ORIGINS = [f"{s}://{h}:*" for h in ("localhost", "127.0.0.1", "[::1]") for s in ("http", "https")]
DEFAULT_ALLOWED_ORIGINS = json.dumps(_LOCAL_ORIGINS)
ToolCallParserName = Literal[  # api/tool_parsers
    "", "hermes", "llama3_json", "mistral", "qwen3_coder", "glm45", "deepseek_v31", "kimi_k2", "openai"
]
ReasoningParserName = Literal["", "qwen3", "deepseek_r1"]  # api/reasoning.py


@dataclass(frozen=True)
class ApiConfig:
    """The HTTP front end."""

    host: str = "127.0.0.1"  # address the HTTP server binds
    port: int = 8000  # port the HTTP server listens on
    scheduler_address: str = DEFAULT_SCHEDULER_ADDRESS  # where the scheduler takes client connections
    # The server instance this api belongs to (pagedserve serve sets it): a scheduler that reports another is
    # refused (503 "misconfigured"); empty: any scheduler
    instance_id: str = ""
    # Checkpoint directory (or Hugging Face repo id) the tokenizer loads from at start (the worker's --model,
    # which honcho's PAGEDSERVE_MODEL gives both); empty: the one the first ready worker announces
    model: str = ""
    served_model_name: str = ""  # name in /v1/models and responses; empty: the worker's
    max_request_bytes: int = 8 * 1024 * 1024  # larger request bodies are refused
    # SIGTERM: refuse new requests (503), let those in flight finish this long, then end the rest
    shutdown_timeout_s: float = 30.0
    cluster_key_file: str = DEFAULT_CLUSTER_KEY_FILE  # the key the scheduler's sockets are locked with
    # With requests in flight, a scheduler silent this long counts as hung: they fail with 503
    scheduler_timeout_s: float = 10.0
    # Non-empty: every route but /health and /metrics (so all of /v1/*) needs `Authorization: Bearer
    # <api_key>`, else 401 with OpenAI's error body
    api_key: str = ""
    # Sequences one HTTP request may create: prompts x n (x best_of, the beam width, with beam search)
    max_seqs_per_request: int = 256
    # Tokens one HTTP request's stream may hold waiting for a client that does not read; beyond, it is aborted
    max_buffered_tokens: int = 16384
    # A stream whose client takes nothing for this long is aborted (its KV freed) and its connection closed
    stream_write_timeout_s: float = 30.0
    log_level: str = "info"  # debug, info, warning or error: the least severe events logged
    # With a Hugging Face repo id as --model: the branch, tag or commit (empty: main)
    revision: str = ""
    # auto: the checkpoint's generation_config.json gives the defaults of temperature, top_p, top_k, min_p,
    # repetition_penalty and chat max_tokens (max_new_tokens) that a request leaves out, as vLLM's; none: ours
    generation_config: GenerationConfigMode = "auto"
    # The chat template of every chat request: a file, or the template itself; empty: the tokenizer's
    chat_template: str = ""
    # Accept a request's own `chat_template` (untrusted jinja: rendered sandboxed, in a child process with
    # a time and memory limit); refused (400) otherwise, as in vLLM
    trust_request_chat_template: bool = False
    # tool_choice "auto" with --tool-call-parser (with neither: the chat template's parser, api/tool_parsers)
    enable_auto_tool_choice: bool = False
    tool_call_parser: ToolCallParserName = ""  # the model's tool-call format; empty: the chat template's
    # qwen3 or deepseek_r1: the output's <think>...</think> part is returned as `reasoning`
    reasoning_parser: ReasoningParserName = ""
    # Serve /dashboard, the KV cache's live view (behind api_key when set); --no-dashboard turns it off
    dashboard: bool = True
    # Refuse (400) request fields the api does not know, instead of ignoring them with a warning header
    strict_request_fields: bool = False
    # CORS (api/cors.py), vLLM's flags as JSON lists: origins whose pages may call the api ("*": any; a
    # "scheme://host:*" entry, any port of that host); the default: pages served from this machine only
    allowed_origins: str = DEFAULT_ALLOWED_ORIGINS
    allowed_methods: str = '["*"]'  # methods a page may use ("*": any)
    allowed_headers: str = '["*"]'  # request headers a page may send ("*": any)
    allow_credentials: bool = False  # let pages send cookies and HTTP authentication (never with origin "*")
    # Chat without max_tokens: at most this many (or max_new_tokens if fewer), as fits; 0: as much as fits
    default_max_tokens: int = 4096
    # More API keys: a file of one per line, `name:key` or a bare key (# comments), read again when it
    # changes (a removed key stops working and its dashboard sessions end); api_key counts as well
    api_key_file: str = ""
    # Let requests of different API keys share prefix-cache entries; off: each key's are apart (another key
    # learns nothing of them from cached_tokens or latency), and only a request's cache_salt divides a key's
    share_prefix_cache_across_keys: bool = False
    # Wrong API keys one client address (an IPv6 /64) may send per minute; past them, 429 with Retry-After
    # for any key it sends until the allowance refills; 0: no limit
    auth_failures_per_minute: int = 30
    # Threads that parse large bodies and tokenize or render long prompts, off the event loop
    tokenizer_threads: int = 4
    # A connection must send a request's headers within this long of opening (or of the first byte of its next
    # request); else it is closed
    header_timeout_s: float = 10.0
    # A request's body must arrive in full within this long of its headers; else 408 and the connection closed
    body_timeout_s: float = 60.0
    keepalive_timeout_s: float = 15.0  # an idle keep-alive connection is closed after this long
    # Open HTTP connections, at most (and under the limit on open files): at the cap a new connection
    # displaces the longest-waiting one that holds no request, unauthenticated ones first (api/limits.py)
    max_connections: int = 4096
    # Kept for /health, /metrics and authenticated clients: past max_connections minus this, new connections
    # have 1 s to send their headers, unauthenticated ones are closed after their answer, and once this many
    # connections below the cap hold requests, other routes answer 503
    connection_reserve: int = 64
    # Tokens a non-stream answer may hold (n x max_tokens x (1 + logprobs) summed over prompts, and the
    # prompts' with prompt_logprobs); a request that could exceed it gets 400 (a stream is not held whole)
    max_response_tokens: int = 1 << 20
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id, at most (0: none)
    responses_store_ttl_s: float = 3600.0  # how long /v1/responses' store keeps a response
    # KV cache events for routers that place requests by cached prefix, as JSON in the shape of vLLM's flag of
    # this name (docs/kv_events.md); "": off. The scheduler publishes them; the api names them to routers
    # (GET /kv_event_sources, api/render.py)
    kv_events_config: str = ""
    data_parallel_rank: int = 0  # this replica's rank: its KV events carry it, their ports are offset by it

    def __post_init__(self) -> None:
        check_choices(self)
        if not 1 <= self.port <= 65535:  # the OS would take it modulo 65536: 99999 listened on 34463
            raise ValueError(f"port must be a TCP port (1-65535), got {self.port}")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            json_string_list(name, getattr(self, name))
        # Credentials with any origin would let every site act with the user's cookies
        if self.allow_credentials and "*" in json_string_list("allowed_origins", self.allowed_origins):
            raise ValueError('allow_credentials needs allowed_origins to name origins, not "*"')
        if self.default_max_tokens < 0:
            raise ValueError(f"default_max_tokens must be at least 0, got {self.default_max_tokens}")
        if not 0 <= self.auth_failures_per_minute <= 1 << 20:
            raise ValueError("auth_failures_per_minute must be in [0, 2**20]")
        if not 1 <= self.tokenizer_threads <= 64:
            raise ValueError("tokenizer_threads must be in [1, 64]")
        if min(self.header_timeout_s, self.body_timeout_s, self.keepalive_timeout_s) <= 0:
            raise ValueError("header_timeout_s, body_timeout_s and keepalive_timeout_s must be positive")
        if not 0 <= self.connection_reserve < self.max_connections:
            raise ValueError("connection_reserve must be in [0, max_connections)")
        if self.max_response_tokens < 1:
            raise ValueError("max_response_tokens must be at least 1")
        if not (0 <= self.responses_store_size <= 1 << 20 and 0 < self.responses_store_ttl_s <= 30 * 86400):
            raise ValueError("responses_store_size must be in [0, 2**20]; responses_store_ttl_s (0, 30 d]")


@dataclass(frozen=True)
class SchedulerConfig:
    """The scheduler: batching budgets and where it listens."""

    scheduler_address: str = DEFAULT_SCHEDULER_ADDRESS  # bound; clients connect here
    worker_address: str = DEFAULT_WORKER_ADDRESS  # bound; workers connect here
    # The server instance it belongs to (pagedserve serve sets it), told to clients so that an api of
    # another instance refuses it; empty: none
    instance_id: str = ""
    # sequences running in one step, at most (and at most what the worker announces it was sized for);
    # 0: what the worker announces (by default it follows its KV pool: worker/batch_limits.py)
    max_num_seqs: int = 0
    # tokens computed in one step, at most (decodes and prefill chunks; and at most what the worker announces)
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int = 0  # longest prompt + output; 0: what the worker announces
    enable_prefix_caching: bool = True  # reuse the KV blocks of prompts that start alike
    # what a preempted sequence loses: its KV blocks (recompute), or they move to the CPU pool (swap); auto:
    # per victim, whichever is cheaper (scheduler/preemption.py)
    preemption_mode: PreemptionMode = "auto"
    # fcfs, or priority (the request's priority, lower first, then arrival; the least urgent preempted first)
    scheduling_policy: SchedulingPolicy = "fcfs"
    # paged: blocks on demand. Baselines that claim a request's room up front, as pre-paging servers did:
    # reserved (prompt + max_tokens), reserved-max (max_model_len, whatever the request asks for).
    kv_policy: KVPolicy = "paged"
    # Sequences queued and not running (n and beam width count), at most; a request that would pass it gets
    # 503 ("overloaded; retry later"). 4096 = 8 batches of the default max_num_seqs: minutes of backlog, and
    # a bound on the scheduler's memory (20,000 prompts x n=128 took 1.3 GB unbounded).
    max_waiting_seqs: int = 4096
    # Fair admission (docs/scheduler.md): within a priority level, a request holding fewer seats goes first,
    # then the earlier one; while other requests wait, a request's first sequence takes at most this many
    # seats with it (its n > 1 samples forked from the prompt), the rest are admitted in turn.
    # 0: max_num_seqs // 8
    request_seat_quota: int = 0
    async_scheduling: bool = True  # plan step N+1 while the worker runs step N (no GPU idle between steps)
    heartbeat_timeout_s: float = 10.0  # a worker silent this long (no heartbeat, no output) is declared dead
    step_timeout_s: float = 600.0  # a step not answered this long declares the worker group hung
    # SIGTERM: refuse new requests, let those in flight finish this long, then end the rest, stop the worker
    shutdown_timeout_s: float = 30.0
    cluster_key_file: str = DEFAULT_CLUSTER_KEY_FILE  # clients and workers must hold this key pair
    log_level: str = "info"  # debug, info, warning or error: the least severe events logged
    # Record KV snapshots to this file (JSON lines) for /dashboard's replay and scripts/kv_replay.py; "": off
    kv_trace: str = ""
    kv_trace_max_mb: float = 64.0  # the trace stops at this size (its last line says so)
    # A KV snapshot (for /dashboard viewers and --kv-trace) is built at most this often (0.05 to 60)
    kv_snapshot_interval_s: float = 0.5
    # Speculative decoding (the worker's speculative config, docs/speculative.md): draft tokens verified per
    # step at most, shared by the decoding sequences (k each while they fit, fewer as the batch grows, none
    # past it: at high load a step is compute-bound and drafts only cost); 0: never speculate
    speculative_draft_budget: int = 64
    # accepted drafts per sequence and step (a moving average) below which speculation pauses (the pipeline
    # runs as without it)
    speculative_min_accepted: float = 0.5
    speculative_probe_steps: int = 32  # while paused, one step in this many drafts again (to measure again)
    # KV cache events for routers that place requests by cached prefix, as JSON in the shape of vLLM's flag of
    # this name (docs/kv_events.md); "": off
    kv_events_config: str = ""
    data_parallel_rank: int = 0  # this replica's rank: its KV events carry it, their ports are offset by it

    def __post_init__(self) -> None:
        check_choices(self)
        if (
            not 0 <= self.speculative_draft_budget <= 1 << 16
            or not 1 <= self.speculative_probe_steps <= 1 << 16
        ):
            raise ValueError(
                "speculative_draft_budget must be in [0, 65536], speculative_probe_steps in [1, 65536]"
            )
        if not 0.0 <= self.speculative_min_accepted <= 16.0:
            raise ValueError("speculative_min_accepted must be in [0, 16]")
        if not 0 <= self.data_parallel_rank < 1024:
            raise ValueError("data_parallel_rank must be in [0, 1024)")
        parse_kv_events_config(self.kv_events_config)  # a bad config fails at start, naming the key
        if self.max_waiting_seqs < 1 or self.request_seat_quota < 0:
            raise ValueError("max_waiting_seqs must be at least 1 and request_seat_quota at least 0")
        if not 0.05 <= self.kv_snapshot_interval_s <= 60 or not 0 < self.kv_trace_max_mb <= 1 << 20:
            raise ValueError("kv_snapshot_interval_s must be in [0.05, 60] and kv_trace_max_mb in (0, 2**20]")


@dataclass(frozen=True)
class WorkerConfig:
    """A worker: the model, its device and its KV pool."""

    # A local checkpoint directory, or a Hugging Face repo id (its cache, HF_HOME, HF_HUB_OFFLINE, HF_TOKEN)
    model: str = DEFAULT_MODEL_DIR
    served_model_name: str = ""  # empty: the checkpoint directory's name
    worker_address: str = DEFAULT_WORKER_ADDRESS  # the scheduler's worker socket
    device: str = "auto"  # cpu, cuda, cuda:N; auto picks cuda when there is one
    dtype: Dtype = "auto"  # float32, bfloat16, float16; auto: float32 on cpu, bfloat16 on cuda
    # auto: the model's dtype. fp8 (or fp8_e4m3): float8 e4m3 with a per-tensor scale per layer for K and
    # for V (the checkpoint's self_attn.k_scale / v_scale, else 1.0): half the bytes of bf16, twice the blocks
    kv_cache_dtype: KVCacheDtype = "auto"
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int = 0  # fix the pool size; 0: size it from memory
    kv_cache_memory_gib: float = 0.0  # on cpu, memory for the KV pool; 0: a quarter of what is available
    swap_space: float = 4.0  # GiB of CPU memory for swapped-out KV blocks; 0: no swapping
    # KV tiers for evicted prefix-cache blocks (docs/kv_tiers.md): GiB of host memory (pinned on cuda); -1: a
    # tenth of the available memory, at most 64 GiB; 0: off (with a disk tier: one sequence's worth to stage)
    kv_offload_gb: float = -1.0
    kv_disk_dir: str = ""  # a directory for the disk tier below host memory (its *.kvblock files); "": off
    kv_disk_gb: float = 16.0  # GiB of block files in kv_disk_dir, at most
    # torch (the reference) or triton; auto: triton on cuda, torch on cpu
    attention_backend: AttentionBackendName = "auto"
    max_model_len: int = 0  # longest prompt + output; 0: the model's max_position_embeddings
    gpu_memory_utilization: float = 0.9  # cuda: fraction of the GPU's memory for weights, activations and KV
    enforce_eager: bool = False  # cuda: no CUDA graphs for decode steps
    # cuda, with decode graphs on: prefill and mixed steps replay graphs of everything but the attention,
    # captured per padded token count (worker/cuda_graphs.py MixedGraphs)
    piecewise_graphs: bool = True
    # Triton kernels for RMSNorm (+ residual add), RoPE and SiLU-and-mul instead of 2-9 PyTorch ops each
    # (kernels/fused_ops.py); unset: on with CUDA. On the CPU they need TRITON_INTERPRET=1 (tests only).
    fused_ops: bool | None = None
    # the largest decode batch (on cuda, the largest CUDA graph); 0: follows the KV pool, one seat per 1024
    # tokens of it within [512, 1024] (worker/batch_limits.py), so the larger pool of TP=2 runs larger batches
    max_num_seqs: int = 0
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS  # cuda: the memory profile's step size
    tensor_parallel_size: int = 1  # workers in the tensor-parallel group
    rank: int = 0  # this worker's rank in the group (0 talks to the scheduler)
    dist_init_method: str = "tcp://127.0.0.1:29500"  # torch.distributed rendezvous of the group
    heartbeat_interval_s: float = 1.0  # how often the worker tells the scheduler it is alive
    # SIGTERM: keep serving the scheduler's plans this long (it drains its requests, then says Shutdown)
    shutdown_timeout_s: float = 30.0
    cluster_key_file: str = DEFAULT_CLUSTER_KEY_FILE  # the key pair that opens the scheduler's sockets
    step_trace: str = ""  # a file for one JSON line per step: host timestamps, GPU and idle time (rank 0)
    log_level: str = "info"  # debug, info, warning or error: the least severe events logged
    # With a Hugging Face repo id as --model: the branch, tag or commit (empty: main)
    revision: str = ""
    # fp8: quantize the checkpoint's linear weights to FP8 at load (one scale per output channel); a
    # checkpoint with a quantization_config (FP8) is served as quantized whatever this says
    quantization: Quantization = ""
    # Speculative decoding, vLLM's JSON shape (common/speculative.py): {"method": "ngram" | "draft_model",
    # "num_speculative_tokens": k, "model": ...}; empty: off
    speculative_config: str = ""
    # Tensor parallelism's all-reduces. auto: a one-shot all-reduce through symmetric memory (peer reads over
    # NVLink) for messages up to 16 MiB where every GPU of the group reaches the others, NCCL for larger
    # ones and elsewhere (worker/tp_all_reduce.py); nccl: NCCL for all of them. one-shot: that alone (the
    # partial sums copied into the buffer); no-copy: o_proj/down_proj write into it (worker/tp_fused.py);
    # fused: and their all-reduce is one kernel with the residual add + RMSNorm; auto: fused where it runs
    tp_all_reduce: TPAllReduce = "auto"
    # auto: the checkpoint's weights (*.safetensors); dummy: random weights drawn on the device, only
    # config.json (and the tokenizer) read, for benchmarks of a model's shape (worker/dummy_weights.py)
    load_format: LoadFormat = "auto"
    seed: int = 0  # seeds what the worker draws itself: the weights of --load-format dummy
    # structured output: the most threads advancing and filling a step's masks (worker/grammar_batch.py);
    # 0: half the cores, at most 8
    grammar_threads: int = 0
    # With a draft model: draft a drafting step's next tokens right after answering it, while the scheduler
    # plans the next step (worker/spec/ahead.py); never under tensor parallelism
    speculative_draft_ahead: bool = True

    def __post_init__(self) -> None:
        check_choices(self)
        if not 0 <= self.grammar_threads <= MAX_GRAMMAR_THREADS:
            raise ValueError(
                f"grammar_threads must be within [0, {MAX_GRAMMAR_THREADS}], got {self.grammar_threads}"
            )
        parse_speculative_config(self.speculative_config)  # a bad config fails at start, naming the key
        if self.kv_offload_gb < -1 or self.kv_disk_gb < 0:
            raise ValueError("kv_offload_gb must be -1 (auto) or at least 0, and kv_disk_gb at least 0")

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device == "cpu" else "bfloat16"

    @property
    def resolved_kv_cache_dtype(self) -> str:
        """The KV pools' torch dtype name."""
        return self.resolved_dtype if self.kv_cache_dtype == "auto" else "float8_e4m3fn"

    @property
    def resolved_fused_ops(self) -> bool:
        return self.fused_ops if self.fused_ops is not None else self.resolved_device != "cpu"

    @property
    def resolved_attention_backend(self) -> str:
        if self.attention_backend != "auto":
            return self.attention_backend
        return "torch" if self.resolved_device == "cpu" else "triton"


def default_cluster_key_file() -> str:
    """The cluster key file for code that has no config of its own (ZeroMQ clients, scripts)."""
    return os.environ.get(ENV_PREFIX + "CLUSTER_KEY_FILE", DEFAULT_CLUSTER_KEY_FILE)
