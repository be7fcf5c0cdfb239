"""The decode daemon's one frozen config object (flags, then KVFERRY_* env, then defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from kvferry.common.daemon.flags import flag, require
from kvferry.common.daemon.config import CommonConfig


@dataclass(frozen=True)
class DecodeConfig(CommonConfig):
    """kvferry decode: receives prompt KV from prefills and generates, with optional speculative decoding."""

    port: int = flag(30001, help="HTTP port")
    spec_k: int = flag(4, help="draft tokens proposed per step (with --draft-model)")
    disable_overlap_schedule: bool = flag(False, help="wait for each decode step's tokens before launching the "
                                                      "next (by default step N+1 is launched first, fed on the "
                                                      "device, while the host reads and detokenizes step N)")
    kv_wait_timeout_s: float = flag(60.0, help="how long a request waits for its KV after asking the prefill")
    register_timeout_s: float = flag(10.0, help="deadline for a prefill to acknowledge registration")
    curve_secret_key: str | None = flag(None, help="this decode's CURVE secret key file (kvferry keygen)")
    curve_server_key: str | None = flag(None, help="the prefills' CURVE public key file (with --curve-secret-key)")
    allowed_bootstrap_hosts: str = flag("", help="comma-separated bootstrap hosts a request may name (as the router "
                                                 "sends them); empty = any. A request naming another gets HTTP 400")
    staging_slot_bytes: int = flag(0, help="one staging slot (a staged room must fit whole); 0 = half of "
                                           "--staging-bytes (two rooms at once)")
    max_prefill_links: int = flag(64, help="prefills this decode keeps a control connection to at once; the "
                                           "longest idle one is closed to open another")

    max_local_prefill_tokens: int = flag(0, help="prefill here, skipping the prefill's compute and WRITE, a "
                                                 "prompt this decode holds in its prefix cache but for at most "
                                                 "this many tokens (the prefill's leg just ends); 0 = off")

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.spec_k <= 16, f"--spec-k must be in 0..16, got {self.spec_k}")
        require(self.kv_wait_timeout_s > 0, "--kv-wait-timeout-s must be positive")
        require((self.curve_secret_key is None) == (self.curve_server_key is None),
                "--curve-secret-key and --curve-server-key go together")
        require(self.max_prefill_links > 0, "--max-prefill-links must be positive")
        require(self.max_local_prefill_tokens >= 0,
                f"--max-local-prefill-tokens must be >= 0, got {self.max_local_prefill_tokens}")
        require(self.max_local_prefill_tokens == 0 or not self.disable_prefix_cache,
                "--max-local-prefill-tokens needs the prefix cache (not with --disable-prefix-cache)")
        require(self.staging_slot_bytes >= 0, f"--staging-slot-bytes must be >= 0, got {self.staging_slot_bytes}")

    @property
    def bootstrap_hosts(self) -> frozenset[str]:
        """The hosts a request may name; empty: any."""
        return frozenset(h.strip() for h in self.allowed_bootstrap_hosts.split(",") if h.strip())
