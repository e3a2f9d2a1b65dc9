"""Small stand-ins for what the scheduler side's parts talk to, so they are tested without
vLLM and without a daemon: a ``SchedulerClient`` with a stock of tickets and lookups answered
by the test, vLLM requests as plain objects, a KV-cache manager, a ``SchedulerOutput`` and a
clock the test moves. The parts themselves are wired by ``build_parts``, as the role wires
them (``Rig``)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from kvpool.client.vllm.budgets import Budgets
from kvpool.client.vllm.keys import GroupInfo, RequestKeys
from kvpool.client.vllm.parts import Parts, RoleSettings, build_parts
from kvpool.client.vllm.requests import ReqState
from kvpool.shared.errors import DaemonUnavailable
from kvpool.shared.index_format import POOL

BT = 16
NS = b"ns-full"
GROUP = GroupInfo(index=0, namespace=NS, identity="test model", block_tokens=BT,
                  layer_names=("layer.0",), sliding_window=None)


class Clock:
    """The parts' clock, moved by the test (``now``): time passes only when it says so, so a
    budget of 0 is spent at once and any other never is."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def budgets(clock: Clock | None = None, **seconds: float) -> Budgets:
    """The default budgets with ``seconds`` overridden (``Budgets`` field names), read on
    ``clock`` (a new ``Clock`` if None)."""
    return dataclasses.replace(Budgets.from_config(), clock=clock or Clock(), **seconds)


class FakeCall:
    """A lookup in flight: ``result()`` is None until the test answers it."""

    def __init__(self, namespace: bytes, key_lists: list[list[bytes]]) -> None:
        self.namespace, self.key_lists = namespace, key_lists
        self.reply: Any = None
        self.error: Exception | None = None

    def answer(self, hits: list[int], slots: list[list[int]], leases: list[int]) -> None:
        self.reply = SimpleNamespace(hits=hits, slots=slots, leases=leases)

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.reply


class FakeClient:
    """A ``SchedulerClient`` as the parts use it: a stock of tickets per namespace (filled
    by the test), lookups answered by the test, and the no-wait sends recorded."""

    def __init__(self, tickets: int = 0, reserving: bool = True, up: bool = True) -> None:
        self.tickets: dict[bytes, list[int]] = {NS: list(range(100, 100 + tickets))}
        self.is_reserving = reserving
        self.up = up
        self.calls: list[FakeCall] = []
        self.taken: list[tuple[bytes, int]] = []
        self.released: list[list[int]] = []
        self.aborted: list[list[int]] = []
        self.resets: list[bytes] = []
        # The shared-memory index as ``find`` reads it: (namespace, key) -> (slot ref,
        # location); None: no usable index (lookups go to the daemon).
        self.index: dict[tuple[bytes, bytes], tuple[int, int]] | None = None
        self.reconnecting = False   # index_pending: the index is None only until connected
        self.finds = 0
        self.touches: list[tuple[bytes, list[bytes], int]] = []

    def _check(self) -> None:
        if not self.up:
            raise DaemonUnavailable("fake daemon down")

    def ready(self) -> bool:
        self._check()
        return True

    def poll(self, just_ready: bool = False) -> None:
        self._check()

    def keep_stock(self, namespace: bytes) -> None:
        self.tickets.setdefault(namespace, [])

    def stock(self, namespace: bytes) -> int:
        return len(self.tickets.get(namespace, ()))

    def reserving(self, namespace: bytes) -> bool:
        return self.is_reserving

    def take_slots(self, namespace: bytes, n: int) -> tuple[list[int], str]:
        self.taken.append((namespace, n))
        have = self.tickets.setdefault(namespace, [])
        out, have[:] = have[:n], have[n:]
        return out, "daemon-1"

    def lookup_start(self, namespace: bytes, key_lists: list[list[bytes]],
                     pin: bool = False) -> FakeCall:
        self._check()
        call = FakeCall(namespace, [list(k) for k in key_lists])
        self.calls.append(call)
        return call

    def find(self, namespace: bytes, hashes: list[bytes]
             ) -> tuple[int, list[int], list[int]] | None:
        if self.index is None:
            return None
        self.finds += 1
        refs, locs = [], []
        for h in hashes:
            got = self.index.get((namespace, h))
            if got is None:
                break
            refs.append(got[0] if got[1] == POOL else 0)
            locs.append(got[1])
        return len(refs), refs, locs

    def index_pending(self) -> bool:
        return self.reconnecting

    def find_each(self, namespace: bytes, hashes: list[bytes]) -> list[int] | None:
        if self.index is None:
            return None
        self.finds += 1
        refs = []
        for h in hashes:
            got = self.index.get((namespace, h))
            refs.append(-1 if got is None else got[0] if got[1] == POOL else 0)
        return refs

    def touch_nowait(self, namespace: bytes, hashes: list[bytes], missed_blocks: int) -> None:
        self._check()
        self.touches.append((namespace, list(hashes), missed_blocks))

    def release_nowait(self, leases: list[int]) -> None:
        self._check()
        self.released.append(list(leases))

    def abort_nowait(self, slots: list[int]) -> None:
        self._check()
        self.aborted.append(list(slots))

    def reset_nowait(self, namespace: bytes) -> None:
        self._check()
        self.resets.append(namespace)


def request(rid: str, tokens: list[int], computed: int = 0, prompt: int | None = None,
            **params: Any) -> SimpleNamespace:
    """What the parts read of a vLLM ``Request``."""
    return SimpleNamespace(request_id=rid, all_token_ids=list(tokens), num_tokens=len(tokens),
                           num_computed_tokens=computed,
                           num_prompt_tokens=len(tokens) if prompt is None else prompt,
                           cache_salt=None, lora_request=None, mm_features=None,
                           prompt_embeds=None, kv_transfer_params=params or None,
                           skip_reading_prefix_cache=False, block_hashes=[],
                           num_output_tokens=0)


def state(rig: "Rig", req: SimpleNamespace) -> ReqState:
    """``req`` admitted as the role admits a request vLLM adds."""
    return rig.requests.admit(req)


def keys(req: SimpleNamespace, start: int, stop: int) -> list[bytes]:
    """The pool keys of ``req``'s blocks [start, stop) in GROUP, computed afresh."""
    return RequestKeys(req, [GROUP]).range(req, 0, start, stop)


class FakeBlockPool:
    """vLLM's ``BlockPool`` as the planner asks it: the prefix cache, block hash -> GPU block
    id (one group), for a preempted request's blocks; its count of free blocks."""

    def __init__(self) -> None:
        self.cached: dict[Any, int] = {}
        self.free = 1000

    def get_num_free_blocks(self) -> int:
        return self.free

    def get_cached_block(self, block_hash: Any, group_ids: list[int]) -> list[Any] | None:
        bid = self.cached.get(block_hash)
        return None if bid is None else [SimpleNamespace(block_id=bid)] * len(group_ids)


class FakeManager:
    """vLLM's KV-cache manager as the planner reads it (no ``coordinator``: the public
    ``get_block_ids``)."""

    def __init__(self) -> None:
        self.tables: dict[str, list[int]] = {}
        self.block_pool = FakeBlockPool()

    def get_block_ids(self, rid: str) -> tuple[list[int], ...]:
        return (self.tables.get(rid, []),)


def step_output(new: dict[str, int] = {}, cached: dict[str, int] = {},  # noqa: B006
                preempted: tuple[str, ...] = ()) -> SimpleNamespace:
    """A ``SchedulerOutput``: ``new``/``cached`` map request ids to tokens scheduled (cached
    requests all got a new block); ``preempted``: ids vLLM preempted in this step."""
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=([],)) for r in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached),
                                              new_block_ids=[([1],)] * len(cached)),
        num_scheduled_tokens={**new, **cached}, scheduled_spec_decode_tokens={},
        total_num_scheduled_tokens=sum(new.values()) + sum(cached.values()),
        preempted_req_ids=set(preempted))


class Rig:
    """The scheduler side's parts as ``build_parts`` wires them (for the role too), for one
    full-attention group unless told, with the fakes they talk to: ``client``, a ``clock`` the
    test moves, vLLM's KV-cache ``manager``. A part is read as an attribute (``rig.planner``)."""

    def __init__(self, client: FakeClient | None = None, world_size: int = 1,
                 horizon_blocks: int = 0, groups: tuple = (GROUP,), **seconds: float) -> None:
        self.client = client if client is not None else FakeClient()
        self.clock = Clock()
        self.budgets = budgets(self.clock, **seconds)
        self.settings = RoleSettings(list(groups), self.budgets, world_size=world_size,
                                     events_enabled=False, horizon_blocks=horizon_blocks)
        self.parts: Parts = build_parts(self.client, self.settings)
        self.manager = FakeManager()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.parts, name)

    def plan(self, so: SimpleNamespace, preempted: list[ReqState] | tuple = ()) -> list:
        """One step's store planning, begun now; its specs."""
        return self.planner.plan(so, self.clock(), preempted, self.manager)[0]

    def cursor(self, rid: str) -> list[int]:
        return self.planner.cursor(rid).cursor
