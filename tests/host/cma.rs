//! The cma primitives against the real kernel: reads of this process's memory and of a child's
//! (`process_vm_readv`), one thread or several, and how each failure is reported.
//!
//! They need the kernel to let this process read memory with `process_vm_readv`; where a seccomp
//! filter, a container profile or a kernel without it forbids that, `cma::probe` says why and
//! every trial reports itself skipped with that reason. The tests of the primitives that read
//! nothing (plans, channel data, errors) are unit tests (`src/backend/cma/tests.rs`).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use actorpipe::internal::backend::cma::testing::{read_alone, read_remote_with, Readers};
use actorpipe::internal::backend::cma::{
    max_per_call, plan, probe, read_remote, CmaError, Refusal, RemoteBuffer, Share,
    MAX_RW_COUNT_4K, MIN_SHARE,
};
use libtest_mimic::Trial;

use crate::{trial, CHILD_ENV};

/// The trials, each skipped with the probe's reason where cma is not permitted here.
pub fn trials() -> Vec<Trial> {
    let skip = match probe() {
        Ok(()) => None,
        Err(CmaError::NotPermitted { source, .. }) => Some(format!(
            "skipped: the kernel does not let this process use process_vm_readv ({source})"
        )),
        // Run them: they fail with the same error, and `probe_works_here` shows it.
        Err(_) => None,
    };
    let cases: [(&str, fn()); 12] = [
        ("probe_works_here", probe_works_here),
        (
            "reads_odd_sizes_at_odd_offsets_from_this_process",
            reads_odd_sizes_at_odd_offsets_from_this_process,
        ),
        (
            "multithreaded_read_of_64_mib_matches_and_reports_bandwidth",
            multithreaded_read_of_64_mib_matches_and_reports_bandwidth,
        ),
        ("bogus_address_is_a_fault", bogus_address_is_a_fault),
        (
            "a_range_running_into_an_unreadable_page_reads_up_to_it_then_faults",
            a_range_running_into_an_unreadable_page_reads_up_to_it_then_faults,
        ),
        (
            "pid_that_cannot_exist_is_gone",
            pid_that_cannot_exist_is_gone,
        ),
        ("reads_from_another_process", reads_from_another_process),
        (
            "reader_threads_take_shares_and_every_byte_lands",
            reader_threads_take_shares_and_every_byte_lands,
        ),
        (
            "a_failed_share_fails_the_read_and_skips_the_rest",
            a_failed_share_fails_the_read_and_skips_the_rest,
        ),
        (
            "a_refusal_in_a_reader_threads_share_fails_the_read",
            a_refusal_in_a_reader_threads_share_fails_the_read,
        ),
        ("a_forked_child_reads_alone", a_forked_child_reads_alone),
        (
            "reads_2_gib_and_more_in_several_calls",
            reads_2_gib_and_more_in_several_calls,
        ),
    ];
    cases
        .into_iter()
        .map(|(name, f)| {
            let t = trial(&format!("cma::{name}"), skip.as_deref(), f);
            if skip.is_none() && name == "reads_2_gib_and_more_in_several_calls" {
                // Alone on a 2-core VM it took 5.3 s, 3.3 s of which is the read, most of that
                // the kernel faulting in 2 GiB of fresh destination pages.
                t.with_ignored_flag(true)
                    .with_kind("opt-in: 4.1 GiB, 5 s; --ignored runs it")
            } else {
                t
            }
        })
        .collect()
}

/// A pattern that differs between neighbouring bytes and between pages, so that a shifted or
/// misplaced piece shows.
fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 12).wrapping_mul(7) ^ (i >> 20)) as u8
}

fn patterned(len: usize) -> Vec<u8> {
    (0..len).map(pattern).collect()
}

/// The page size.
fn page() -> usize {
    // SAFETY: sysconf reads a configuration value and touches no memory of ours.
    usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap()
}

fn probe_works_here() {
    probe().expect("cma's probe: reading our own memory with process_vm_readv");
}

fn reads_odd_sizes_at_odd_offsets_from_this_process() {
    let src = patterned(3 * 4096 + 17);
    for len in [1usize, 31, 4097, 3 * 4096] {
        for (max, threads) in [(max_per_call(), 1), (7, 1), (4096, 3), (1, 2)] {
            let from = &src[3..3 + len];
            let mut dst = vec![0u8; len + 10];
            let to = &mut dst[5..5 + len];
            read_remote_with(&RemoteBuffer::local(from), to, threads, max).unwrap();
            assert!(to == from, "len {len}, max {max}, threads {threads}");
            assert!(dst[..5].iter().chain(&dst[5 + len..]).all(|&b| b == 0));
        }
    }
    let mut nothing = [];
    read_remote(
        &RemoteBuffer {
            pid: 0,
            addr: 0,
            len: 0,
        },
        &mut nothing,
        4,
    )
    .unwrap();
}

fn multithreaded_read_of_64_mib_matches_and_reports_bandwidth() {
    let len = 64 << 20;
    let src = patterned(len + 3);
    let remote = RemoteBuffer::local(&src[3..]);
    for threads in [1, 2, 4] {
        let mut dst = vec![0u8; len];
        let cold = Instant::now();
        read_remote(&remote, &mut dst, threads).unwrap();
        let cold = cold.elapsed();
        assert!(dst == src[3..], "{threads} threads");
        dst.fill(0);
        let warm = Instant::now();
        read_remote(&remote, &mut dst, threads).unwrap();
        let warm = warm.elapsed();
        assert!(dst == src[3..], "{threads} threads, second read");
        let copy = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src[3..]));
        let copy = copy.elapsed();
        let gbps = |t: std::time::Duration| len as f64 / t.as_secs_f64() / 1e9;
        eprintln!(
            "cma 64 MiB, {threads} thread(s): {:.2} GB/s into fresh pages ({cold:?}), \
             {:.2} GB/s into touched pages ({warm:?}); memcpy in process {:.2} GB/s",
            gbps(cold),
            gbps(warm),
            gbps(copy)
        );
    }
}

fn bogus_address_is_a_fault() {
    let me = std::process::id();
    let mut dst = [0u8; 16];
    // The first page is never mapped.
    let err = read_remote(
        &RemoteBuffer {
            pid: me,
            addr: 8,
            len: 16,
        },
        &mut dst,
        1,
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            CmaError::Fault {
                addr: 8,
                len: 16,
                ..
            }
        ),
        "{err}"
    );
    eprintln!("{err}");
    // A range past the end of the address space fails before any call.
    let err = read_remote(
        &RemoteBuffer {
            pid: me,
            addr: u64::MAX - 7,
            len: 16,
        },
        &mut dst,
        1,
    )
    .unwrap_err();
    assert!(matches!(err, CmaError::Fault { .. }), "{err}");
}

fn a_range_running_into_an_unreadable_page_reads_up_to_it_then_faults() {
    let page = page();
    // SAFETY: a fresh private anonymous mapping of two pages; nothing else refers to it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            2 * page,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // SAFETY: `base` is the start of our two-page read-write mapping; the first page is ours to
    // fill.
    unsafe { std::ptr::write_bytes(base.cast::<u8>(), 0xa5, page) };
    // SAFETY: the second page of our own mapping; no reference points into it.
    let rc = unsafe { libc::mprotect(base.cast::<u8>().add(page).cast(), page, libc::PROT_NONE) };
    assert_eq!(rc, 0);
    let start = base as u64 + 100;
    let mut dst = vec![0u8; 2 * page - 100];
    let err = read_remote(
        &RemoteBuffer {
            pid: std::process::id(),
            addr: start,
            len: dst.len() as u64,
        },
        &mut dst,
        1,
    )
    .unwrap_err();
    // The first call moved the readable part; the second, at the page boundary, failed.
    let boundary = base as u64 + page as u64;
    assert!(
        matches!(err, CmaError::Fault { addr, len, .. } if addr == boundary && len == page as u64),
        "{err}"
    );
    assert!(dst[..page - 100].iter().all(|&b| b == 0xa5));
    // SAFETY: unmapping the mapping made above; nothing refers to it any more.
    assert_eq!(unsafe { libc::munmap(base, 2 * page) }, 0);
}

fn pid_that_cannot_exist_is_gone() {
    let mut dst = [0u8; 4];
    // u32::MAX is no pid_t (no call is made); i32::MAX is above any pid_max the kernel allows.
    for pid in [u32::MAX, i32::MAX as u32] {
        let err = read_remote(
            &RemoteBuffer {
                pid,
                addr: 4096,
                len: 4,
            },
            &mut dst,
            1,
        )
        .unwrap_err();
        assert!(
            matches!(err, CmaError::Gone { pid: p } if p == pid),
            "pid {pid}: {err}"
        );
    }
}

/// Starts the child's line on stdout.
const CHILD_TAG: &str = "cma-test-child:";
const CHILD_LEN: usize = (1 << 20) + 13;

/// The child process of `reads_from_another_process` (role `cma`): fills a buffer, says where
/// it is, and waits for stdin to close.
pub fn child() {
    let buf = std::hint::black_box(patterned(CHILD_LEN));
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "{CHILD_TAG} {} {} {}",
        std::process::id(),
        buf.as_ptr() as usize,
        buf.len()
    )
    .unwrap();
    out.flush().unwrap();
    drop(out);
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
    drop(std::hint::black_box(buf));
}

/// Kills and reaps the child however the trial ends.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn reads_from_another_process() {
    let child = Command::new(std::env::current_exe().unwrap())
        .env(CHILD_ENV, "cma")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut child = Reaped(child);
    let stdout = child.0.stdout.take().unwrap();
    let line = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|l| l.contains(CHILD_TAG))
        .expect("the child exited without saying where its buffer is");
    let fields: Vec<u64> = line
        .split_once(CHILD_TAG)
        .unwrap()
        .1
        .split_whitespace()
        .map(|f| f.parse().unwrap())
        .collect();
    let remote = RemoteBuffer {
        pid: fields[0] as u32,
        addr: fields[1],
        len: fields[2],
    };
    assert_eq!(remote.pid, child.0.id());
    assert_ne!(remote.pid, std::process::id());
    // What travels in the descriptor.
    let remote = RemoteBuffer::decode(&remote.encode()).unwrap();

    let expected = patterned(CHILD_LEN);
    let mut dst = vec![0u8; CHILD_LEN];
    read_remote(&remote, &mut dst, 1).unwrap();
    assert!(dst == expected);
    let mut dst = vec![0u8; CHILD_LEN];
    read_remote_with(&remote, &mut dst, 3, 4099).unwrap();
    assert!(dst == expected);
    let odd = RemoteBuffer {
        addr: remote.addr + 3,
        len: 4097,
        ..remote
    };
    let mut dst = vec![0u8; 4097];
    read_remote(&odd, &mut dst, 1).unwrap();
    assert!(dst[..] == expected[3..3 + 4097]);
    let err = read_remote(
        &RemoteBuffer {
            addr: 8,
            len: 8,
            ..remote
        },
        &mut [0u8; 8],
        1,
    )
    .unwrap_err();
    assert!(matches!(err, CmaError::Fault { .. }), "{err}");

    child.0.kill().unwrap();
    child.0.wait().unwrap();
    let mut dst = vec![0u8; CHILD_LEN];
    let err = read_remote(&remote, &mut dst, 1).unwrap_err();
    assert!(
        matches!(err, CmaError::Gone { pid } if pid == remote.pid),
        "{err}"
    );
    eprintln!("{err}");
}

fn reader_threads_take_shares_and_every_byte_lands() {
    let pool = Readers::new("test-cma");
    let len = 8 * MIN_SHARE as usize + 12_345;
    let src = patterned(len + 5);
    let remote = RemoteBuffer::local(&src[5..]);
    for k in 0..50 {
        let mut dst = vec![0u8; len + 2];
        pool.read(&remote, &mut dst[1..1 + len], 4).unwrap();
        assert!(dst[1..1 + len] == src[5..], "read {k}");
        assert_eq!(
            (dst[0], dst[1 + len]),
            (0, 0),
            "read {k} wrote outside its buffer"
        );
        if pool.helped() > 0 {
            break;
        }
    }
    assert!(
        pool.helped() > 0,
        "no share was read by a reader thread in 50 reads of 8 MiB"
    );
    // Several callers at once share the pool's threads.
    std::thread::scope(|s| {
        for t in 0..3 {
            let (src, pool) = (&src, &pool);
            s.spawn(move || {
                for k in 0..5 {
                    let n = len - t * 4099 - k * 77;
                    let mut dst = vec![0u8; n];
                    pool.read(&RemoteBuffer::local(&src[..n]), &mut dst, 3)
                        .unwrap();
                    assert!(dst == src[..n], "caller {t} read {k}");
                }
            });
        }
    });
}

/// A refusal raised inside the pool (fault injection, `Refusal::InReaderShares`: each share a
/// reader thread claims fails with EPERM) fails the read as `NotPermitted`, the error the
/// channel falls back on, exactly when a reader thread took a share; a read the caller did
/// alone lands whole. Either way the call returns.
fn a_refusal_in_a_reader_threads_share_fails_the_read() {
    let pool = Readers::new("test-cma-refuse");
    let len = 8 * MIN_SHARE as usize + 999;
    let src = patterned(len);
    let remote = RemoteBuffer::local(&src);
    let (mut refused, mut whole) = (0, 0);
    for k in 0..200 {
        let before = pool.helped();
        let mut dst = vec![0u8; len];
        let r = pool.read_with(&remote, &mut dst, 4, Refusal::InReaderShares);
        if pool.helped() > before {
            let err = r.expect_err("a reader thread's share was refused");
            assert!(
                matches!(err, CmaError::NotPermitted { .. }),
                "read {k}: {err}"
            );
            refused += 1;
        } else {
            r.unwrap_or_else(|e| panic!("read {k}, the caller's alone: {e}"));
            assert!(dst == src, "read {k}");
            whole += 1;
        }
        if refused >= 3 {
            break;
        }
    }
    assert!(
        refused > 0,
        "no reader thread took a share in 200 reads of 8 MiB ({whole} whole)"
    );
    // Off again: the same pool reads everything.
    let mut dst = vec![0u8; len];
    pool.read_with(&remote, &mut dst, 4, Refusal::Off).unwrap();
    assert!(dst == src);
}

fn a_failed_share_fails_the_read_and_skips_the_rest() {
    let page = page();
    let share = MIN_SHARE as usize;
    let len = 4 * share;
    // SAFETY: a fresh private anonymous mapping; nothing else refers to it.
    let base = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(base, libc::MAP_FAILED);
    // One unreadable page in the middle of the second share and one in the fourth.
    let holes = [share + share / 2, 3 * share + share / 2];
    for hole in holes {
        // SAFETY: a page of our own mapping; no reference points into it.
        let rc =
            unsafe { libc::mprotect(base.cast::<u8>().add(hole).cast(), page, libc::PROT_NONE) };
        assert_eq!(rc, 0);
    }
    let remote = RemoteBuffer {
        pid: std::process::id(),
        addr: base as u64,
        len: len as u64,
    };
    let at = |err: &CmaError| match err {
        CmaError::Fault { addr, .. } => Some(*addr - base as u64),
        _ => None,
    };
    // The caller alone: the shares in order; the second fails at its hole, the third and
    // fourth are skipped.
    let mut dst = vec![0x11u8; len];
    let shares: Vec<Share> = plan(len as u64, max_per_call(), 4).collect();
    assert_eq!(shares.len(), 4);
    let err = read_alone(&remote, &mut dst, shares).unwrap_err();
    assert_eq!(at(&err), Some(holes[0] as u64), "{err}");
    assert!(
        dst[..share + share / 2].iter().all(|&b| b == 0),
        "read up to the hole"
    );
    assert!(
        dst[2 * share..].iter().all(|&b| b == 0x11),
        "a share after the failure was read"
    );
    // With reader threads: the read fails with a fault at one of the holes, whoever met it.
    let pool = Readers::new("test-cma");
    for _ in 0..10 {
        let mut dst = vec![0x11u8; len];
        let err = pool.read(&remote, &mut dst, 4).unwrap_err();
        let first = at(&err).unwrap_or_else(|| panic!("not a fault: {err}"));
        assert!(holes.contains(&(first as usize)), "fault at {first}: {err}");
    }
    // SAFETY: unmapping the mapping made above; nothing refers to it any more.
    assert_eq!(unsafe { libc::munmap(base, len) }, 0);
}

/// A child forked after the reader threads started has none of them: its reads are the
/// caller's alone, whole and correct, and queue nothing no thread would ever take.
fn a_forked_child_reads_alone() {
    let pool = Readers::new("test-cma");
    let len = 4 * MIN_SHARE as usize;
    let src = patterned(len);
    let mut dst = vec![0u8; len];
    pool.read(&RemoteBuffer::local(&src), &mut dst, 4).unwrap();
    assert!(dst == src);
    pool.check_in_forked_child(|| {
        let mut dst = vec![0u8; len];
        pool.read(&RemoteBuffer::local(&src), &mut dst, 4).is_ok() && dst == src
    });
}

fn reads_2_gib_and_more_in_several_calls() {
    // Past MAX_RW_COUNT, so one thread needs at least two calls. Filled with memset and
    // distinct markers rather than a per-byte pattern, to stay fast.
    let len = (2usize << 30) + 4096;
    let started = Instant::now();
    let mut src = vec![0x5au8; len + 3];
    for (i, chunk) in src.chunks_mut(1 << 20).enumerate() {
        chunk[..8].copy_from_slice(&(i as u64).to_le_bytes());
    }
    let limit = MAX_RW_COUNT_4K as usize;
    src[3 + limit - 1] = 1;
    src[3 + limit] = 2;
    src[len + 2] = 3;
    let src = &src[3..];
    let mut dst = vec![0u8; len];
    let read = Instant::now();
    read_remote(&RemoteBuffer::local(src), &mut dst, 1).unwrap();
    let read = read.elapsed();
    assert!(dst == src);
    eprintln!(
        "cma 2 GiB + 4 KiB, 1 thread: read {read:?} ({:.2} GB/s), whole test {:?}",
        len as f64 / read.as_secs_f64() / 1e9,
        started.elapsed()
    );
}
