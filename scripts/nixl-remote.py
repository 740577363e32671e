#!/usr/bin/env python3
"""Measures NVIDIA NIXL's one-sided READ and WRITE between two processes of one host, for
side-by-side comparison with `actorpipe bench remote --backend cuda_ipc`.

What it measures: a target process (this script again, started with multiprocessing's 'spawn')
creates a NIXL agent with the UCX backend, allocates a region of 2 x the largest size (a torch
tensor on cuda:0, or host memory with --device cpu), fills it with a known pattern, registers it
and hands its agent metadata and the region's address to this process over a pipe. This process
(the initiator) creates its own agent, registers a local buffer of the largest size on the same
device, loads the target's metadata, and for each size and span count measures READ (region to
local buffer) and then WRITE (local buffer to region). With N spans the size is cut into N pieces
of size/N bytes: piece i lies at offset 2*i*piece of the region (stride 2 x piece) and at offset
i*piece of the local buffer, as in `actorpipe bench remote`.

Each row prepares its descriptor lists once (prep_xfer_dlist, both sides) and its transfer
handle once (make_prepped_xfer), then re-posts that handle for every operation: NIXL's intended
fast path (--handle per-op makes a handle per operation instead, inside the timed span). An
operation is timed from transfer() (the post) until check_xfer_state() says DONE, polled in a
busy loop; a row's time is the median of --iters operations after 3 warm-ups. The data is
checked: the local buffer is cleared before the last READ and compared with the region's
pattern after it; the local buffer gets a new pattern before the last WRITE, and the target
compares the first and last spans of its region with it (then restores its pattern).

Run on the GPU machine (CUDA 13, PyTorch in the system Python 3.12, no internet), from the
repository root, with the wheel in .dev/wheels (git-ignored: carry it there):

    python3 -m venv --system-site-packages /tmp/nixl-venv
    /tmp/nixl-venv/bin/pip install --no-deps \\
        .dev/wheels/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl
    /tmp/nixl-venv/bin/python scripts/nixl-remote.py --device cuda --sizes 4K,1M,64M,1G --batch 1,64

--system-site-packages lets the venv see the system's torch and numpy (the wheel's declared
dependencies, hence --no-deps). Without a GPU, `--device cpu` runs the same over host memory
(numpy; UCX picks shared memory or TCP). To see which UCX transport carried the bytes, set
UCX_PROTO_INFO=y (UCX prints its protocol choices on stderr); UCX_*, NIXL_*, CUDA_* and
PYTORCH_* variables set in the environment are shown in the header's command line.

Options: --device cuda|cpu (cuda), --sizes LIST (4K,1M,64M,1G; K, M, G are binary), --batch
LIST of span counts (1,64), --iters N (by default 200 per row up to 64 MiB, 20 above),
--handle reuse|per-op (reuse), --progress-thread on|off (the initiator's, on: NIXL's
default; the target's is always on, as it must answer UCX's connection setup).

Exit status: 0 when every row ran and its bytes checked out, 1 on any failure (the message on
stderr), 2 for bad arguments. The process ends with os._exit once it has cleaned up: the
wheel's bundled libnl-route crashes (SIGSEGV in rtnl_tc_unregister) in its exit-time
destructor once UCX has been loaded, which would turn every run's status into 139.
"""

import argparse
import importlib.metadata
import logging
import multiprocessing
import os
import shlex
import socket
import statistics
import sys
import time
import traceback

WARMUP = 3
# Pattern salts: the region's own bytes, the local buffer's during WRITE, and before the last one.
SALT_REGION = 0x00
SALT_WRITE = 0x5A
SALT_LAST_WRITE = 0xA7
# How long one operation may take before the run is called stuck.
OP_TIMEOUT_S = 60.0
# How long the target may take to start (imports, CUDA context, filling its region).
START_TIMEOUT_S = 300.0
# How long the target may take to answer a check or to leave.
REPLY_TIMEOUT_S = 120.0
# Elements per chunk when filling or comparing a pattern (bounds the temporary index arrays).
CHUNK = 1 << 24


class Failure(Exception):
    """A failure with a message for the user (no traceback needed)."""


# --------------------------------------------------------------------------------------------
# Arguments


def parse_size(text):
    """`64`, `4K`, `1M`, `1G` (binary; `B`, `KB`, `KiB`, ... accepted too) as bytes."""
    t = text.strip()
    digits = len(t) - len(t.lstrip("0123456789"))
    number, suffix = t[:digits], t[digits:].upper()
    shifts = {"": 0, "B": 0, "K": 10, "KB": 10, "KIB": 10, "M": 20, "MB": 20, "MIB": 20,
              "G": 30, "GB": 30, "GIB": 30}
    if not number or suffix not in shifts:
        raise argparse.ArgumentTypeError(
            f"bad size {text!r}: expected a number like 64, 4K, 1M or 1G (binary units)")
    size = int(number) << shifts[suffix]
    if size < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}: sizes start at 1 byte")
    return size


def parse_sizes(text):
    return [parse_size(part) for part in text.split(",")]


def parse_counts(text):
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"bad span counts {text!r}: expected a list like 1,64")
    if any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(f"bad span counts {text!r}: counts start at 1")
    return counts


def parse_args(argv):
    p = argparse.ArgumentParser(
        prog="nixl-remote.py",
        description="NIXL one-sided READ/WRITE between two processes of one host (UCX backend).")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where the region and the local buffer live: cuda:0, or host memory")
    p.add_argument("--sizes", type=parse_sizes, default=parse_sizes("4K,1M,64M,1G"),
                   metavar="LIST",
                   help="bytes per operation, comma-separated, K/M/G binary (default 4K,1M,64M,1G)")
    p.add_argument("--batch", type=parse_counts, default=[1, 64], metavar="LIST",
                   help="spans per operation, comma-separated (default 1,64)")
    p.add_argument("--iters", type=int, default=None, metavar="N",
                   help="timed operations per row (default 200 up to 64 MiB, 20 above)")
    p.add_argument("--handle", choices=["reuse", "per-op"], default="reuse",
                   help="reuse: one prepared handle per row, re-posted (default); "
                        "per-op: make_prepped_xfer inside every timed operation")
    p.add_argument("--progress-thread", choices=["on", "off"], default="on",
                   help="the initiator's NIXL progress thread (default on, NIXL's default); "
                        "the target's is always on")
    args = p.parse_args(argv)
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be at least 1")
    for size in args.sizes:
        for spans in args.batch:
            if size % spans:
                p.error(f"size {human_size(size)} is not a multiple of {spans} spans")
    return args


def iters_for(args, size):
    if args.iters is not None:
        return args.iters
    return 200 if size <= 64 << 20 else 20


# --------------------------------------------------------------------------------------------
# Formatting


def human_size(n):
    for unit, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= unit:
            return f"{n // unit} {name}" if n % unit == 0 else f"{n / unit:.1f} {name}"
    return f"{n} B"


def command_line():
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k.startswith(("UCX_", "NIXL_", "CUDA_", "PYTORCH_"))]
    return " ".join(env + ["python3"] + [shlex.quote(a) for a in sys.argv])


def machine(device):
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    text = f"{socket.gethostname()} ({os.cpu_count()}-core {model}"
    if device == "cuda":
        import torch
        text += f", {torch.cuda.get_device_name(0)}"
    return text + ")"


def emit(line=""):
    print(line, flush=True)


# --------------------------------------------------------------------------------------------
# NIXL


def import_nixl():
    """The NIXL Python API module and its distribution's name and version."""
    for module, dist in (("nixl_cu13._api", "nixl-cu13"), ("nixl._api", "nixl")):
        try:
            api = importlib.import_module(module)
        except ImportError:
            continue
        try:
            version = f"{dist} {importlib.metadata.version(dist)}"
        except importlib.metadata.PackageNotFoundError:
            version = f"{dist} (version unknown)"
        # The API logs every agent and backend creation at INFO on stdout; keep the table clean.
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return api, module, version
    raise Failure(
        "cannot import NIXL (nixl_cu13._api or nixl._api): install the wheel into this Python, "
        "e.g. pip install --no-deps "
        ".dev/wheels/nixl_cu13-1.5.1-cp312-cp312-manylinux_2_28_x86_64.whl")


def new_agent(api, name, progress_thread):
    config = api.nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
    agent = api.nixl_agent(name, config)
    if "UCX" not in agent.backends:
        raise Failure(f"NIXL agent {name!r} has no UCX backend "
                      f"(plugins available: {agent.get_plugin_list()})")
    return agent


# --------------------------------------------------------------------------------------------
# Memory: a byte buffer on cuda:0 (torch) or in host memory (numpy), and its pattern


class Memory:
    """`nbytes` bytes on the device; `addr`, `dev_id` and `mem_type` describe them to NIXL."""

    def __init__(self, device, nbytes):
        self.device = device
        self.nbytes = nbytes
        if device == "cuda":
            try:
                import torch
            except ImportError as e:
                raise Failure(f"--device cuda needs torch ({e}); make the venv with "
                              "--system-site-packages so that it sees the system's torch")
            if not torch.cuda.is_available():
                raise Failure("--device cuda: torch sees no CUDA device (try --device cpu)")
            self.xp = torch
            self.buf = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
            self.addr = self.buf.data_ptr()
            self.mem_type = "VRAM"
        else:
            import numpy
            self.xp = numpy
            self.buf = numpy.empty(nbytes, dtype=numpy.uint8)
            self.addr = self.buf.ctypes.data
            self.mem_type = "DRAM"
        self.dev_id = 0

    def pattern(self, start, n, salt):
        """Byte k of the pattern is a function of `start + k` (its offset in the region)."""
        if self.device == "cuda":
            idx = self.xp.arange(start, start + n, dtype=self.xp.int64, device=self.buf.device)
            return ((idx % 251) ^ ((idx // 251) & 0xFF) ^ salt).to(self.xp.uint8)
        idx = self.xp.arange(start, start + n, dtype=self.xp.int64)
        return ((idx % 251) ^ ((idx // 251) & 0xFF) ^ salt).astype(self.xp.uint8)

    def fill(self, lo, n, start, salt):
        """Bytes [lo, lo + n) := the pattern from offset `start`."""
        for k in range(0, n, CHUNK):
            m = min(CHUNK, n - k)
            self.buf[lo + k:lo + k + m] = self.pattern(start + k, m, salt)
        self.sync()

    def matches(self, lo, n, start, salt):
        """Whether bytes [lo, lo + n) hold the pattern from offset `start`."""
        for k in range(0, n, CHUNK):
            m = min(CHUNK, n - k)
            got = self.buf[lo + k:lo + k + m]
            want = self.pattern(start + k, m, salt)
            same = self.xp.equal(got, want) if self.device == "cuda" else (got == want).all()
            if not same:
                return False
        return True

    def zero(self):
        self.buf[:] = 0
        self.sync()

    def sync(self):
        if self.device == "cuda":
            self.xp.cuda.synchronize()

    def reg_list(self):
        return [(self.addr, self.nbytes, self.dev_id, "")]


# --------------------------------------------------------------------------------------------
# The target process


def target_main(conn, device, region_len):
    """Owns the region. Messages from the initiator:
    ("check", [(lo, n, start, salt), ...], restore_len) -> ("ok",) or ("bad", what), after which
    bytes [0, restore_len) hold the region's pattern again; ("quit",) -> ("bye",), then exit."""
    code = 0
    try:
        api, _, _ = import_nixl()
        # The device memory (and so the CUDA context) before the agent, so UCX finds CUDA.
        region = Memory(device, region_len)
        region.fill(0, region_len, 0, SALT_REGION)
        # Its progress thread stays on whatever --progress-thread says: this process waits on
        # the pipe, and without the thread nobody answers UCX's connection setup (which goes
        # over active messages even where the bytes then move one-sided).
        agent = new_agent(api, "nixl-remote-target", progress_thread=True)
        reg = agent.register_memory(region.reg_list(), region.mem_type)
        conn.send(("ready", agent.get_agent_metadata(),
                   (region.addr, region.nbytes, region.dev_id, region.mem_type)))
        while True:
            msg = conn.recv()
            if msg[0] == "check":
                _, checks, restore_len = msg
                bad = [f"region bytes [{lo}, {lo + n})" for lo, n, start, salt in checks
                       if not region.matches(lo, n, start, salt)]
                region.fill(0, restore_len, 0, SALT_REGION)
                conn.send(("bad", ", ".join(bad)) if bad else ("ok",))
            elif msg[0] == "quit":
                agent.deregister_memory(reg)
                conn.send(("bye",))
                break
            else:
                raise Failure(f"target: unknown message {msg[0]!r}")
    except EOFError:
        code = 1  # The initiator is gone; nothing to tell it.
    except BaseException:
        code = 1
        try:
            conn.send(("error", traceback.format_exc()))
        except Exception:
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # Not sys.exit: see the module's docstring (libnl-route at exit).


class Target:
    """The target process and its end of the pipe."""

    def __init__(self, device, region_len):
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target_main, name="nixl-remote-target",
                                args=(child, device, region_len), daemon=True)
        self.proc.start()
        child.close()

    def recv(self, timeout, what):
        deadline = time.monotonic() + timeout
        while not self.conn.poll(0.05):
            if not self.proc.is_alive():
                if self.conn.poll(0):  # It may have written its error before dying.
                    break
                raise Failure(f"target process died (exit code {self.proc.exitcode}) "
                              f"while {what}")
            if time.monotonic() > deadline:
                raise Failure(f"target process gave no answer in {timeout:.0f} s while {what}")
        try:
            msg = self.conn.recv()
        except EOFError:
            raise Failure(f"target process closed its pipe while {what}")
        if msg[0] == "error":
            raise Failure(f"target process failed while {what}:\n{msg[1]}")
        return msg

    def call(self, msg, what):
        self.conn.send(msg)
        return self.recv(REPLY_TIMEOUT_S, what)

    def stop(self):
        """Ask it to leave; end it if it does not (best effort, never raises)."""
        try:
            if self.proc.is_alive():
                self.call(("quit",), "leaving")
        except Exception as e:
            print(f"nixl-remote: target did not leave cleanly: {e}", file=sys.stderr)
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


# --------------------------------------------------------------------------------------------
# The initiator


class Row:
    """One (op, size, spans) measurement: its prepared lists and handle, released by close()."""

    def __init__(self, agent, remote_name, op, size, spans, local, remote, per_op):
        self.agent, self.op, self.per_op = agent, op, per_op
        piece = size // spans
        r_addr, _, r_dev, r_mem = remote
        local_descs = [(local.addr + i * piece, piece, local.dev_id) for i in range(spans)]
        remote_descs = [(r_addr + 2 * i * piece, piece, r_dev) for i in range(spans)]
        self.lists = []
        self.handle = None
        self.lists.append(agent.prep_xfer_dlist("NIXL_INIT_AGENT", local_descs, local.mem_type))
        self.lists.append(agent.prep_xfer_dlist(remote_name, remote_descs, r_mem))
        self.indices = list(range(spans))
        if not per_op:
            self.handle = self.make()

    def make(self):
        local_side, remote_side = self.lists
        return self.agent.make_prepped_xfer(self.op, local_side, self.indices,
                                            remote_side, self.indices)

    def once(self):
        """One operation, awaited; its time in nanoseconds."""
        agent = self.agent
        t0 = time.perf_counter_ns()
        handle = self.make() if self.per_op else self.handle
        state = agent.transfer(handle)
        deadline = t0 + int(OP_TIMEOUT_S * 1e9)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
            if time.perf_counter_ns() > deadline:
                break
        t1 = time.perf_counter_ns()
        if state != "DONE":
            if self.per_op:
                self.handle = handle  # So that close() tries to release it.
            raise Failure(f"the transfer ended in state {state}"
                          + (f" after {OP_TIMEOUT_S:.0f} s" if state == "PROC" else ""))
        if self.per_op:
            handle.release()
        return t1 - t0

    def close(self):
        for h in [self.handle] + self.lists:
            if h is not None:
                try:
                    h.release()
                except Exception as e:
                    print(f"nixl-remote: releasing {h!r}: {e}", file=sys.stderr)
        self.handle, self.lists = None, []


def measure(args, agent, remote_name, local, remote, target, size, spans, op):
    """The median time of one row, after its bytes checked out."""
    piece = size // spans
    iters = iters_for(args, size)
    # READ: clear the local buffer before the last operation, then check it against the region.
    # WRITE: give the local buffer a new pattern before the last operation, and have the target
    # check its first and last spans.
    if op == "READ":
        local.zero()
    else:
        local.fill(0, size, 0, SALT_WRITE)
    row = Row(agent, remote_name, op, size, spans, local, remote, args.handle == "per-op")
    try:
        times = []
        for i in range(WARMUP + iters):
            if i == WARMUP + iters - 1:  # Untimed, before the last operation.
                if op == "READ":
                    local.zero()
                else:
                    local.fill(0, size, 0, SALT_LAST_WRITE)
            t = row.once()
            if i >= WARMUP:
                times.append(t)
    except Exception as e:
        # NIXL raises its errors (nixlRemoteDisconnectError, nixlBackendError, ...) more often
        # than it answers "ERR".
        target.proc.join(0.5)  # A process killed a moment ago may not be reaped yet.
        gone = ("" if target.proc.is_alive()
                else f" (the target process is gone, exit code {target.proc.exitcode})")
        what = str(e) if isinstance(e, Failure) else f"{type(e).__name__}: {e}"
        raise Failure(f"{op} {human_size(size)} x {spans}: {what}{gone}") from e
    finally:
        row.close()
    if op == "READ":
        bad = [i for i in range(spans)
               if not local.matches(i * piece, piece, 2 * i * piece, SALT_REGION)]
        if bad:
            raise Failure(f"READ {human_size(size)} x {spans}: the last read's bytes differ "
                          f"from the region's in {len(bad)} of {spans} spans "
                          f"(first: span {bad[0]})")
    else:
        checks = [(2 * i * piece, piece, i * piece, SALT_LAST_WRITE)
                  for i in sorted({0, spans - 1})]
        reply = target.call(("check", checks, 2 * size), "checking a write")
        if reply[0] != "ok":
            raise Failure(f"WRITE {human_size(size)} x {spans}: the last write's bytes are not "
                          f"in the region: {reply[1]}")
    return statistics.median(times)


def run(args):
    api, module, version = import_nixl()
    progress_thread = args.progress_thread == "on"
    largest = max(args.sizes)
    local = Memory(args.device, largest)  # Before the agent: see target_main.
    target = Target(args.device, 2 * largest)
    agent = reg = remote_name = None
    try:
        agent = new_agent(api, "nixl-remote-initiator", progress_thread)
        reg = agent.register_memory(local.reg_list(), local.mem_type)
        _, metadata, remote = target.recv(START_TIMEOUT_S, "starting")
        remote_name = agent.add_remote_agent(metadata)
        agent.make_connection(remote_name)

        where = ("the region on cuda:0 of the target process, the local buffer on cuda:0 of "
                 "this one" if args.device == "cuda" else
                 "the region and the local buffer in host memory")
        handle = ("made once per row (prep_xfer_dlist both sides, make_prepped_xfer) and "
                  "re-posted for every operation" if args.handle == "reuse" else
                  "made per operation (make_prepped_xfer, inside the timed span) from lists "
                  "prepared once per row")
        iters = (f"{args.iters} operations" if args.iters is not None
                 else "200 operations up to 64 MiB, 20 above")
        emit("nixl-remote: NIXL one-sided READ and WRITE between two processes of one host")
        emit(f"  machine:  {machine(args.device)}")
        emit(f"  date:     {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
        emit(f"  command:  {command_line()}")
        emit(f"  nixl:     {version} ({module}), UCX backend; progress thread: "
             f"initiator {args.progress_thread}, target on")
        emit(f"  device:   {args.device}: {where}")
        emit(f"  handle:   {handle}")
        emit(f"  timing:   transfer() to check_xfer_state() == DONE, polled; median of {iters} "
             f"after {WARMUP} warm-ups; last READ and last WRITE checked")
        emit()
        emit("| op | size | spans | p50 | GB/s |")
        emit("| --- | ---: | ---: | ---: | ---: |")
        for size in args.sizes:
            for spans in args.batch:
                for op in ("READ", "WRITE"):
                    p50 = measure(args, agent, remote_name, local, remote, target, size, spans, op)
                    emit(f"| {op} | {human_size(size)} | {spans} | {p50 / 1e3:.1f} µs "
                         f"| {size / p50:.2f} |")  # bytes per ns = GB/s
    finally:
        if agent is not None:
            if remote_name is not None:
                try:
                    agent.remove_remote_agent(remote_name)
                except Exception as e:
                    print(f"nixl-remote: removing the remote agent: {e}", file=sys.stderr)
            if reg is not None:
                try:
                    agent.deregister_memory(reg)
                except Exception as e:
                    print(f"nixl-remote: deregistering: {e}", file=sys.stderr)
        target.stop()
    if target.proc.exitcode != 0:
        raise Failure(f"target process exited with code {target.proc.exitcode}")


def main():
    args = parse_args(sys.argv[1:])
    code = 0
    try:
        run(args)
    except Failure as e:
        print(f"nixl-remote: error: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("nixl-remote: interrupted", file=sys.stderr)
        code = 1
    except Exception:
        print(f"nixl-remote: error:\n{traceback.format_exc()}", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # Not sys.exit: see the module's docstring (libnl-route at exit).


if __name__ == "__main__":
    main()
