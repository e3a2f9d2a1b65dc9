"""Lookups answered from the daemon's shared-memory index, in the scheduler's own process.

``SchedulerClient.find`` reads the index without a round trip: a request's hit is known in the
call that asks for it. This module asks it for one request's key ranges, one per group (a run
of leading hits; a state group's keys one by one, as ``hybrid.state_key_lists`` asks the
daemon), and folds what it finds into the answers ``lookups.py`` combines. Nothing is pinned:
a block evicted before its load fails that block alone (the daemon finds a stale ref's block
again by its key, which the load carries). A slot ref of 0 means a lower tier holds the block
(the daemon stages it): it counts as a hit, and its key is what the load names.

The hits read are the daemon's news too (they keep those blocks recent in its LRU, and count
as hits in its metrics): they are collected here and sent once per namespace per step
(``flush``), without waiting. None from ``answers`` means the index cannot be read (not
connected, another user, an older daemon): the caller asks the daemon instead.
"""

from __future__ import annotations

from typing import Any, Sequence

from kvpool.client.vllm.daemon_link import DaemonLink
from kvpool.client.vllm.hybrid import MISSING
from kvpool.client.vllm.pd_stream import Answer


class IndexReads:
    """Called from vLLM's scheduler thread only."""

    def __init__(self, groups: list[Any], client: Any, link: DaemonLink) -> None:
        self.groups = groups
        self._find = getattr(client, "find", None)
        self._find_each = getattr(client, "find_each", None)
        self._pending = getattr(client, "index_pending", None)
        self._touch_nowait = getattr(client, "touch_nowait", None)
        self._link = link
        # namespace -> (hit keys read this step, blocks looked up and missed)
        self._touches: dict[bytes, tuple[dict[bytes, None], list[int]]] = {}

    def answers(self, starts: Sequence[int], key_lists: Sequence[Sequence[bytes]]
                ) -> list[Answer] | None:
        """Per group ``g``: what the index holds of ``key_lists[g]`` (block ``starts[g]`` on),
        as (start, blocks, slot refs, no leases); None when there is no usable index."""
        find = self._find
        if find is None:
            return None
        out: list[Answer] = []
        read: list[tuple[bytes, Sequence[bytes], int]] = []
        for g, start, keys in zip(self.groups, starts, key_lists):
            if g.state:
                refs = self._find_each(g.namespace, keys) if keys else []
                if refs is None:
                    return None
                hits = [k for k, r in zip(keys, refs) if r != MISSING]
                out.append((start, len(keys), refs, []))
                read.append((g.namespace, hits, len(keys) - len(hits)))
                continue
            got = find(g.namespace, keys)
            if got is None:
                return None
            n = got[0]
            out.append((start, n, list(got[1][:n]), []))
            read.append((g.namespace, keys[:n], len(keys) - n))
        for namespace, hits, missed in read:
            seen, misses = self._touches.setdefault(namespace, ({}, [0]))
            seen.update(dict.fromkeys(hits))
            misses[0] += missed
        return out

    def pending(self) -> bool:
        """``answers`` gave None only because the connection is being (re)made: the index
        can be read in a step or two."""
        return self._find is not None and self._pending is not None and self._pending()

    def flush(self) -> None:
        """The step's touches: one message per namespace (hits read, misses counted)."""
        if not self._touches:
            return
        touches, self._touches = self._touches, {}
        if self._touch_nowait is None or not self._link.ok():
            return
        for namespace, (seen, misses) in touches.items():
            if seen or misses[0]:
                self._link.nowait(self._touch_nowait, namespace, list(seen), misses[0])


def behind_commits(groups: list[Any], committed: Any, answers: list[Answer],
                   lists: list[list[bytes]]) -> bool:
    """The index misses a key this engine's stores committed (``committed``: per group, its
    keys): the daemon may not have taken that commit in yet (a round trip is ordered after
    it), or has evicted it since (the round trip's miss then forgets it)."""
    for gi, (_, hit, refs, _) in enumerate(answers):
        ours = committed[gi]
        if not ours:
            continue
        if groups[gi].state:
            if any(r == MISSING and k in ours for k, r in zip(lists[gi], refs)):
                return True
        elif hit < len(lists[gi]) and lists[gi][hit] in ours:
            return True
    return False
