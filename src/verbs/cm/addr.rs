//! Socket addresses to and from the `struct sockaddr` the connection
//! manager takes and reports.

use std::mem;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::sys;

/// A `sockaddr_storage` holding an IPv4 or IPv6 address, for the calls
/// that take a `struct sockaddr *`.
pub(super) struct RawAddr(libc::sockaddr_storage);

impl RawAddr {
    pub(super) fn new(addr: SocketAddr) -> Self {
        // SAFETY: all-zero bytes are a valid sockaddr_storage.
        let mut storage: libc::sockaddr_storage = unsafe { mem::zeroed() };
        match addr {
            SocketAddr::V4(v4) => {
                let sin = libc::sockaddr_in {
                    sin_family: libc::AF_INET as libc::sa_family_t,
                    sin_port: v4.port().to_be(),
                    sin_addr: libc::in_addr {
                        s_addr: u32::from(*v4.ip()).to_be(),
                    },
                    sin_zero: [0; 8],
                };
                // SAFETY: sockaddr_storage is larger than and aligned for
                // every sockaddr type.
                unsafe { std::ptr::write((&raw mut storage).cast(), sin) };
            }
            SocketAddr::V6(v6) => {
                let sin6 = libc::sockaddr_in6 {
                    sin6_family: libc::AF_INET6 as libc::sa_family_t,
                    sin6_port: v6.port().to_be(),
                    sin6_flowinfo: v6.flowinfo().to_be(),
                    sin6_addr: libc::in6_addr {
                        s6_addr: v6.ip().octets(),
                    },
                    sin6_scope_id: v6.scope_id(),
                };
                // SAFETY: as above.
                unsafe { std::ptr::write((&raw mut storage).cast(), sin6) };
            }
        }
        Self(storage)
    }

    /// The pointer the rdma_cm calls take (they only read through it).
    pub(super) fn as_ptr(&mut self) -> *mut sys::sockaddr {
        (&raw mut self.0).cast()
    }
}

/// Reads an IPv4 or IPv6 address; `None` for any other family (an unset
/// address has family 0).
///
/// # Safety
/// `addr` must be NULL or point at a sockaddr whose storage is as large
/// as its family says (the rdma_cm id's route addresses are
/// `sockaddr_storage`-sized unions).
pub(super) unsafe fn read(addr: *const sys::sockaddr) -> Option<SocketAddr> {
    if addr.is_null() {
        return None;
    }
    // SAFETY: the caller vouches for the pointer; the family comes first in
    // every sockaddr.
    let family = i32::from(unsafe { (*addr.cast::<libc::sockaddr>()).sa_family });
    match family {
        libc::AF_INET => {
            // SAFETY: the family says this is a sockaddr_in.
            let sin = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in>()) };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr)),
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this is a sockaddr_in6.
            let sin6 = unsafe { std::ptr::read_unaligned(addr.cast::<libc::sockaddr_in6>()) };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(sin6.sin6_addr.s6_addr),
                u16::from_be(sin6.sin6_port),
                u32::from_be(sin6.sin6_flowinfo),
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_round_trip() {
        for text in [
            "10.77.0.1:7174",
            "0.0.0.0:0",
            "[fe80::1%3]:9",
            "[::1]:65535",
        ] {
            let addr: SocketAddr = text.parse().unwrap();
            let mut raw = RawAddr::new(addr);
            // SAFETY: `raw` is a full sockaddr_storage.
            assert_eq!(unsafe { read(raw.as_ptr()) }, Some(addr), "{text}");
        }
        // SAFETY: NULL is allowed.
        assert_eq!(unsafe { read(std::ptr::null()) }, None);
    }
}
