//! Endpoint URLs: `tcp://127.0.0.1:5000`, `tcp://[::1]:0`, `tcp://[fe80::1%eth0]:5000`,
//! `tcp://localhost:5000`.

use std::fmt;
use std::net::{IpAddr, Ipv6Addr, SocketAddr, SocketAddrV6};

use crate::error::Error;

/// The host part of a URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Host {
    /// A literal address; IPv6 link-local addresses carry their interface index.
    Ip {
        /// The address.
        ip: IpAddr,
        /// IPv6 scope id (interface index), 0 when none.
        scope: u32,
    },
    /// A name to resolve.
    Name(String),
}

/// A parsed endpoint URL: `scheme://host:port`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Url {
    /// The backend (`tcp`).
    pub scheme: String,
    /// Where.
    pub host: Host,
    /// The port; 0 asks the system for one when listening.
    pub port: u16,
}

fn bad(url: &str, why: &str) -> Error {
    Error::invalid(format!("bad URL {url:?}: {why}"))
}

fn scope_id(name: &str, url: &str) -> Result<u32, Error> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    let c = std::ffi::CString::new(name).map_err(|_| bad(url, "bad interface name"))?;
    // SAFETY: `c` is a valid NUL-terminated string for the duration of the call.
    let idx = unsafe { libc::if_nametoindex(c.as_ptr()) };
    if idx == 0 {
        return Err(bad(url, &format!("no network interface named {name:?}")));
    }
    Ok(idx)
}

fn scope_name(idx: u32) -> String {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: `buf` has IF_NAMESIZE bytes, as if_indextoname requires.
    let p = unsafe { libc::if_indextoname(idx, buf.as_mut_ptr()) };
    if p.is_null() {
        return idx.to_string();
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name into `buf`.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

impl Url {
    /// Parses `scheme://host:port`.
    pub fn parse(url: &str) -> Result<Url, Error> {
        let (scheme, rest) = url
            .split_once("://")
            .ok_or_else(|| bad(url, "expected scheme://host:port"))?;
        if scheme.is_empty() {
            return Err(bad(url, "empty scheme"));
        }
        let (host, port) = if let Some(r) = rest.strip_prefix('[') {
            let (inside, after) = r
                .split_once(']')
                .ok_or_else(|| bad(url, "missing ] after IPv6 address"))?;
            let port = after
                .strip_prefix(':')
                .ok_or_else(|| bad(url, "missing :port after ]"))?;
            let (addr, scope) = match inside.split_once('%') {
                Some((a, s)) => (a, scope_id(s, url)?),
                None => (inside, 0),
            };
            let ip: Ipv6Addr = addr.parse().map_err(|_| bad(url, "bad IPv6 address"))?;
            (
                Host::Ip {
                    ip: IpAddr::V6(ip),
                    scope,
                },
                port,
            )
        } else {
            let (h, p) = rest
                .rsplit_once(':')
                .ok_or_else(|| bad(url, "missing :port"))?;
            if h.is_empty() {
                return Err(bad(url, "empty host"));
            }
            let host = match h.parse::<IpAddr>() {
                Ok(IpAddr::V6(_)) => return Err(bad(url, "IPv6 addresses go in brackets")),
                Ok(ip) => Host::Ip { ip, scope: 0 },
                Err(_) => Host::Name(h.to_string()),
            };
            (host, p)
        };
        let port = port.parse().map_err(|_| bad(url, "bad port"))?;
        Ok(Url {
            scheme: scheme.to_string(),
            host,
            port,
        })
    }

    /// The URL of a socket address.
    pub fn from_socket(scheme: &str, addr: SocketAddr) -> Url {
        let (ip, scope) = match addr {
            SocketAddr::V4(a) => (IpAddr::V4(*a.ip()), 0),
            SocketAddr::V6(a) => (IpAddr::V6(*a.ip()), a.scope_id()),
        };
        Url {
            scheme: scheme.into(),
            host: Host::Ip { ip, scope },
            port: addr.port(),
        }
    }

    /// Resolves to socket addresses (names through the system resolver).
    pub async fn socket_addrs(&self) -> Result<Vec<SocketAddr>, Error> {
        match &self.host {
            Host::Ip {
                ip: IpAddr::V6(ip),
                scope,
            } => Ok(vec![SocketAddr::V6(SocketAddrV6::new(
                *ip, self.port, 0, *scope,
            ))]),
            Host::Ip { ip, .. } => Ok(vec![SocketAddr::new(*ip, self.port)]),
            Host::Name(name) => {
                let addrs: Vec<SocketAddr> = tokio::net::lookup_host((name.as_str(), self.port))
                    .await
                    .map_err(|e| Error::Connect {
                        url: self.to_string(),
                        source: std::sync::Arc::new(e),
                    })?
                    .collect();
                if addrs.is_empty() {
                    return Err(Error::invalid(format!("{name} resolves to no address")));
                }
                Ok(addrs)
            }
        }
    }
}

impl fmt::Display for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.host {
            Host::Ip {
                ip: IpAddr::V6(ip),
                scope: 0,
            } => write!(f, "{}://[{ip}]:{}", self.scheme, self.port),
            Host::Ip {
                ip: IpAddr::V6(ip),
                scope,
            } => write!(
                f,
                "{}://[{ip}%{}]:{}",
                self.scheme,
                scope_name(*scope),
                self.port
            ),
            Host::Ip { ip, .. } => write!(f, "{}://{ip}:{}", self.scheme, self.port),
            Host::Name(n) => write!(f, "{}://{n}:{}", self.scheme, self.port),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_form() {
        let u = Url::parse("tcp://127.0.0.1:5000").unwrap();
        assert_eq!(u.port, 5000);
        assert_eq!(u.to_string(), "tcp://127.0.0.1:5000");
        let u = Url::parse("tcp://[::1]:0").unwrap();
        assert_eq!(u.to_string(), "tcp://[::1]:0");
        let u = Url::parse("tcp://localhost:7").unwrap();
        assert_eq!(u.host, Host::Name("localhost".into()));
        let u = Url::parse("tcp://[fe80::1%lo]:9").unwrap();
        match u.host {
            Host::Ip { scope, .. } => assert!(scope > 0),
            _ => panic!("expected an IP"),
        }
        assert_eq!(u.to_string(), "tcp://[fe80::1%lo]:9");
        let u = Url::parse("tcp://[fe80::1%3]:9").unwrap();
        assert!(matches!(u.host, Host::Ip { scope: 3, .. }));
    }

    #[test]
    fn refuses_malformed_urls_with_a_reason() {
        for (u, why) in [
            ("127.0.0.1:5", "scheme"),
            ("tcp://127.0.0.1", "port"),
            ("tcp://127.0.0.1:99999", "bad port"),
            ("tcp://[::1:5", "]"),
            ("tcp://::1:5", "brackets"),
            ("tcp://[fe80::1%nosuchif0]:5", "no network interface"),
            ("tcp://:5", "empty host"),
        ] {
            let e = Url::parse(u).unwrap_err().to_string();
            assert!(e.contains(why), "{u}: {e}");
        }
    }
}
