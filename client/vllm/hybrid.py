"""The all-or-none hit rule of a model with several KV-cache groups, and the lookups it needs.

A hit of ``h`` blocks lets vLLM resume a request at token ``h * block_tokens``: every group must
then hold what vLLM reads from there on, or the request resumes with a hole (attention blocks
restored without the recurrent state garble the output; a state without the attention before
it, the same). Per group kind (``GroupInfo.kind``):

- full attention: its blocks ``[0, h)``;
- sliding window: the blocks the window reaches before ``h`` (``window_blocks`` of them);
- recurrent state: the state in block ``h - 1``, which vLLM keeps only at some boundaries.

``resume_blocks`` is that rule as a pure function: the longest ``h`` at which every group has
what it needs, else 0 (or "ask the windows again at ``h``", once: a window is looked up where
the hit was expected to end). Hits are whole blocks and never the prompt's last token: vLLM
recomputes at least one token, so the caller's target is ``(num_tokens - 1) // block_tokens``
blocks at most, the rounding vLLM applies to its own prefix-cache hits of such models.

A state group's keys are looked up one by one (``state_key_lists``): its states are sparse, so
the run of leading hits that an attention lookup returns would stop at the first boundary vLLM
did not keep. ``merge_state_answer`` folds the per-key answers back into one per request, with
``MISSING`` where the pool holds nothing, and ``keep_resume_lease`` keeps the one lease a load
at ``h`` uses. Plain functions over plain data: no daemon, no vLLM (``state_block_ids``
reads vLLM's block tables and prefix cache, handed to it: which GPU block holds a state to
store).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

MISSING = -1        # a state group's slot ref where the pool holds no state


@dataclass(frozen=True, slots=True)
class GroupAnswer:
    """What one lookup found for one group of one request: blocks ``[start, end)`` were asked
    for; ``slots[k]`` is block ``start + k``'s slot ref, or ``MISSING``. A run lookup's answer
    has no ``MISSING`` and stops at its first miss (``len(slots)`` blocks held)."""

    start: int
    end: int
    slots: Sequence[int]

    def holds(self, block: int) -> bool:
        k = block - self.start
        return 0 <= k < len(self.slots) and self.slots[k] != MISSING

    def holds_all(self, lo: int, hi: int) -> bool:
        return all(map(self.holds, range(lo, hi)))

    def asked(self, lo: int, hi: int) -> bool:
        return self.start <= lo and hi <= self.end


@dataclass(frozen=True, slots=True)
class Resume:
    """``resume_blocks``'s answer: a hit of ``blocks`` (0: none), or, when ``ask_again_at``,
    no answer yet: look the request up again with that target."""

    blocks: int
    ask_again_at: int = 0


def resume_blocks(kinds: Sequence[str], window_blocks: Sequence[int | None],
                  answers: Sequence[GroupAnswer], target: int, retried: bool) -> Resume:
    """The longest prefix, in blocks, at which every group has what vLLM needs to resume (see
    the module docstring), at most ``target``; 0 when there is none.

    ``kinds[g]`` is "full", "window" or "state" and ``window_blocks[g]`` a window group's
    blocks; ``answers[g]`` what group ``g``'s lookup found. A window asked for somewhere else
    than the best ``h`` the other groups allow gives ``Resume(0, h)`` (ask again there) unless
    ``retried`` (then 0: never a hit whose window nobody checked).
    """
    cap = target
    for kind, a in zip(kinds, answers):
        if kind == "full":
            cap = min(cap, len(a.slots) if a.start == 0 else 0)
    states = [a for kind, a in zip(kinds, answers) if kind == "state"]
    windows = [(w, a) for kind, w, a in zip(kinds, window_blocks, answers) if kind == "window"]
    for h in range(cap, 0, -1):
        if not all(a.holds(h - 1) for a in states):
            continue
        for w, a in windows:
            lo = max(0, h - w)
            if not a.asked(lo, h):
                return Resume(0) if retried else Resume(0, h)
            if not a.holds_all(lo, h):
                break
        else:
            return Resume(h)
    return Resume(0)


def state_key_lists(keys: Sequence[bytes]) -> list[list[bytes]]:
    """A state group's lookup lists for one request: one key per list, so each answers on its
    own (a run lookup would stop at the first boundary without a kept state)."""
    return [[k] for k in keys]


def merge_state_answer(hits: Sequence[int], slots: Sequence[Sequence[int]],
                       leases: Sequence[int]) -> tuple[list[int], list[int]]:
    """One request's per-key replies (``state_key_lists``) as (slot ref or ``MISSING`` per
    block, lease or 0 per block)."""
    refs = [s[0] if n else MISSING for n, s in zip(hits, slots)]
    return refs, [lease if n else 0 for n, lease in zip(hits, leases)]


def keep_resume_lease(start: int, leases: Sequence[int], blocks: int) -> tuple[int, list[int]]:
    """(the lease of the state a hit of ``blocks`` loads, 0 if none; the others, to release)."""
    k = blocks - 1 - start
    keep = leases[k] if blocks and 0 <= k < len(leases) else 0
    return keep, [x for x in leases if x and x != keep]


def state_block_ids(req: Any, manager: Any, tables: list[dict[str, list[Any]]] | None,
                    group: int, lo: int, hi: int, block_tokens: int) -> list[int]:
    """The GPU blocks holding the states of ``req``'s blocks ``[lo, hi)`` in vLLM state group
    ``group`` (0 where vLLM kept none): the request's table where it still holds one
    (``tables``: the step's, else ``manager``'s), else the block vLLM's prefix cache holds
    under that block's hash. In align mode vLLM frees a state block once the next state is
    computed (``remove_skipped_blocks``), often before a decode's store is planned; it stays in
    the prefix cache until handed out again (a store reading it then is flushed first:
    ``StoreBatches.reading``). vLLM 0.32 hashes a block a step after it fills, 0.33 in the
    step: either way a non-null table entry or a hash hit holds the state its prefix ends
    with."""
    if tables is not None:
        row = tables[group].get(req.request_id) or ()
        ids = [b.block_id for b in row[lo:hi]]
    else:
        ids = manager.get_block_ids(req.request_id)[group][lo:hi]
    ids += [0] * (hi - lo - len(ids))
    hashes = req.block_hashes
    if 0 not in ids or len(hashes) != req.num_tokens // block_tokens:
        return ids      # (hashed at another granularity: nothing to match)
    pool = manager.block_pool
    for j, b in enumerate(ids):
        if not b:
            hit = pool.get_cached_block(hashes[lo + j], [group])
            ids[j] = hit[0].block_id if hit else 0
    return ids
