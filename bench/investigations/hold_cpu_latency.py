"""Holds a CPU wake-up latency request until killed: Linux's PM QoS, /dev/cpu_dma_latency.

    python -m bench.investigations.hold_cpu_latency [--us 0]

While the file is open with a value written, the kernel keeps every CPU out of idle states
whose exit latency is above it (0: no deeper than polling). Run beside a benchmark, it shows how
much of a job's fixed cost is threads woken from deep idle: a big job's copy leaves the daemon
and its client asleep for ~40 ms, and libzmq wakes three threads per message (see
transport_floor.py). Prints whether the request is held; exits 0 either way, so that a run
that cannot hold it (no such file, no permission) goes on and says so.
"""

from __future__ import annotations

import argparse
import os
import signal
import struct


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--us", type=int, default=0, help="the latency allowed, microseconds")
    args = ap.parse_args()
    try:
        fd = os.open("/dev/cpu_dma_latency", os.O_WRONLY)
        os.write(fd, struct.pack("i", args.us))
    except OSError as e:
        print(f"[hold_cpu_latency] not held: {e}", flush=True)
        return
    print(f"[hold_cpu_latency] held at {args.us} us", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        signal.pause()


if __name__ == "__main__":
    main()
