"""The prefill daemon's one frozen config object (flags, then KVFERRY_* env, then defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.common.daemon.flags import flag, require
from kvferry.common.daemon.config import CommonConfig


@dataclass(frozen=True)
class PrefillConfig(CommonConfig):
    """kvferry prefill: computes prompt KV and pushes it into decode memory over NIXL."""

    port: int = flag(30000, help="HTTP port")
    bootstrap_host: str = flag("127.0.0.1", help="ZeroMQ bootstrap bind address")
    bootstrap_port: int = flag(8998, help="ZeroMQ bootstrap (ROUTER) port; give it to the router after the prefill URL")
    advertise_host: str | None = flag(None, help="host decodes should use to reach this prefill (vllm-router path); default: bootstrap host")
    transfer_wait_timeout_s: float = flag(30.0, help="how long a prefilled room waits for its decode's transfer request")
    register_timeout_s: float = flag(10.0, help="deadline for building a decode's transfer plan")
    max_prefill_tokens: int = flag(8192, help="prompt tokens per prefill batch")
    chunked_prefill_size: int = flag(8192, help="a longer prompt is prefilled in chunks of this many tokens, one "
                                                "per batch, so it holds other prompts up by one chunk at most; "
                                                "0 = whole prompts")
    xfer_threads: int | None = flag(None, help="rooms whose NIXL WRITE is in flight at once (threads); default 8 "
                                               "on a GPU (a thread mostly waits), 2 on CPU (a thread copies)")
    max_prompt_logprob_tokens: int = flag(8192, help="prompt tokens whose logprobs one request may ask for "
                                                     "(return_logprob with logprob_start_len); more get HTTP 400")
    staging_chunk_bytes: int = flag(32 << 20, help="one WRITE of a staged room; each staged room in flight holds "
                                                  "two chunks of --staging-bytes (gather one while the other is "
                                                  "on the wire)")
    staging_crossover_runs: int = flag(-1, help="stage a room whose WRITE would carry at least this many "
                                               "descriptors: -1 = from costs measured at start-up (logged), 0 = never")
    curve_secret_key: str | None = flag(None, help="CURVE secret key file (kvferry keygen) to authenticate the bootstrap socket")
    curve_authorized_keys: str | None = flag(None, help="folder of decode public keys allowed to connect (with --curve-secret-key)")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 < self.bootstrap_port < 65536, f"--bootstrap-port must be in 1..65535, got {self.bootstrap_port}")
        require(self.bootstrap_port != self.port or self.bootstrap_host != self.host,
                f"--bootstrap-port {self.bootstrap_port} equals --port; pick two ports")
        require(self.transfer_wait_timeout_s > 0, "--transfer-wait-timeout-s must be positive")
        require(self.max_prefill_tokens > 0, "--max-prefill-tokens must be positive")
        require(self.chunked_prefill_size >= 0, f"--chunked-prefill-size must be >= 0, got {self.chunked_prefill_size}")
        require(self.max_prompt_logprob_tokens >= 0, "--max-prompt-logprob-tokens must be >= 0")
        require(self.xfer_threads is None or 1 <= self.xfer_threads <= 64,
                f"--xfer-threads must be in 1..64, got {self.xfer_threads}")
        require(self.staging_chunk_bytes > 0, f"--staging-chunk-bytes must be positive, got {self.staging_chunk_bytes}")
        require(self.staging_crossover_runs >= -1, f"--staging-crossover-runs must be >= -1, got "
                                                   f"{self.staging_crossover_runs}")
        require((self.curve_secret_key is None) == (self.curve_authorized_keys is None),
                "--curve-secret-key and --curve-authorized-keys go together")

    @property
    def num_xfer_threads(self) -> int:
        if self.xfer_threads is not None:
            return self.xfer_threads
        return 2 if self.device == "cpu" else 8

    @property
    def advertised_host(self) -> str:
        if self.advertise_host:
            return self.advertise_host
        return "127.0.0.1" if self.bootstrap_host in ("0.0.0.0", "::", "") else self.bootstrap_host
