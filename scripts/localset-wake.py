#!/usr/bin/env python3
# shm without spin, a handler: loops on the LocalSet (default) against the runtime's queue,
# with and without --pin; the children's context switches and CPU time per round trip.
import os, resource, subprocess, re, sys
# Run: python3 scripts/localset-wake.py [RUNS] with ACTORPIPE_BIN naming the binary (default
# target/release/actorpipe).
ap = os.environ.get("ACTORPIPE_BIN", "target/release/actorpipe")
N = 20000
def run(env_rt, pin):
    env = dict(os.environ)
    if env_rt: env["ACTORPIPE_LOOPS_ON_RUNTIME"] = "1"
    args = [ap, "bench", "transport", "--backend", "shm", "--sizes", "64", "--iters", str(N),
            "--rounds", "1", "--warmup", "2000", "--api", "handler"] + (["--pin"] if pin else [])
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(args, env=env, capture_output=True, text=True).stdout
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    row = [l for l in out.splitlines() if l.startswith("| 64 B")]
    per = lambda a, b: (b - a) / (N * 1.1)
    return (row[0] if row else out[-300:],
            per(r0.ru_nvcsw, r1.ru_nvcsw), per(r0.ru_nivcsw, r1.ru_nivcsw),
            (r1.ru_utime - r0.ru_utime) / (N * 1.1) * 1e6, (r1.ru_stime - r0.ru_stime) / (N * 1.1) * 1e6)
print("# cores", os.cpu_count())
for k in range(int(sys.argv[1]) if len(sys.argv) > 1 else 3):
    for pin in (False, True):
        for rt in ((False, True) if k % 2 == 0 else (True, False)):
            row, vcs, ivcs, ut, st = run(rt, pin)
            print(f"### {'runtime' if rt else 'localset'} pin={pin} run {k+1}: vcsw/rt {vcs:.2f} ivcsw/rt {ivcs:.3f} user {ut:.2f} us/rt sys {st:.2f} us/rt")
            print(row)
