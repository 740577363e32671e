//! Tests of the cma primitives against the real kernel: this process, and a child process.
//!
//! Every test that reads memory first runs [`probe`]; where the kernel forbids
//! `process_vm_readv` (seccomp, containers) it prints "skipped: …" and returns without checking
//! anything, so read "ok" next to that line as "not run".

use super::*;
use proptest::prelude::*;
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

/// Whether cma works here; prints why not when it does not.
fn usable(test: &str) -> bool {
    match probe() {
        Ok(()) => true,
        Err(e @ CmaError::NotPermitted { .. }) => {
            eprintln!("skipped: {test}: {e}");
            false
        }
        Err(e) => panic!("probe failed for another reason than permissions: {e}"),
    }
}

/// A pattern that differs between neighbouring bytes and between pages, so that a shifted or
/// misplaced piece shows.
fn pattern(i: usize) -> u8 {
    (i.wrapping_mul(31) ^ (i >> 12).wrapping_mul(7) ^ (i >> 20)) as u8
}

fn patterned(len: usize) -> Vec<u8> {
    (0..len).map(pattern).collect()
}

#[test]
fn offer_says_cma_cpu_and_a_full_domain() {
    let offer = Cma.offer(Cma.priority());
    assert_eq!(offer.name, "cma");
    assert_eq!(offer.priority, 200);
    assert_eq!(offer.connections, 2);
    assert_eq!(offer.devices, DevicePair::CPU);
    let domain = Cma.domain();
    assert_eq!(domain, Cma.domain(), "stable within a process");
    // This machine has /proc: the descriptor is the real one, not the never-matching fallback.
    assert!(domain.starts_with("boot="), "{domain}");
    assert!(
        domain.contains(";pidns=") && domain.contains(";uid="),
        "{domain}"
    );
}

#[test]
fn remote_buffer_round_trips_and_rejects_other_lengths() {
    let b = RemoteBuffer {
        pid: 0x0102_0304,
        addr: 0x1122_3344_5566_7788,
        len: u64::MAX,
    };
    let bytes = b.encode();
    assert_eq!(&bytes[..4], &[4, 3, 2, 1]);
    assert_eq!(&bytes[4..12], &0x1122_3344_5566_7788u64.to_le_bytes());
    assert_eq!(RemoteBuffer::decode(&bytes), Some(b));
    assert_eq!(RemoteBuffer::decode(&bytes[..19]), None);
    assert_eq!(RemoteBuffer::decode(&[0; 21]), None);
    assert_eq!(RemoteBuffer::decode(&[]), None);
}

#[test]
fn plan_of_five_gib_stays_under_the_kernel_limit() {
    let len = 5u64 << 30;
    for threads in [1, 2, 3] {
        let pieces: Vec<_> = plan(len, MAX_RW_COUNT_4K, threads)
            .flat_map(|s| s.pieces())
            .collect();
        let mut next = 0;
        for &(offset, piece) in &pieces {
            assert_eq!(offset, next);
            assert!(piece > 0 && piece <= MAX_RW_COUNT_4K, "{piece:#x}");
            next += piece;
        }
        assert_eq!(next, len, "{threads} threads");
    }
    assert_eq!(plan(len, MAX_RW_COUNT_4K, 1).count(), 1);
    assert_eq!(
        plan(len, MAX_RW_COUNT_4K, 1)
            .flat_map(|s| s.pieces())
            .count(),
        3
    );
    assert_eq!(plan(len, MAX_RW_COUNT_4K, 2).count(), 2);
}

#[test]
fn plan_edge_cases() {
    assert_eq!(plan(0, 10, 4).count(), 0);
    // Small reads stay on one thread; zero threads and zero-byte calls are taken as one.
    assert_eq!(plan(MIN_SHARE, 1 << 30, 8).count(), 1);
    assert_eq!(plan(MIN_SHARE + 1, 1 << 30, 8).count(), 2);
    assert_eq!(plan(1 << 40, 1 << 30, 0).count(), 1);
    assert_eq!(plan(1 << 40, 1 << 30, usize::MAX).count(), MAX_THREADS);
    assert_eq!(plan(3, 0, 1).flat_map(|s| s.pieces()).count(), 3);
    let shares: Vec<_> = plan(64 << 20, 1 << 30, 2).collect();
    assert_eq!(shares.len(), 2);
    assert_eq!((shares[1].offset, shares[1].len), (32 << 20, 32 << 20));
    // Lazy: a plan too large to list is still fine to describe.
    assert_eq!(plan(u64::MAX, 1, 1).next().map(|s| s.len), Some(u64::MAX));
}

proptest! {
    #[test]
    fn plan_covers_exactly(
        len in 0u64..(1 << 40),
        divisor in 1u64..2000,
        threads in 0usize..100,
    ) {
        let max = (len / divisor).max(1);
        let mut next = 0;
        let mut shares = 0;
        for share in plan(len, max, threads) {
            prop_assert_eq!(share.offset, next);
            prop_assert!(share.len > 0);
            prop_assert!(share.offset % SHARE_ALIGN == 0);
            for (offset, piece) in share.pieces() {
                prop_assert_eq!(offset, next);
                prop_assert!(piece > 0 && piece <= max);
                next += piece;
            }
            prop_assert_eq!(next, share.offset + share.len);
            shares += 1;
        }
        prop_assert_eq!(next, len);
        prop_assert!(shares <= threads.clamp(1, MAX_THREADS));
    }
}

#[test]
fn probe_works_here() {
    match probe() {
        Ok(()) => {}
        Err(e @ CmaError::NotPermitted { .. }) => eprintln!("skipped: probe_works_here: {e}"),
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn reads_odd_sizes_at_odd_offsets_from_this_process() {
    if !usable("reads_odd_sizes_at_odd_offsets_from_this_process") {
        return;
    }
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

#[test]
fn multithreaded_read_of_64_mib_matches_and_reports_bandwidth() {
    if !usable("multithreaded_read_of_64_mib_matches_and_reports_bandwidth") {
        return;
    }
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

#[test]
fn length_mismatch_reads_nothing() {
    let src = [1u8; 8];
    let mut dst = [0u8; 7];
    let err = read_remote(&RemoteBuffer::local(&src), &mut dst, 1).unwrap_err();
    assert!(
        matches!(
            err,
            CmaError::LengthMismatch {
                remote: 8,
                local: 7
            }
        ),
        "{err}"
    );
    assert_eq!(dst, [0; 7]);
}

#[test]
fn bogus_address_is_a_fault() {
    if !usable("bogus_address_is_a_fault") {
        return;
    }
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

#[test]
fn a_range_running_into_an_unreadable_page_reads_up_to_it_then_faults() {
    if !usable("a_range_running_into_an_unreadable_page_reads_up_to_it_then_faults") {
        return;
    }
    // SAFETY: sysconf reads a configuration value and touches no memory of ours.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
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

#[test]
fn pid_that_cannot_exist_is_gone() {
    let mut dst = [0u8; 4];
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
        match err {
            CmaError::Gone { .. } => {}
            CmaError::NotPermitted { .. } => {
                eprintln!("skipped: pid_that_cannot_exist_is_gone: {err}")
            }
            other => panic!("{other}"),
        }
    }
}

#[test]
fn errors_map_to_the_runtime_error_classes() {
    let origin = Origin::new("tcp://peer", "cma");
    let not_permitted = CmaError::NotPermitted {
        pid: 1,
        source: io::Error::from_raw_os_error(libc::EPERM),
    };
    assert!(matches!(
        not_permitted.into_error(&origin),
        Error::Unavailable { .. }
    ));
    assert!(matches!(
        CmaError::Gone { pid: 1 }.into_error(&origin),
        Error::PeerClosed { .. }
    ));
    let fault = CmaError::Fault {
        pid: 1,
        addr: 0,
        len: 1,
    };
    assert!(matches!(fault.into_error(&origin), Error::Protocol { .. }));
    let other = CmaError::Other {
        pid: 1,
        source: io::Error::from_raw_os_error(libc::ENOMEM),
    };
    assert!(matches!(other.into_error(&origin), Error::Io { .. }));
    for errno in [libc::EPERM, libc::EACCES, libc::ENOSYS] {
        let e = CmaError::from_os(io::Error::from_raw_os_error(errno), 1, 0, 1);
        assert!(matches!(e, CmaError::NotPermitted { .. }), "{e}");
    }
    let e = CmaError::from_os(io::Error::from_raw_os_error(libc::ESRCH), 1, 0, 1);
    assert!(matches!(e, CmaError::Gone { pid: 1 }));
}

// Alone on a 2-core VM it took 5.3 s, 3.3 s of which is the read, most of that the kernel
// faulting in 2 GiB of fresh destination pages.
#[test]
#[ignore = "needs 4.1 GiB of RAM and 5 s or more; run with --ignored"]
fn reads_2_gib_and_more_in_several_calls() {
    if !usable("reads_2_gib_and_more_in_several_calls") {
        return;
    }
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

/// Set in the environment of the child that `reads_from_another_process` starts.
const CHILD_ENV: &str = "ACTORPIPE_CMA_TEST_CHILD";
/// Starts the child's line on stdout (the test harness prints its own lines around it).
const CHILD_TAG: &str = "cma-test-child:";
const CHILD_LEN: usize = (1 << 20) + 13;

/// The child process of `reads_from_another_process`: fills a buffer, says where it is, and
/// waits for stdin to close. Run alone, it does nothing.
#[test]
#[ignore = "helper: the child process of reads_from_another_process; does nothing on its own"]
fn child_process() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let buf = std::hint::black_box(patterned(CHILD_LEN));
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "\n{CHILD_TAG} {} {} {}",
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

/// Kills and reaps the child however the test ends.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn reads_from_another_process() {
    if !usable("reads_from_another_process") {
        return;
    }
    let name = concat!(module_path!(), "::child_process");
    let name = name.split_once("::").map_or(name, |(_, rest)| rest);
    let child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            name,
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, "1")
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

#[test]
fn default_threads_follow_the_machine() {
    assert_eq!(default_threads(1), 2);
    assert_eq!(default_threads(2), 2);
    assert_eq!(default_threads(4), 2);
    assert_eq!(default_threads(6), 3);
    assert_eq!(default_threads(16), 8);
    assert_eq!(default_threads(192), 8);
}

/// A pool of reader threads of its own for a test (the process's one is shared by every test),
/// leaked as the process's is.
fn readers() -> &'static Pool {
    Box::leak(Box::new(Pool::new("test-cma")))
}

/// [`read_remote`] on `pool`, `threads` threads.
fn read_on(
    pool: &'static Pool,
    src: &RemoteBuffer,
    dst: &mut [u8],
    threads: usize,
) -> Result<(), CmaError> {
    read_shared(
        Some(pool),
        src,
        dst,
        plan(src.len, max_per_call(), threads).collect(),
    )
}

#[test]
fn reader_threads_take_shares_and_every_byte_lands() {
    if !usable("reader_threads_take_shares_and_every_byte_lands") {
        return;
    }
    let pool = readers();
    let len = 8 * MIN_SHARE as usize + 12_345;
    let src = patterned(len + 5);
    let remote = RemoteBuffer::local(&src[5..]);
    for k in 0..50 {
        let mut dst = vec![0u8; len + 2];
        read_on(pool, &remote, &mut dst[1..1 + len], 4).unwrap();
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
            let src = &src;
            s.spawn(move || {
                for k in 0..5 {
                    let n = len - t * 4099 - k * 77;
                    let mut dst = vec![0u8; n];
                    read_on(pool, &RemoteBuffer::local(&src[..n]), &mut dst, 3).unwrap();
                    assert!(dst == src[..n], "caller {t} read {k}");
                }
            });
        }
    });
}

#[test]
fn a_failed_share_fails_the_read_and_skips_the_rest() {
    if !usable("a_failed_share_fails_the_read_and_skips_the_rest") {
        return;
    }
    // SAFETY: sysconf reads a configuration value and touches no memory of ours.
    let page = usize::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap();
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
    let err = read_shared(None, &remote, &mut dst, shares).unwrap_err();
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
    let pool = readers();
    for _ in 0..10 {
        let mut dst = vec![0x11u8; len];
        let err = read_on(pool, &remote, &mut dst, 4).unwrap_err();
        let first = at(&err).unwrap_or_else(|| panic!("not a fault: {err}"));
        assert!(holes.contains(&(first as usize)), "fault at {first}: {err}");
    }
    // SAFETY: unmapping the mapping made above; nothing refers to it any more.
    assert_eq!(unsafe { libc::munmap(base, len) }, 0);
}

/// A child forked after the reader threads started has none of them: its reads are the
/// caller's alone, whole and correct, and queue nothing no thread would ever take.
#[test]
fn a_forked_child_reads_alone() {
    if !usable("a_forked_child_reads_alone") {
        return;
    }
    let pool = readers();
    let len = 4 * MIN_SHARE as usize;
    let src = patterned(len);
    let mut dst = vec![0u8; len];
    read_on(pool, &RemoteBuffer::local(&src), &mut dst, 4).unwrap();
    assert!(dst == src);
    crate::copy::check_in_forked_child(pool, || {
        let mut dst = vec![0u8; len];
        read_on(pool, &RemoteBuffer::local(&src), &mut dst, 4).is_ok() && dst == src
    });
}
