"""Prometheus metrics of one daemon, on a registry of its own (served at /metrics).

Names follow ``kvferry_<what>_<unit>``; every failure path increments a counter with a reason.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30)


class Metrics:
    def __init__(self, role: str):
        self.role = role
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvferry_requests", "HTTP generation requests by outcome", ["outcome"], registry=r)
        self.failed_transfers = Counter("kvferry_failed_transfers", "KV transfers that failed, by reason",
                                        ["reason"], registry=r)
        self.timeouts = Counter("kvferry_timeouts", "deadlines that expired, by stage", ["stage"], registry=r)
        self.aborts = Counter("kvferry_aborts", "rooms aborted, by the side that asked", ["side"], registry=r)
        self.stale_notifications = Counter("kvferry_stale_notifications",
                                           "NIXL notifications for unknown or expired rooms (ignored)", registry=r)
        self.protocol_errors = Counter("kvferry_protocol_errors", "malformed control frames received", registry=r)
        self.registrations = Counter("kvferry_registrations", "decode registrations by result", ["result"], registry=r)
        self.heartbeat_misses = Counter("kvferry_heartbeat_misses", "pings that got no pong in time", registry=r)
        self.unsafe_writes = Counter("kvferry_unsafe_writes", "WRITEs that could not be cancelled: their pages "
                                     "are quarantined for good", registry=r)
        self.pages_quarantined = Gauge("kvferry_pages_quarantined", "KV pages held out of the pool because a "
                                       "WRITE into them (or from them) may still land", registry=r)
        self.pages_in_use = Gauge("kvferry_pages_in_use", "KV pages allocated", ["model"], registry=r)
        self.pages_total = Gauge("kvferry_pages_total", "KV pages in the pool", ["model"], registry=r)
        self.kv_pool_info = Gauge("kvferry_kv_pool_info", "1 for each KV pool, labelled with its dtype "
                                  "(--kv-cache-dtype: the model's, or float8_e4m3fn)", ["model", "kv_dtype"],
                                  registry=r)
        self.rooms_waiting = Gauge("kvferry_rooms_waiting", "rooms waiting for their peer", registry=r)
        self.requests_running = Gauge("kvferry_requests_running", "requests being served", registry=r)
        self.requests_queued = Gauge("kvferry_requests_queued", "requests admitted but waiting", registry=r)
        self.staging_rooms = Counter("kvferry_staging_rooms", "rooms by transfer path (staged: gathered into one "
                                     "WRITE per chunk; direct) and, for direct, why not staged", ["path", "reason"],
                                     registry=r)
        self.staging_slots_free = Gauge("kvferry_staging_slots_free", "staging slots free on this side", registry=r)
        self.transfer_bytes = Counter("kvferry_transfer_bytes", "KV and aux bytes written", registry=r)
        self.transfer_seconds = Histogram("kvferry_transfer_seconds", "one room's WRITE, post to DONE",
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.kv_wait_seconds = Histogram("kvferry_kv_wait_seconds", "decode: transfer request to KV arrival",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft_seconds = Histogram("kvferry_ttft_seconds", "request arrival to first token",
                                      buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_batch_seconds = Histogram("kvferry_prefill_batch_seconds", "prefill: one batch's forward "
                                               "(its chunks' new tokens through the model, first tokens sampled)",
                                               buckets=_LATENCY_BUCKETS, registry=r)
        self.prefill_batch_tokens = Counter("kvferry_prefill_batch_tokens", "prefill: new tokens run through "
                                            "the model by the batches of kvferry_prefill_batch_seconds", registry=r)
        self.room_bytes = Histogram("kvferry_room_bytes", "KV and aux bytes one room's WRITE moved",
                                    buckets=tuple(float(1 << k) for k in range(10, 36, 2)), registry=r)
        self.prefix_hit_tokens = Counter("kvferry_prefix_hit_tokens", "prompt tokens found in this side's prefix "
                                         "cache: on the prefill, not recomputed; on the decode, not transferred",
                                         ["side"], registry=r)
        self.prompt_tokens_computed = Counter("kvferry_prompt_tokens_computed", "prompt tokens whose KV this "
                                              "daemon computed", registry=r)
        self.prefix_evicted_pages = Counter("kvferry_prefix_evicted_pages", "cached pages evicted (LRU, under "
                                            "pool pressure or the --max-cached-tokens bound)", registry=r)
        self.prefix_cached_pages = Gauge("kvferry_prefix_cached_pages", "pages the prefix cache holds", registry=r)
        self.local_prefill_rooms = Counter("kvferry_local_prefill_rooms", "rooms whose decode computed the rest "
                                           "of the prompt itself (--max-local-prefill-tokens)", registry=r)
        self.generated_tokens = Counter("kvferry_generated_tokens", "tokens generated", registry=r)
        self.spec_proposed = Counter("kvferry_spec_proposed_tokens", "draft tokens proposed", registry=r)
        self.spec_accepted = Counter("kvferry_spec_accepted_tokens", "draft tokens accepted", registry=r)
        self.grammars = Counter("kvferry_grammars", "structured-output grammars requests asked for, by result "
                                "(cached, compiled, invalid)", ["result"], registry=r)
        self.grammar_compile_seconds = Histogram("kvferry_grammar_compile_seconds", "one grammar's compilation "
                                                 "(on the grammar executor)", buckets=_LATENCY_BUCKETS, registry=r)

    def observe_grammar(self, result: str, seconds: float) -> None:
        """``GrammarCache``'s report: a grammar found in the cache, compiled, or refused as invalid."""
        self.grammars.labels(result=result).inc()
        if result != "cached":
            self.grammar_compile_seconds.observe(seconds)

    def observe_kv_dtypes(self, slots) -> None:
        """Once the pools exist: each pool's dtype (fixed for the daemon's life)."""
        for slot in slots:
            self.kv_pool_info.labels(model=slot.kv.model_name, kv_dtype=slot.kv.kv_dtype).set(1)

    def observe_pools(self, slots) -> None:
        """Set the page gauges from ``ModelRunner.slots`` (each with ``kv`` and ``allocator``)."""
        for slot in slots:
            name = slot.kv.model_name
            self.pages_total.labels(model=name).set(slot.kv.num_pages)
            self.pages_in_use.labels(model=name).set(slot.kv.num_pages - slot.allocator.num_free)

    def observe_cache(self, cache) -> None:
        """The prefix cache's gauges (``RadixCache``, or None without one); evictions since last seen."""
        if cache is None:
            return
        self.prefix_cached_pages.set(cache.num_pages)
        seen = getattr(self, "_evicted_seen", 0)
        if cache.num_evicted > seen:
            self.prefix_evicted_pages.inc(cache.num_evicted - seen)
        self._evicted_seen = cache.num_evicted

    def render(self) -> bytes:
        return generate_latest(self.registry)
