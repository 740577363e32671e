//! `extern "C"` declarations of the shim in `shim.c`. Nothing outside `crate::backend::efa` sees
//! these: the safe wrappers in `fabric/mod.rs` own every pointer.

use std::ffi::{c_char, c_int, c_void};

/// Opaque libfabric objects: only ever behind a pointer.
macro_rules! opaque {
    ($($name:ident),*) => {$(
        /// An opaque libfabric object.
        #[repr(C)]
        pub struct $name {
            _private: [u8; 0],
        }
    )*};
}
opaque!(FiInfo, FidFabric, FidDomain, FidEp, FidCq, FidAv, FidMr);

/// One completion (`struct ap_completion`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct ApCompletion {
    pub context: u64,
    pub tag: u64,
    pub len: u64,
    pub flags: u64,
    pub data: u64,
    pub err: i32,
    pub prov_errno: i32,
}

/// One `fi_info` entry, as far as we read it (`struct ap_info`).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ApInfo {
    pub provider: *const c_char,
    pub fabric: *const c_char,
    pub domain: *const c_char,
    pub max_msg_size: u64,
    pub inject_size: u64,
    pub tx_size: u64,
    pub rx_size: u64,
    pub mr_mode: u64,
    pub mode: u64,
    pub caps: u64,
    pub addr_format: u32,
    pub pad: u32,
}

extern "C" {
    pub fn ap_version() -> u32;
    pub fn ap_header_version() -> u32;
    pub fn ap_strerror(err: c_int) -> *const c_char;
    pub fn ap_getinfo(
        prov: *const c_char,
        inject: usize,
        rma: c_int,
        out: *mut *mut FiInfo,
    ) -> c_int;
    pub fn ap_freeinfo(info: *mut FiInfo);
    pub fn ap_dupinfo(info: *const FiInfo) -> *mut FiInfo;
    pub fn ap_info_next(info: *mut FiInfo) -> *mut FiInfo;
    pub fn ap_info_read(info: *const FiInfo, out: *mut ApInfo);
    pub fn ap_fabric(info: *mut FiInfo, out: *mut *mut FidFabric) -> c_int;
    pub fn ap_domain(fabric: *mut FidFabric, info: *mut FiInfo, out: *mut *mut FidDomain) -> c_int;
    pub fn ap_cq_open(
        domain: *mut FidDomain,
        size: usize,
        want_fd: c_int,
        out: *mut *mut FidCq,
        fd: *mut c_int,
    ) -> c_int;
    pub fn ap_av_open(domain: *mut FidDomain, out: *mut *mut FidAv) -> c_int;
    pub fn ap_endpoint(
        domain: *mut FidDomain,
        info: *mut FiInfo,
        cq: *mut FidCq,
        av: *mut FidAv,
        out: *mut *mut FidEp,
    ) -> c_int;
    pub fn ap_getname(ep: *mut FidEp, addr: *mut c_void, len: *mut usize) -> c_int;
    pub fn ap_av_insert(av: *mut FidAv, addr: *const c_void, out: *mut u64) -> c_int;
    pub fn ap_av_remove(av: *mut FidAv, addr: u64) -> c_int;
    pub fn ap_close_ep(p: *mut FidEp) -> c_int;
    pub fn ap_close_cq(p: *mut FidCq) -> c_int;
    pub fn ap_close_av(p: *mut FidAv) -> c_int;
    pub fn ap_close_mr(p: *mut FidMr) -> c_int;
    pub fn ap_close_domain(p: *mut FidDomain) -> c_int;
    pub fn ap_close_fabric(p: *mut FidFabric) -> c_int;
    pub fn ap_tsend(
        ep: *mut FidEp,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        tag: u64,
        data: u64,
        context: *mut c_void,
    ) -> isize;
    pub fn ap_tinject(
        ep: *mut FidEp,
        buf: *const c_void,
        len: usize,
        dest: u64,
        tag: u64,
        data: u64,
    ) -> isize;
    pub fn ap_trecv(
        ep: *mut FidEp,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        src: u64,
        tag: u64,
        ignore: u64,
        context: *mut c_void,
    ) -> isize;
    pub fn ap_cancel(ep: *mut FidEp, context: *mut c_void) -> isize;
    pub fn ap_cq_read(
        cq: *mut FidCq,
        out: *mut ApCompletion,
        count: usize,
        errbuf: *mut c_char,
        errlen: usize,
    ) -> isize;
    pub fn ap_trywait(fabric: *mut FidFabric, cq: *mut FidCq) -> c_int;
    pub fn ap_mr_reg(
        domain: *mut FidDomain,
        buf: *const c_void,
        len: usize,
        access: u64,
        out: *mut *mut FidMr,
        desc: *mut *mut c_void,
    ) -> c_int;
    pub fn ap_mr_key(mr: *mut FidMr) -> u64;
    pub fn ap_read(
        ep: *mut FidEp,
        buf: *mut c_void,
        len: usize,
        desc: *mut c_void,
        src: u64,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> isize;
    pub fn ap_write(
        ep: *mut FidEp,
        buf: *const c_void,
        len: usize,
        desc: *mut c_void,
        dest: u64,
        addr: u64,
        key: u64,
        context: *mut c_void,
    ) -> isize;
    pub fn ap_const(which: c_int) -> u64;
}
