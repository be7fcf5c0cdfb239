"""The prefill's registrations: a decode's ``register`` → validated layout, ``TransferPlan``, its NIXL
agent loaded and one pair of prepared lists per descriptor group → ``register_ack``.

Each registration runs as a task of its own and does its NIXL work on a small executor of its own,
so the frame loop answers other peers (pings, transfers) meanwhile. At most
``MAX_PENDING_REGISTERS`` run at once, one per decode id; one past ``--register-timeout-s`` is
refused, and what its job did is undone once the job ends. A refusal carries a ``FailCode``: a
layout or ownership refusal the decode remembers, OVERLOADED and TIMEOUT it retries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from kvferry.common.daemon.aio import wait_for
from kvferry.common.wire import messages as wire
from kvferry.common.plan import geometry
from kvferry.common.errors import DisaggError, FailCode, GeometryMismatchError, ProtocolError
from kvferry.common.plan.geometry import TransferPlan
from kvferry.common.plan.layout import ADDR_LIMIT, KvLayout, check_tp_rank
from kvferry.common.wire.messages import MEM_KINDS
from kvferry.common.daemon.metrics import Metrics
from kvferry.common.transport.nixl import NixlEngine
from kvferry.common.transport.nixl_probe import MetadataProbe
from kvferry.prefill_worker.peers import DecodePeer, ListPair, PeerTable
from kvferry.prefill_worker.staging import stream_runs
from kvferry.prefill_worker.tp_parts import TpRegistrations
from kvferry.prefill_worker.tp_transfer import RankTransport, TpPeerPlan, build_peer_plan, needs_feeds

logger = logging.getLogger(__name__)

MAX_PENDING_REGISTERS = 8  # registrations whose NIXL work runs at once
MAX_STAGING_SLOTS = 4096  # a decode registering more staging slots stages nothing


class Registrar:
    def __init__(self, *, engine: NixlEngine, layout: KvLayout, peers: PeerTable, metrics: Metrics, prefill_id: str,
                 register_timeout_s: float, send: Callable[[bytes, wire.Message], Awaitable[None]],
                 draft_model: str = "", probe: MetadataProbe | None = None,
                 transport: RankTransport | None = None, staging: bool = False):
        self.engine = engine
        self.staging = staging  # this prefill stages scattered rooms: tell a decode that offers slots how
        # every prefill rank's agent and table: decodes of another TP or page size are fed through it
        self.transport = transport or RankTransport(engine, [layout])
        self.tp_parts = TpRegistrations()
        self.layout = layout
        self.peers = peers
        self.metrics = metrics
        self.prefill_id = prefill_id
        self.register_timeout_s = register_timeout_s
        self.send = send
        self.draft_model = draft_model
        self.probe = probe
        self.executor = ThreadPoolExecutor(2, thread_name_prefix="prefill-register")
        self._registering: dict[str, asyncio.Future] = {}  # decode_id -> its NIXL job, until that ends
        self._tasks: set[asyncio.Task] = set()

    def spawn(self, identity: bytes, owner: bytes, msg: wire.Register) -> None:
        """Start one registration as a task of its own; the frame loop goes on at once."""
        task = asyncio.get_running_loop().create_task(self._register(identity, owner, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.executor.shutdown(wait=True)

    async def _register(self, identity: bytes, owner: bytes, msg: wire.Register) -> None:
        """Task: one registration, off the frame loop (other peers' pings are answered meanwhile)."""
        self.peers.note_register(identity)
        try:  # before anything counts over the decode's ranks
            check_tp_rank(msg.tp_size, msg.tp_rank, f"decode_id={msg.decode_id} register")
        except DisaggError as exc:
            await self._refuse(identity, msg, exc)
            return
        if msg.page_order != wire.PAGE_ORDER:  # the bytes inside a page would be read in another order
            await self._reject(identity, msg, f"page order mismatch: prefill pages are {wire.PAGE_ORDER!r}, decode "
                                              f"pages are {msg.page_order or 'tokens-outer (a kvferry before 0.5)'!r}; "
                                              f"run the same kvferry version on both sides", FailCode.GEOMETRY)
            return
        if needs_feeds(self.transport.layouts, msg):
            await self._register_feeds(identity, owner, msg)
            return
        try:
            plan, lists = await self._plan_and_lists(owner, msg)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # task boundary: refuse with the reason, keep serving
            await self._refuse(identity, msg, exc)
            return
        staging = self._staging_of(msg)
        self.peers.install(DecodePeer(msg.decode_id, msg.agent_name, identity, owner, plan, lists, staging=staging,
                                      reads_cached_tokens=msg.reads_cached_tokens))
        await self._accept(identity, msg, plan, stream_runs(plan) if staging is not None else None)

    def _staging_of(self, msg: wire.Register) -> wire.StagingInfo | None:
        """The decode's staging slots, when both sides stage and they are sane (else rooms go direct)."""
        info = msg.staging
        if not self.staging or info is None:
            return None
        if (info.mem not in MEM_KINDS or info.slot_nbytes <= 0 or not 0 < info.num_slots <= MAX_STAGING_SLOTS
                or info.addr < 0 or info.device < 0 or info.addr + info.num_slots * info.slot_nbytes > ADDR_LIMIT):
            logger.warning("decode_id=%s registered unusable staging slots (%s): its rooms go direct",
                           msg.decode_id, info)
            return None
        return info

    async def _accept(self, identity: bytes, msg: wire.Register, plan, staging_runs=None) -> None:
        self.metrics.registrations.labels(result="accepted").inc()
        logger.info("registered decode_id=%s peer=%s: %d regions written, %d ignored, decode_only_spec_dec=%s",
                    msg.decode_id, msg.agent_name, len(plan.written), len(plan.ignored), plan.decode_only_spec_dec)
        await self.send(identity, wire.RegisterAck(
            prefill_id=self.prefill_id, accepted=True, error=None,
            written=[list(k) for k in plan.written], ignored=[list(k) for k in plan.ignored],
            decode_only_spec_dec=plan.decode_only_spec_dec, staging_runs=staging_runs, abort_codes=True, prefix_writes=True))

    async def _plan_and_lists(self, owner: bytes, msg: wire.Register) -> tuple[TransferPlan, list[ListPair]]:
        refusal = self.peers.refuse_register(msg.decode_id, msg.agent_name, owner)
        if refusal is not None:
            raise ProtocolError(refusal[0], code=refusal[1])
        peer_name = f"decode_id={msg.decode_id} agent={msg.agent_name}"
        plan = geometry.build_plan(self.layout, KvLayout.from_register(msg), peer=peer_name)
        if plan.conversion is not None and not self.staging:
            raise GeometryMismatchError(
                f"{peer_name}: kv_dtype {plan.conversion.dst!r} differs from this prefill's {plan.conversion.src!r}; "
                f"a room is converted while staged, and this prefill stages nothing: start it with --staging-bytes "
                f"> 0 (and --staging-crossover-runs other than 0), or both sides with the same --kv-cache-dtype")
        self._check_draft(msg, plan)
        old = self.peers.get(msg.decode_id)
        if old is not None and old.agent_name == msg.agent_name:
            if old.plan != plan:
                raise GeometryMismatchError(f"{peer_name} registered again with another KV layout under the "
                                            f"same agent; a changed decode restarts under a new id")
            return plan, old.lists  # the same process again: a WRITE in flight may use these lists
        if msg.decode_id in self._registering:
            raise ProtocolError(f"a registration of decode_id={msg.decode_id} is still in progress; retry",
                                code=FailCode.OVERLOADED)
        if len(self._registering) >= MAX_PENDING_REGISTERS:
            raise ProtocolError(f"prefill is busy with {len(self._registering)} registrations; retry",
                                code=FailCode.OVERLOADED)
        job = asyncio.get_running_loop().run_in_executor(self.executor, self._connect, msg, plan)
        self._registering[msg.decode_id] = job
        job.add_done_callback(lambda _: self._registering.pop(msg.decode_id, None))
        try:
            return plan, await wait_for(asyncio.shield(job), self.register_timeout_s)
        except asyncio.TimeoutError:
            job.add_done_callback(self._discard)
            self.metrics.timeouts.labels(stage="register").inc()
            raise ProtocolError(f"prefill could not add NIXL agent {msg.agent_name} within "
                                f"{self.register_timeout_s}s", code=FailCode.TIMEOUT) from None

    async def _register_feeds(self, identity: bytes, owner: bytes, msg: wire.Register) -> None:
        """A decode served through feeds (``tp_transfer``): rank registers are kept until rank 0's,
        which is planned against every prefill rank and connected on each."""
        try:
            refusal = self.peers.refuse_register(msg.decode_id, msg.agent_name, owner)
            if refusal is not None:
                raise ProtocolError(refusal[0], code=refusal[1])
            if msg.tp_rank > 0:
                self.tp_parts.add(owner, msg)
                await self.send(identity, wire.RegisterAck(prefill_id=self.prefill_id, accepted=True, error=None,
                                                           written=[], ignored=[], decode_only_spec_dec=False,
                                                           abort_codes=True, prefix_writes=True))
                return
            parts = self.tp_parts.complete(owner, msg)
            plan = build_peer_plan(self.transport.layouts, parts, f"decode_id={msg.decode_id} agent={msg.agent_name}",
                                   self.transport.max_room_tokens)
            self._check_draft(msg, plan)
            agents = await self._connect_feeds(msg, plan)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # task boundary: refuse with the reason, keep serving
            await self._refuse(identity, msg, exc)
            return
        transport, keep = self.transport, msg.agent_name
        self.peers.install(DecodePeer(msg.decode_id, msg.agent_name, identity, owner, plan, [], tp_agents=agents,
                                      reads_cached_tokens=msg.reads_cached_tokens,
                                      on_release=lambda: transport.disconnect(agents, keep=keep, wait=False)))
        logger.info("decode_id=%s fed by %d WRITEs per room (prefill tp=%d page_size=%d, decode tp=%d "
                    "page_size=%d)", msg.decode_id, len(plan.tp.feeds), plan.tp.prefill_tp, plan.prefill.page_size,
                    plan.tp.decode_tp, plan.decode.page_size)
        await self._accept(identity, msg, plan)

    async def _connect_feeds(self, msg: wire.Register, plan: TpPeerPlan) -> dict[tuple[int, int], str]:
        old = self.peers.get(msg.decode_id)
        if old is not None and old.agent_name == msg.agent_name:
            if old.plan != plan:
                raise GeometryMismatchError(f"decode_id={msg.decode_id} registered again with another KV layout "
                                            f"under the same agent; a changed decode restarts under a new id")
            return old.tp_agents  # the same process again: its agents stay loaded
        if msg.decode_id in self._registering or len(self._registering) >= MAX_PENDING_REGISTERS:
            raise ProtocolError(f"prefill is busy with registrations ({len(self._registering)}); retry",
                                code=FailCode.OVERLOADED)

        def connect() -> dict[tuple[int, int], str]:
            if self.probe is not None:  # metadata that aborts a NIXL loader must not reach ours
                for rank, metadata in enumerate(plan.decode_metadata):
                    self.probe.check(metadata, peer=f"decode_id={msg.decode_id} rank {rank}")
            return self.transport.connect(plan)

        job = asyncio.get_running_loop().run_in_executor(self.executor, connect)
        self._registering[msg.decode_id] = job
        job.add_done_callback(lambda _: self._registering.pop(msg.decode_id, None))
        try:
            return await wait_for(asyncio.shield(job), self.register_timeout_s)
        except asyncio.TimeoutError:
            job.add_done_callback(lambda j: None if j.cancelled() or j.exception() is not None
                                  else self.transport.disconnect(j.result(), wait=False))
            self.metrics.timeouts.labels(stage="register").inc()
            raise ProtocolError(f"prefill could not add the NIXL agents of decode_id={msg.decode_id} within "
                                f"{self.register_timeout_s}s", code=FailCode.TIMEOUT) from None

    def _check_draft(self, msg: wire.Register, plan: TransferPlan) -> None:
        writes_draft = any(key[0] == "draft" for key in plan.written)
        if writes_draft and msg.draft_model and msg.draft_model != self.draft_model:
            raise GeometryMismatchError(f"draft model fingerprint mismatch: prefill has {self.draft_model!r}, "
                                        f"decode has {msg.draft_model!r}; serve the same --draft-model on both sides")

    def _connect(self, msg: wire.Register, plan: TransferPlan) -> list[ListPair]:
        """Executor: add the decode's agent and prepare one list pair per group."""
        if self.probe is not None:  # metadata that aborts a NIXL loader must not reach ours
            self.probe.check(msg.agent_metadata, peer=f"decode_id={msg.decode_id}")
        name = self.engine.add_peer(msg.agent_metadata)
        if name != msg.agent_name:
            if all(p.agent_name != name for p in self.peers.peers.values()):
                self.engine.remove_peer(name)
            raise ProtocolError(f"decode_id={msg.decode_id}: register names agent {msg.agent_name!r} but its NIXL "
                                f"metadata is for agent {name!r}")
        lists: list[ListPair] = []
        try:
            for group in plan.groups:
                lists.append(ListPair(self.engine.prep_local(group.prefill_descs(), group.prefill_mem),
                                      self.engine.prep_remote(name, group.decode_descs(), group.decode_mem)))
        except DisaggError:
            self._release_lists(lists, name)
            raise
        return lists

    def _discard(self, job: asyncio.Future) -> None:
        """A registration that timed out: undo what its job did once it ends."""
        if job.cancelled() or job.exception() is not None:
            return
        lists = job.result()
        name = lists[0].decode.peer if lists else None
        self._release_lists(lists, name)
        logger.info("registration of agent=%s finished after its deadline: agent and lists released", name)

    def _release_lists(self, lists: list[ListPair], agent: str | None) -> None:
        for pair in lists:
            for p in pair:
                try:
                    self.engine.release_prepped(p)
                except DisaggError as exc:
                    logger.warning("release of prepared list failed peer=%s: %s", agent, exc)
        if agent is not None and all(p.agent_name != agent for p in self.peers.peers.values()):
            try:
                self.engine.remove_peer(agent)
            except DisaggError as exc:
                logger.warning("remove of agent failed peer=%s: %s", agent, exc)

    async def _refuse(self, identity: bytes, msg: wire.Register, exc: Exception) -> None:
        """Refuse a register that failed with ``exc``: ours carry their reason and code; anything
        else is a defect, logged with its traceback."""
        if isinstance(exc, DisaggError):
            await self._reject(identity, msg, str(exc), exc.code)
            return
        logger.error("registration of decode_id=%s failed", msg.decode_id, exc_info=exc)
        await self._reject(identity, msg, f"prefill {self.prefill_id} failed to register it: "
                                          f"{type(exc).__name__}: {exc}", FailCode.OTHER)

    async def _reject(self, identity: bytes, msg: wire.Register, reason: str, code: FailCode) -> None:
        """Refuse a register. ``code`` tells the decode whether to remember the refusal (a layout or
        ownership refusal) or to try again with its next request (OVERLOADED, TIMEOUT)."""
        self.metrics.registrations.labels(result="rejected").inc()
        logger.warning("rejected registration of decode_id=%s peer=%s: %s", msg.decode_id, msg.agent_name, reason)
        await self.send(identity, wire.RegisterAck(prefill_id=self.prefill_id, accepted=False, error=reason,
                                                   written=[], ignored=[], decode_only_spec_dec=False,
                                                   code=code.value))
