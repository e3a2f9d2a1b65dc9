"""The NUMA placement plan, from a fake /sys: which GPU sits on which node, which ranges of the
pool go where, which CPUs each GPU's copy threads take; and that applying it degrades loudly."""

import logging
import mmap
import os
import threading

import pytest
from kvpool.daemon import numa

EXTENT = 256 << 20
DATA = 8 << 20            # the pool's tables before its first extent


def fake_sys(root, nodes: dict[int, str], gpus: dict[str, int]):
    for n, cpus in nodes.items():
        d = root / "devices/system/node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
    for bus, node in gpus.items():
        d = root / "bus/pci/devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


# a two-socket host: GPUs 0-3 on node 0, 4-7 on node 1 (their PCI ids as the driver gives them)
BUSES = {g: f"0000:{0x18 + 0x10 * g:02x}:00.0" for g in range(8)}


@pytest.fixture
def two_sockets(tmp_path):
    fake_sys(tmp_path, {0: "0-15,32-47", 1: "16-31,48-63"},
             {BUSES[g].lower(): 0 if g < 4 else 1 for g in range(8)})
    return numa.read_topology({g: BUSES[g].upper() for g in range(8)}, tmp_path)


def test_the_topology_is_read_from_sys(two_sockets, tmp_path):
    t = two_sockets
    assert t.nodes[0] == frozenset(range(16)) | frozenset(range(32, 48))
    assert t.gpu_nodes == {g: 0 if g < 4 else 1 for g in range(8)}
    # a GPU /sys does not know (no numa_node file, or -1 on a host without NUMA info)
    assert numa.read_topology({0: "0000:99:00.0"}, tmp_path).gpu_nodes == {0: -1}


def test_local_puts_each_gpus_share_of_whole_extents_on_its_node(two_sockets):
    p = numa.plan(two_sockets, DATA, 64, EXTENT, "local")
    assert p.mode == "local"
    # eight equal shares of 8 extents, in GPU order (node 0's first), covering the data area
    assert p.gpu_extents == {g: (8 * g, 8 * g + 8) for g in range(8)}
    # one range per node: the shares of a node's GPUs are side by side and merge
    assert p.ranges == (numa.Range(DATA, DATA + 32 * EXTENT, (0,)),
                        numa.Range(DATA + 32 * EXTENT, DATA + 64 * EXTENT, (1,)))
    assert p.thread_cpus[2] == two_sockets.nodes[0] and p.thread_cpus[6] == two_sockets.nodes[1]


def test_auto_interleaves_over_the_gpus_nodes_and_still_places_threads(two_sockets):
    for mode in ("auto", "interleave"):
        p = numa.plan(two_sockets, DATA, 64, EXTENT, mode)
        assert p.mode == "interleave" and p.gpu_extents == {}
        assert p.ranges == (numa.Range(DATA, DATA + 64 * EXTENT, (0, 1)),)
        assert all(p.thread_cpus[g] == two_sockets.nodes[g // 4] for g in range(8))


def test_gpus_interleaved_in_ordinal_order_across_nodes_get_node_sorted_shares(tmp_path):
    fake_sys(tmp_path, {0: "0-3", 1: "4-7"}, {"0000:01:00.0": 1, "0000:02:00.0": 0,
                                               "0000:03:00.0": 1})
    t = numa.read_topology({0: "0000:01:00.0", 1: "0000:02:00.0", 2: "0000:03:00.0"}, tmp_path)
    p = numa.plan(t, DATA, 10, EXTENT, "local")
    # GPU 1 (node 0) first, then GPUs 0 and 2 (node 1) side by side; 10 extents: 3, 3, 4
    assert p.gpu_extents == {1: (0, 3), 0: (3, 6), 2: (6, 10)}
    assert [r.nodes for r in p.ranges] == [(0,), (1,)]
    assert p.ranges[0].end == p.ranges[1].start == DATA + 3 * EXTENT


def test_a_gpu_of_unknown_node_gets_an_interleaved_share_and_no_pinned_threads(tmp_path):
    fake_sys(tmp_path, {0: "0-3", 1: "4-7"}, {"0000:01:00.0": 0, "0000:02:00.0": -1})
    t = numa.read_topology({0: "0000:01:00.0", 1: "0000:02:00.0"}, tmp_path)
    p = numa.plan(t, 0, 4, EXTENT, "local")
    # GPU 1's node is unknown: its share is spread over every node, its threads left alone
    assert p.ranges == (numa.Range(0, 2 * EXTENT, (0,)), numa.Range(2 * EXTENT, 4 * EXTENT, (0, 1)))
    assert 1 not in p.thread_cpus and p.thread_cpus[0] == frozenset(range(4))


@pytest.mark.parametrize("nodes, gpus, mode, why", [
    ({0: "0-7"}, {"0000:01:00.0": 0}, "auto", "1 NUMA node"),
    ({0: "0-3", 1: ""}, {"0000:01:00.0": 0}, "local", "1 NUMA node"),   # a CPU-less node
    ({0: "0-3", 1: "4-7"}, {}, "auto", "no GPU"),
    ({0: "0-3", 1: "4-7"}, {"0000:01:00.0": 0}, "off", "numa_policy off"),
])
def test_nothing_is_placed_where_there_is_nothing_to_place(tmp_path, nodes, gpus, mode, why):
    fake_sys(tmp_path, nodes, gpus)
    t = numa.read_topology({i: b for i, b in enumerate(gpus)}, tmp_path)
    p = numa.plan(t, DATA, 16, EXTENT, mode)
    assert p.mode == "off" and p.ranges == () and p.thread_cpus == {} and why in p.why


def test_fewer_extents_than_gpus_interleave_instead_of_empty_shares(two_sockets):
    p = numa.plan(two_sockets, DATA, 5, EXTENT, "local")
    assert p.mode == "interleave" and p.ranges == (numa.Range(DATA, DATA + 5 * EXTENT, (0, 1)),)


def test_the_plan_is_reported_as_json_ready_values(two_sockets):
    d = numa.plan(two_sockets, DATA, 64, EXTENT, "local").as_dict()
    assert d["mode"] == "local" and d["thread_cpus"]["0"] == "0-15,32-47"
    assert d["gpu_extents"]["7"] == [56, 64] and d["ranges"][1][2] == [1]


def test_the_cpulist_round_trips():
    assert numa.parse_cpulist("0-3,8,10-11\n") == frozenset({0, 1, 2, 3, 8, 10, 11})
    assert numa.format_cpulist(frozenset({0, 1, 2, 3, 8, 10, 11})) == "0-3,8,10-11"


def test_applying_to_this_host_binds_a_mapping_or_warns_and_goes_on(caplog):
    """On node 0 of this host (every Linux host has one), a preferred-node range and an
    interleaved one take, or the kernel's refusal is a warning, never an exception."""
    buf = mmap.mmap(-1, 4 * mmap.PAGESIZE)
    import ctypes
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    p = numa.Placement("local", (numa.Range(0, 2 * mmap.PAGESIZE, (0,)),
                                 numa.Range(2 * mmap.PAGESIZE, 4 * mmap.PAGESIZE, (0,))))
    with caplog.at_level(logging.WARNING, logger="kvpoold"):
        ok = numa.apply_memory(p, base)
    assert ok or "could not place the pool" in caplog.text
    bad = numa.Placement("local", (numa.Range(0, mmap.PAGESIZE, (63,)),))   # no such node
    with caplog.at_level(logging.WARNING, logger="kvpoold"):
        assert not numa.apply_memory(bad, base)
    assert "could not place the pool" in caplog.text


def test_a_thread_is_pinned_to_its_gpus_cpus_or_warned_about():
    mine = os.sched_getaffinity(0)
    seen = {}

    def run(cpus):
        numa.pin_thread(cpus, "a copy thread")
        seen[cpus] = os.sched_getaffinity(0)
    one = frozenset({min(mine)})
    t = threading.Thread(target=run, args=(one,))
    t.start()
    t.join()
    assert seen[one] == one and os.sched_getaffinity(0) == mine    # only that thread moved
    numa.pin_thread(None, "a copy thread")                          # nothing asked: nothing done
    assert os.sched_getaffinity(0) == mine
