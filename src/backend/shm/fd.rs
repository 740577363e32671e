//! The descriptors behind a shm connection: sealed memfds and their mappings, eventfds, file
//! descriptors passed with `SCM_RIGHTS`, and Unix sockets in the abstract namespace.

use std::ffi::CStr;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

use super::ring::{Region, HEADER};

fn cvt(r: libc::c_int) -> io::Result<libc::c_int> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

fn cvt_size(r: libc::ssize_t) -> io::Result<usize> {
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r as usize)
    }
}

/// Takes ownership of a descriptor a system call just returned.
fn owned(fd: libc::c_int) -> io::Result<OwnedFd> {
    let fd = cvt(fd)?;
    // SAFETY: `fd` was just returned by the kernel and is owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// An anonymous shared memory file of `len` bytes, sealed against resizing so that neither side
/// can make the other's mapping fault (SIGBUS) by shrinking it.
pub(crate) fn memfd(len: usize) -> io::Result<OwnedFd> {
    const NAME: &CStr = c"actorpipe-shm";
    // SAFETY: NAME is a valid NUL-terminated string; the flags are valid for memfd_create.
    let fd = owned(unsafe {
        libc::memfd_create(NAME.as_ptr(), libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
    })?;
    let size = libc::off_t::try_from(len).map_err(|_| io::ErrorKind::InvalidInput)?;
    // SAFETY: `fd` is a valid memfd we own.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), size) })?;
    // SAFETY: as above; F_ADD_SEALS takes an int argument.
    cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) })?;
    Ok(fd)
}

/// The size of a memfd received from the peer, after checking that it cannot shrink.
pub(crate) fn sealed_len(fd: &OwnedFd) -> io::Result<usize> {
    // SAFETY: `fd` is a valid descriptor; F_GET_SEALS takes no argument.
    let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
    if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer's ring memory is not a memfd sealed against shrinking",
        ));
    }
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: `st` is writable memory of the right type for fstat.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), st.as_mut_ptr()) })?;
    // SAFETY: fstat succeeded, so it filled `st`.
    let size = unsafe { st.assume_init() }.st_size;
    usize::try_from(size).map_err(|_| io::ErrorKind::InvalidData.into())
}

/// A shared read-write mapping of a whole memfd.
pub(crate) struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory owned by this value; nothing in it is thread-bound.
unsafe impl Send for Mapping {}
// SAFETY: access goes through raw pointers and atomics only (see `Region`).
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps `len` bytes of `fd`, shared with every other mapping of it.
    pub(crate) fn new(fd: &OwnedFd, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::ErrorKind::InvalidInput.into());
        }
        // SAFETY: a fresh mapping chosen by the kernel; it aliases nothing in this process.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p as *mut u8).ok_or(io::ErrorKind::InvalidData)?;
        Ok(Mapping { ptr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` are exactly what mmap returned; nobody uses them after this (the
        // rings hold an `Arc` of the mapping).
        unsafe { libc::munmap(self.ptr.as_ptr() as *mut libc::c_void, self.len) };
    }
}

// SAFETY: mmap returns page-aligned memory (HEADER is one page) valid for `len` bytes until
// munmap in Drop; the memfd is sealed against shrinking, so the pages cannot vanish.
unsafe impl Region for Mapping {
    fn as_ptr(&self) -> *mut u8 {
        const _: () = assert!(HEADER == 4096);
        self.ptr.as_ptr()
    }
    fn len(&self) -> usize {
        self.len
    }
}

/// Descriptors that own their file for their whole life, so that tokio may watch them.
///
/// # Safety
///
/// `as_raw_fd` must return the same open descriptor for as long as the value lives.
pub(crate) unsafe trait Watchable: AsRawFd {}

// SAFETY: an `OwnedFd` closes its descriptor only when dropped and never changes it.
unsafe impl Watchable for OwnedFd {}
// SAFETY: an `EventFd` is an `OwnedFd` that is never replaced.
unsafe impl Watchable for EventFd {}

/// Registers `inner` with the tokio reactor for readability.
pub(crate) fn watch<T: Watchable>(inner: T) -> io::Result<tokio::io::unix::AsyncFd<T>> {
    // SAFETY: `Watchable` guarantees the descriptor stays open and the same while the AsyncFd
    // owns `inner`.
    unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(inner, tokio::io::Interest::READABLE)
    }
    .map_err(io::Error::from)
}

/// Makes a descriptor non-blocking (received descriptors come with the sender's flags).
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: F_GETFL/F_SETFL on a descriptor we hold.
    let flags = cvt(unsafe { libc::fcntl(fd, libc::F_GETFL) })?;
    // SAFETY: as above.
    cvt(unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) })?;
    Ok(())
}

/// An eventfd used as a doorbell: `ring` adds one, `drain` takes everything.
#[derive(Debug)]
pub(crate) struct EventFd(OwnedFd);

impl EventFd {
    /// A new doorbell, non-blocking and close-on-exec.
    pub(crate) fn new() -> io::Result<EventFd> {
        // SAFETY: plain system call with valid flags.
        owned(unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) }).map(EventFd)
    }

    /// Adopts a doorbell received from the peer.
    pub(crate) fn from_fd(fd: OwnedFd) -> io::Result<EventFd> {
        set_nonblocking(fd.as_raw_fd())?;
        Ok(EventFd(fd))
    }

    /// The descriptor, to pass to the peer.
    pub(crate) fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.0.as_fd()
    }

    /// Rings the doorbell. A failure (the counter is saturated, so a wake-up is pending anyway)
    /// is ignored.
    pub(crate) fn ring(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a valid buffer to a descriptor we hold.
        let _ = unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }
}

impl AsRawFd for EventFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

/// The most descriptors one bootstrap message may carry; more is refused.
pub(crate) const MAX_FDS: usize = 8;

/// Room for a control message of MAX_FDS descriptors, aligned for `cmsghdr`.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

const _: () = assert!(std::mem::size_of::<libc::cmsghdr>() + MAX_FDS * 4 <= 64);

/// Sends `bytes` with `fds` attached (non-blocking; `WouldBlock` when the socket is full).
pub(crate) fn send_with_fds(
    sock: RawFd,
    bytes: &[u8],
    fds: &[BorrowedFd<'_>],
) -> io::Result<usize> {
    if fds.len() > MAX_FDS {
        return Err(io::ErrorKind::InvalidInput.into());
    }
    let mut cbuf = CmsgBuf([0; 64]);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is a plain C struct for which all-zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    let payload = (fds.len() * std::mem::size_of::<RawFd>()) as u32;
    if !fds.is_empty() {
        msg.msg_control = cbuf.0.as_mut_ptr().cast();
        // SAFETY: CMSG_SPACE is a pure size computation.
        msg.msg_controllen = unsafe { libc::CMSG_SPACE(payload) } as _;
        // SAFETY: msg_control points at `cbuf`, large enough for one header plus MAX_FDS
        // descriptors (checked above), aligned for cmsghdr; CMSG_DATA points inside it.
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN(payload) as _;
            let data = libc::CMSG_DATA(c) as *mut RawFd;
            for (i, fd) in fds.iter().enumerate() {
                data.add(i).write_unaligned(fd.as_raw_fd());
            }
        }
    }
    // SAFETY: `msg` points at live buffers (`iov` -> `bytes`, `cbuf`) for the whole call.
    cvt_size(unsafe { libc::sendmsg(sock, &msg, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) })
}

/// Receives into `buf`, appending any descriptors that came with the bytes to `fds` (as
/// close-on-exec). Returns the byte count; 0 is end of stream.
pub(crate) fn recv_with_fds(
    sock: RawFd,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
) -> io::Result<usize> {
    let mut cbuf = CmsgBuf([0; 64]);
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: msghdr is a plain C struct for which all-zero is valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.0.as_mut_ptr().cast();
    msg.msg_controllen = cbuf.0.len() as _;
    // SAFETY: `msg` points at live, writable buffers for the whole call.
    let n = cvt_size(unsafe {
        libc::recvmsg(sock, &mut msg, libc::MSG_CMSG_CLOEXEC | libc::MSG_DONTWAIT)
    })?;
    // Take ownership of every descriptor first, so that they are closed on any error below.
    // SAFETY: the kernel filled `msg_controllen` bytes of `cbuf` with well-formed headers; the
    // CMSG_* walkers stay within that length; SCM_RIGHTS data is an array of new descriptors
    // that we now own.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c) as *const RawFd;
                let bytes = ((*c).cmsg_len as usize).saturating_sub(data as usize - c as usize);
                for i in 0..bytes / std::mem::size_of::<RawFd>() {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    if msg.msg_flags & libc::MSG_CTRUNC != 0 {
        // The buffer holds MAX_FDS descriptors, more than a bootstrap sends: the kernel truncates
        // the control message either because the peer sent too many, or because this process
        // could not take them all (at RLIMIT_NOFILE). The ones received are closed on return.
        drop(std::mem::take(fds));
        if crate::fds::exhausted(MAX_FDS) {
            return Err(crate::fds::out_of_descriptors(
                "could not receive the peer's shm descriptors",
            ));
        }
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the peer sent more descriptors than the shm bootstrap expects",
        ));
    }
    Ok(n)
}

/// A socket address in the abstract namespace (a leading NUL, no file).
fn abstract_addr(name: &[u8]) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: sockaddr_un is a plain C struct for which all-zero is valid.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket name too long",
        ));
    }
    for (d, s) in addr.sun_path[1..].iter_mut().zip(name) {
        *d = *s as libc::c_char;
    }
    let len = std::mem::offset_of!(libc::sockaddr_un, sun_path) + 1 + name.len();
    Ok((addr, len as libc::socklen_t))
}

/// Starts connecting a non-blocking stream socket to an abstract name. `WouldBlock` means the
/// listener's backlog is full: try again later.
pub(crate) fn connect_abstract(name: &[u8]) -> io::Result<OwnedFd> {
    let (addr, len) = abstract_addr(name)?;
    // SAFETY: plain system call with valid constants.
    let fd = owned(unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    cvt(unsafe {
        libc::connect(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len,
        )
    })?;
    Ok(fd)
}

/// Binds and listens on an abstract name (non-blocking, close-on-exec).
pub(crate) fn listen_abstract(name: &[u8]) -> io::Result<OwnedFd> {
    let (addr, len) = abstract_addr(name)?;
    // SAFETY: plain system call with valid constants.
    let fd = owned(unsafe {
        libc::socket(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    })?;
    // SAFETY: `addr` is a valid sockaddr_un of `len` bytes.
    cvt(unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&addr as *const libc::sockaddr_un).cast(),
            len,
        )
    })?;
    // SAFETY: listen on a socket we own.
    cvt(unsafe { libc::listen(fd.as_raw_fd(), 128) })?;
    Ok(fd)
}

/// Looks at the bootstrap socket of an established connection without blocking: `Ok(true)` when
/// the peer is gone (end of stream, an error, or bytes it should never have sent), `WouldBlock`
/// while it is alive and quiet.
pub(crate) fn peer_gone(sock: RawFd) -> io::Result<bool> {
    let mut b = [0u8; 1];
    // SAFETY: reads at most one byte into a valid buffer; MSG_PEEK leaves the socket unchanged.
    let r = unsafe {
        libc::recv(
            sock,
            b.as_mut_ptr().cast(),
            1,
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    if r >= 0 {
        return Ok(true);
    }
    let e = io::Error::last_os_error();
    match e.kind() {
        io::ErrorKind::WouldBlock => Err(e),
        io::ErrorKind::Interrupted => Ok(false),
        _ => Ok(true),
    }
}

/// The effective uid of this process.
pub(crate) fn uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}
