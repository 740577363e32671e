#!/usr/bin/env python3
"""Prints round trips of a traced `bench efa` run as timelines (docs/efa-measurements.md, "An
in-place tensor without the channel actor").

Build with scripts/efa-trace.patch (`bash scripts/build-patched.sh scripts/efa-trace.patch DIR
trace`), run one row with AP_TRACE=FILE, for example
`AP_TRACE=/tmp/t.txt DIR/trace bench efa --providers shm --sizes 64 --iters 3000 --rounds 1
--rows in-place --api handler`, then: python3 scripts/efa-trace.py FILE [--spin]
(two round trips from the middle of the run; --spin also shows the spin task's CQ passes).
Times are µs from the pinger's `fire`; the second column is the thread.
"""
import sys

NAMES = {
    1: "channel actor: RecvTensor", 2: "channel actor: SendTensor", 3: "efa end handled",
    4: "pipe: Done", 5: "CQ completion", 7: "spinning reader: end", 8: "post of regions",
    9: "echo: handler", 10: "pinger: read", 11: "pinger: wrote", 12: "pinger: fire",
    13: "pipe: tensor to receive", 14: "pipe: tensor to send", 15: "spin pass",
    16: "spin pass skipped", 17: "reader pass", 18: "efa stream: message in",
    19: "read loop: frame to the pipe",
}


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    spin = "--spin" in sys.argv
    events = [tuple(map(int, line.split())) for line in open(args[0])]
    fires = [i for i, e in enumerate(events) if e[0] == 12]
    if len(fires) < 10:
        sys.exit("too few round trips in the trace")
    for k in (len(fires) // 2, len(fires) // 2 + 7):
        t0 = events[fires[k]][2]
        for code, tid, t in events[fires[k]:fires[k + 1]]:
            if code in (15, 16, 17) and not spin:
                continue
            print(f"{(t - t0) / 1000:8.2f}  {tid}  {NAMES.get(code, code)}")
        print()


if __name__ == "__main__":
    main()
