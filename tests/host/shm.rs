//! The shm transport refuses a peer of another user, both ways: any local user can connect to an
//! abstract Unix socket, so each side checks the other's uid (`SO_PEERCRED`) before any memory or
//! descriptor changes hands (src/backend/shm/bootstrap.rs, `check_peer`).
//!
//! The parent listens on shm; a child, this binary run again (role `shm`), drops to `nobody`
//! (uid and gid 65534) and dials it twice: once through a context, whose own check refuses the
//! listener of another user with a clear error, and once on a bare socket with a hello, as a
//! peer that skips that check would, which the listener closes without an answer. The
//! listener's log says why for both; then a peer of the listener's own user connects and its
//! pipe works. Starting a process of another user needs root: elsewhere the trial reports itself
//! skipped.

use std::io::{Read as _, Write as _};
use std::os::linux::net::SocketAddrExt;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use actorpipe::*;
use libtest_mimic::Trial;

use crate::common::*;
use crate::{trial, CHILD_ENV};

/// The user (and group) the child runs as.
const NOBODY: u32 = 65534;
/// Starts the child's lines on stdout.
const CHILD_TAG: &str = "shm-child:";

pub fn trials() -> Vec<Trial> {
    // SAFETY: geteuid cannot fail and touches no memory of ours.
    let euid = unsafe { libc::geteuid() };
    let skip = (euid != 0).then(|| {
        format!(
            "skipped: needs root to run a peer as another user (nobody, uid {NOBODY}); \
             this runs as uid {euid}"
        )
    });
    vec![trial(
        "shm::refuses_a_peer_of_another_user",
        skip.as_deref(),
        refuses_a_peer_of_another_user,
    )]
}

/// What the process logged (warnings and worse), for the trial to read the listener's reasons.
static LOG: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct Capture;

impl std::io::Write for Capture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG.lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The lines of the log that contain `what`.
fn logged(what: &str) -> Vec<String> {
    let log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    String::from_utf8_lossy(&log)
        .lines()
        .filter(|l| l.contains(what))
        .map(String::from)
        .collect()
}

fn refuses_a_peer_of_another_user() {
    // The trials run one at a time and no other installs a subscriber.
    let _ = tracing_subscriber::fmt()
        .with_writer(|| Capture)
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .try_init();
    actix::System::new().block_on(async {
        let mut server = Server::start(Context::builder(), "shm://").await;
        assert!(server.url.starts_with("shm://"), "{}", server.url);
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.env(CHILD_ENV, format!("shm {}", server.url));
        let mut child = ChildProcess::spawn(cmd);
        // The listener runs on this thread: wait for the child without blocking it.
        let started = Instant::now();
        let status = loop {
            if let Some(s) = child.wait_exit(Duration::ZERO) {
                break s;
            }
            assert!(
                started.elapsed() < Duration::from_secs(60),
                "the child did not finish; its output:\n{}",
                child.tail()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let mut said = |what: &str| {
            child
                .line(&format!("{CHILD_TAG} {what}"), Duration::from_secs(10))
                .map(|(_, rest)| rest)
                .unwrap_or_else(|| {
                    panic!(
                        "the child ({status}) did not say `{what}`; its output:\n{}",
                        child.tail()
                    )
                })
        };
        assert_eq!(
            said("uid"),
            format!("{NOBODY} {NOBODY}"),
            "the child's uid and gid"
        );
        // SAFETY: getuid cannot fail and touches no memory of ours.
        let ours = unsafe { libc::getuid() };
        // The context of another user refuses the listener before sending anything.
        let connect = said("connect");
        assert!(
            connect.starts_with("refused connect "),
            "a peer of another user must not get a pipe: {connect}"
        );
        assert!(
            connect.contains(&format!("runs as uid {ours}, we run as uid {NOBODY}"))
                && connect.contains("shm only connects processes of the same user"),
            "the error says why: {connect}"
        );
        // A peer that skips that check gets no answer to its hello: the listener closes.
        let raw = said("raw");
        assert!(
            raw == "closed without an answer" || raw == "reset",
            "the listener must not answer a peer of another user: {raw}"
        );
        assert!(status.success(), "the child failed: {status}");
        // The listener refused both, and says why.
        let why = format!("runs as uid {NOBODY}, we run as uid {ours}");
        let started = Instant::now();
        while logged(&why).len() < 2 && started.elapsed() < Duration::from_secs(10) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let refusals = logged(&why);
        assert_eq!(
            refusals.len(),
            2,
            "the listener logs each refusal of the other user: {refusals:?}"
        );
        assert!(
            refusals
                .iter()
                .all(|l| l.contains("shm connection dropped")),
            "{refusals:?}"
        );
        // It goes on serving its own user.
        let (tx, rx) = within(
            20,
            "a pipe of the same user",
            server.dial(&Context::builder().start()),
        )
        .await;
        assert_eq!(tx.send(GetInfo).await.unwrap().transport, "shm");
        let write = tx.send(Write::new(checked_message(7, &[64], &[4096])));
        let m = within(20, "a message", read_one(&rx)).await.expect("read");
        assert_eq!(verify(&m), 7);
        write.await.unwrap().result.expect("write");
        tell_ci(&format!(
            "shm::refuses_a_peer_of_another_user: the child's connect: {connect}; its bare \
             socket: {raw}"
        ));
    });
}

fn say(line: &str) {
    tell_parent(&format!("{CHILD_TAG} {line}"));
}

/// The child (role `shm <url>`): becomes `nobody`, then dials the parent's listener through a
/// context and on a bare socket, and says what each got.
pub fn child(words: &[String]) {
    let url = words.first().expect("the listener's URL");
    // SAFETY: plain system calls on this process's own credentials, made before it starts a
    // thread: no supplementary groups, then the group, then the user (after which the first two
    // could no longer be changed).
    unsafe {
        assert_eq!(libc::setgroups(0, std::ptr::null()), 0, "setgroups");
        assert_eq!(libc::setgid(NOBODY), 0, "setgid");
        assert_eq!(libc::setuid(NOBODY), 0, "setuid");
    }
    // Changing credentials cleared the parent-death signal: set it now.
    die_with_parent();
    // SAFETY: getuid and getgid cannot fail and touch no memory of ours.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    say(&format!("uid {uid} {gid}"));
    actix::System::new().block_on(async {
        let r = within(
            20,
            "a connect as another user",
            Context::builder().start().send(Connect::new(url.as_str())),
        )
        .await
        .expect("the context");
        match r {
            Ok(_) => say("connect accepted"),
            Err(e) => say(&format!("connect refused {} {e}", e.class())),
        }
    });
    let name = url.strip_prefix("shm://").expect("an shm URL");
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(format!("actorpipe-{name}"))
        .expect("an abstract name");
    let mut sock = std::os::unix::net::UnixStream::connect_addr(&addr).expect("dial the socket");
    sock.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    // The connector's hello: version, then the ring capacity (its descriptors would follow it).
    let mut hello = *b"APSHMv1\0________";
    hello[8..].copy_from_slice(&(2u64 << 20).to_le_bytes());
    let sent = sock.write_all(&hello);
    let mut answer = [0u8; 64];
    match sock.read(&mut answer) {
        Ok(0) => say("raw closed without an answer"),
        Ok(n) => say(&format!("raw answered {:?} (sent: {sent:?})", &answer[..n])),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => say("raw reset"),
        Err(e) => say(&format!("raw failed {e} (sent: {sent:?})")),
    }
}
