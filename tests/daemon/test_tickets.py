"""Reservation tickets without a pool: refs, grants, per-owner bounds, spending, expiry."""

from kvpool.daemon.tickets import TicketRefs, Tickets

FIRST = 1 << 20          # the index of the first ticket ref: above every slot id
NS = b"n" * 16


def test_ticket_refs_lie_above_every_slot_id_and_never_repeat():
    refs = TicketRefs(FIRST)
    a, b = refs.take(10), refs.take(10)
    assert all(r & 0xFFFF_FFFF >= FIRST and 0 < r < 1 << 63 for r in list(a) + list(b))
    assert not set(a) & set(b) and refs.issued(a[0]) and refs.issued(b[-1])
    assert not refs.issued(b[-1] + 1) and not refs.issued(5)
    near_end = TicketRefs((1 << 32) - 8)             # a grant never splits across passes
    near_end.take(5)
    c = near_end.take(5)
    assert c[0] & 0xFFFF_FFFF == (1 << 32) - 8 and len(set(c)) == 5


def test_grants_are_bounded_per_owner_and_size_and_spent_once_per_grant():
    t = Tickets(FIRST)
    mine = t.grant(1, NS, 4096, 10, cap=12, deadline=5.0)
    assert len(mine) == 10 and len(t.grant(1, NS, 4096, 10, cap=12, deadline=5.0)) == 2
    assert t.grant(1, NS, 4096, 1, cap=12, deadline=5.0) == []
    assert len(t.grant(1, NS, 8192, 3, cap=12, deadline=5.0)) == 3   # another size
    assert len(t.grant(2, NS, 4096, 4, cap=12, deadline=9.0)) == 4   # another owner
    t.spend(mine[:4])
    assert t.held[(1, 4096)] == 8 and len(t) == 15
    assert t.abort(mine[4], 2) is False and t.abort(mine[4], 1) is True
    assert t.abort(mine[4], 1) is None                               # gone already
    assert t.expire(5.0) == 10 and t.held == {(2, 4096): 4}
    assert t.release_owner(2) == 4 and not t.held and not t.grants and len(t) == 0


def test_a_job_spending_tickets_of_several_grants_takes_each_grants_share():
    t = Tickets(FIRST)
    a = t.grant(1, NS, 4096, 3, cap=12, deadline=5.0)
    b = t.grant(1, NS, 4096, 3, cap=12, deadline=5.0)
    c = t.grant(2, NS, 4096, 2, cap=12, deadline=5.0)
    t.spend([a[0], b[0], a[1], c[0]])
    assert t.held == {(1, 4096): 3, (2, 4096): 1} and len(t) == 4
    t.spend([b[1], b[2]])                              # a grant spent to its end goes
    assert t.held == {(1, 4096): 1, (2, 4096): 1} and len(t) == 2 and len(t.grants) == 2
    assert t.expire(5.0) == 2 and not t.grants and not t.held
