//! Tests of the cma primitives that need no cross-memory read: the offer, the channel data,
//! the plans and the errors. The trials that read real memory, this process's and a child's,
//! are in tests/host/cma.rs: they need the kernel to allow `process_vm_readv`, and a binary of
//! their own reports them skipped, with the reason, where it does not.

use super::*;
use proptest::prelude::*;

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

#[test]
fn default_threads_follow_the_machine() {
    assert_eq!(default_threads(1), 2);
    assert_eq!(default_threads(2), 2);
    assert_eq!(default_threads(4), 2);
    assert_eq!(default_threads(6), 3);
    assert_eq!(default_threads(16), 8);
    assert_eq!(default_threads(192), 8);
}
