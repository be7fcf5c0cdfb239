"""Settings both daemons share; each daemon's config dataclass inherits these fields."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.common.api.limits import DEFAULT_MAX_REQUEST_BYTES
from kvferry.common.daemon.flags import flag, require
from kvferry.common.daemon.log import LEVELS
from kvferry.common.kernels.kv_quant import KV_CACHE_DTYPES

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_LAYOUTS = ("page-major", "layer-major")  # common/cache/kv_cache.py has the same tuple (a test checks)
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # as common/layers/attn_backend.py


@dataclass(frozen=True)
class CommonConfig:
    """Shared settings."""

    model: str = flag(help="checkpoint folder (config.json, safetensors, tokenizer.json) or FILE.gguf (converted "
                           "once into ~/.cache/kvferry/gguf)")
    draft_model: str | None = flag(None, help="draft checkpoint folder or FILE.gguf for speculative decoding")
    draft_device: str | None = flag(None, help="device of the draft model and its KV (default: --device); "
                                               "cpu with a cuda target keeps the draft KV in DRAM")
    host: str = flag("127.0.0.1", help="HTTP bind address (explicit; 0.0.0.0 to listen on all)")
    port: int = flag(30000, help="HTTP port")
    device: str = flag("cpu", help="cpu or cuda:N")
    dtype: str = flag("auto", help="weights and KV dtype; auto = float32 on cpu, bfloat16 on cuda", choices=DTYPES)
    page_size: int = flag(16, help="tokens per KV page (the peer's may differ: the transfer maps token ranges)")
    tp_size: int = flag(1, help="tensor-parallel ranks, one process each (cuda:K from --device's index on, or "
                                "cpu); rank 0 serves HTTP and schedules, every rank owns its KV heads and NIXL "
                                "agent; the peer's --tp-size may differ")
    served_model_name: str | None = flag(None, help="the model's name in /v1/models and /server_info "
                                                    "(default: the folder's name, or the GGUF file's stem)")
    max_total_tokens: int = flag(0, help="KV pool size in tokens (per model); 0 = auto: --kv-mem-fraction of the "
                                         "memory free at start-up (common/daemon/start.py)")
    kv_mem_fraction: float = flag(-1.0, help="with --max-total-tokens 0, the share of free memory the KV pools take: "
                                             "-1 = auto (0.4 of the GPU's free memory after the weights on CUDA, "
                                             "0.1 of MemAvailable on CPU, at most 512 MiB); at most 65536 tokens")
    kv_cache_dtype: str = flag("auto", choices=KV_CACHE_DTYPES,
                               help="KV pool dtype: auto = the model's (--dtype); fp8_e4m3 stores K/V as float8 "
                                    "e4m3 with per-layer scales (the checkpoint's k_scale/v_scale, else 1.0): "
                                    "half the bytes of bf16 per token, about 2x the tokens at the same memory, "
                                    "at some accuracy; the peer must use the same")
    kv_layout: str = flag("page-major", choices=KV_LAYOUTS,
                          help="KV pool layout: page-major keeps one page of every layer in one block (one "
                               "NIXL descriptor per page), layer-major one block per layer; the peer may differ")
    attention_backend: str = flag("auto", choices=ATTENTION_BACKENDS,
                                  help="paged attention: triton reads KV pages in place (CUDA), torch gathers "
                                       "them (CPU, reference); auto = triton on CUDA when Triton imports")
    cuda_graph_max_bs: int = flag(128, help="largest decode batch captured as a CUDA graph (buckets 1, 2, 4, ... "
                                            "up to it; larger batches run eagerly)")
    disable_cuda_graph: bool = flag(False, help="run decode steps eagerly on CUDA (no graphs captured)")
    disable_pdl: bool = flag(False, help="launch the Triton kernels without programmatic dependent launch (on by "
                                         "default on sm_90+: each kernel's start overlaps the end of the one before)")
    max_running_requests: int = flag(64, help="requests decoded (or rooms held) at once")
    max_queued_requests: int = flag(256, help="requests waiting beyond that; more get HTTP 503")
    api_key: str | None = flag(None, help="require 'Authorization: Bearer KEY' on HTTP (health stays open)")
    max_request_bytes: int = flag(DEFAULT_MAX_REQUEST_BYTES, help="largest HTTP request body accepted; a larger one gets 413")
    request_timeout_s: float = flag(300.0, help="deadline for a whole HTTP request")
    drain_timeout_s: float = flag(30.0, help="on SIGTERM, how long in-flight requests may finish")
    heartbeat_interval_s: float = flag(2.0, help="ping interval on each control connection")
    heartbeat_misses: int = flag(3, help="missed pongs after which a peer is declared dead")
    xfer_timeout_s: float = flag(10.0, help="deadline for one NIXL WRITE to complete")
    log_level: str = flag("info", help="log level", choices=LEVELS)
    staging_bytes: int = flag(-1, help="registered staging buffer for scattered rooms (gathered into one WRITE, "
                                       "scattered back on the decode): -1 = auto (512 MiB on CUDA, 0 on CPU, "
                                       "where copies cost more than descriptors); 0 = off, every room direct")
    disable_prefix_cache: bool = flag(False, help="keep no prefix cache: every prompt computed (prefill) or "
                                                  "received (decode) whole")
    max_cached_tokens: int = flag(0, help="most tokens the prefix cache keeps (least recently used evicted "
                                          "first); 0 = as many as the KV pool holds (evicted under pressure)")
    kv_events_endpoint: str | None = flag(None, help="publish KV cache events (vLLM kv_events format) on this "
                                                     "ZeroMQ PUB endpoint, e.g. tcp://127.0.0.1:5557")
    kv_events_replay_endpoint: str | None = flag(None, help="with --kv-events-endpoint: a ROUTER endpoint that "
                                                            "replays buffered event batches from a sequence number")
    kv_events_topic: str = flag("", help="with --kv-events-endpoint: the topic frame of every event message")

    def __post_init__(self) -> None:
        require(self.page_size > 0, f"--page-size must be positive, got {self.page_size}")
        require(self.max_total_tokens == 0 or self.max_total_tokens >= self.page_size,
                f"--max-total-tokens ({self.max_total_tokens}) must be 0 (auto) or hold at least one page "
                f"({self.page_size})")
        require(self.kv_mem_fraction == -1.0 or 0 < self.kv_mem_fraction < 1,
                f"--kv-mem-fraction must be -1 (auto) or in (0, 1), got {self.kv_mem_fraction}")
        require(0 < self.port < 65536, f"--port must be in 1..65535, got {self.port}")
        require(self.device == "cpu" or self.device.startswith("cuda"), f"--device must be cpu or cuda:N, got {self.device!r}")
        require(self.draft_device is None or self.draft_device == "cpu" or self.draft_device.startswith("cuda"),
                f"--draft-device must be cpu or cuda:N, got {self.draft_device!r}")
        require(self.tp_size >= 1, f"--tp-size must be >= 1, got {self.tp_size}")
        require(self.max_running_requests > 0, "--max-running-requests must be positive")
        require(self.cuda_graph_max_bs >= 0, f"--cuda-graph-max-bs must be >= 0, got {self.cuda_graph_max_bs}")
        require(self.max_queued_requests >= 0, "--max-queued-requests must be >= 0")
        require(self.max_request_bytes > 0, f"--max-request-bytes must be positive, got {self.max_request_bytes}")
        require(self.staging_bytes >= -1, f"--staging-bytes must be >= -1, got {self.staging_bytes}")
        require(self.max_cached_tokens >= 0, f"--max-cached-tokens must be >= 0, got {self.max_cached_tokens}")
        require(self.kv_events_replay_endpoint is None or self.kv_events_endpoint is not None,
                "--kv-events-replay-endpoint needs --kv-events-endpoint")
        require(self.kv_events_endpoint is None or not self.disable_prefix_cache,
                "--kv-events-endpoint publishes the prefix cache's events: not with --disable-prefix-cache")
        for name in ("request_timeout_s", "drain_timeout_s", "heartbeat_interval_s", "xfer_timeout_s"):
            require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive")

    @property
    def engine_options(self) -> dict:
        """The attention and CUDA graph settings, as ``build_runner`` keywords."""
        return {"attention_backend": self.attention_backend, "cuda_graph_max_bs": self.cuda_graph_max_bs,
                "disable_cuda_graph": self.disable_cuda_graph, "kv_cache_dtype": self.kv_cache_dtype}

    @property
    def staging_nbytes(self) -> int:
        """--staging-bytes with auto resolved."""
        if self.staging_bytes >= 0:
            return self.staging_bytes
        return 0 if self.device == "cpu" else 512 << 20

    @property
    def num_pages(self) -> int:
        return self.max_total_tokens // self.page_size

    @property
    def torch_dtype_name(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.device == "cpu" else "bfloat16"

    @property
    def kv_torch_dtype_name(self) -> str:
        """The KV pool's torch dtype name (``KvCache.kv_dtype``): the model's, or float8_e4m3fn."""
        return self.torch_dtype_name if self.kv_cache_dtype == "auto" else "float8_e4m3fn"
