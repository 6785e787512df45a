//! The MTU of the interfaces a bound address receives on, so a protocol
//! above can size its datagrams to one frame (no IP fragmentation, where
//! losing one fragment loses the whole datagram).

use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, SocketAddr};

/// One interface that is up: its name, whether it is a loopback, its MTU
/// and its addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Interface {
    pub name: String,
    pub loopback: bool,
    pub mtu: u32,
    pub addrs: Vec<IpAddr>,
}

/// The interfaces that are up, with their MTUs (getifaddrs + SIOCGIFMTU,
/// so it sees the caller's network namespace, not sysfs's).
pub fn interfaces() -> io::Result<Vec<Interface>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut out: Vec<Interface> = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: a node of the list getifaddrs returned, valid until freeifaddrs.
        let ifa = unsafe { &*cur };
        cur = ifa.ifa_next;
        if ifa.ifa_flags & libc::IFF_UP as u32 == 0 || ifa.ifa_name.is_null() {
            continue;
        }
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let name = unsafe { CStr::from_ptr(ifa.ifa_name) }.to_string_lossy().into_owned();
        let addr = sockaddr_ip(ifa.ifa_addr);
        match out.iter_mut().find(|i| i.name == name) {
            Some(i) => i.addrs.extend(addr),
            None => out.push(Interface {
                loopback: ifa.ifa_flags & libc::IFF_LOOPBACK as u32 != 0,
                mtu: 0,
                addrs: addr.into_iter().collect(),
                name,
            }),
        }
    }
    // SAFETY: the list came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    for i in &mut out {
        i.mtu = interface_mtu(&i.name)?;
    }
    Ok(out)
}

/// The MTU datagrams sent to and from `addr` (a bound local address) can
/// count on: the interface that owns `addr`, or for an unspecified address
/// (0.0.0.0, ::) the smallest MTU of the interfaces that are up, loopbacks
/// left out unless nothing else is up. None when no interface matches.
pub fn bound_mtu(addr: &SocketAddr) -> io::Result<Option<u32>> {
    Ok(mtu_for(addr.ip(), &interfaces()?))
}

fn mtu_for(ip: IpAddr, ifs: &[Interface]) -> Option<u32> {
    if ip.is_unspecified() {
        let external = ifs.iter().filter(|i| !i.loopback && i.mtu > 0).map(|i| i.mtu).min();
        return external.or_else(|| ifs.iter().filter(|i| i.mtu > 0).map(|i| i.mtu).min());
    }
    if ip.is_loopback() {
        // 127.0.0.0/8 is all lo's, though only 127.0.0.1 is listed
        return ifs.iter().filter(|i| i.loopback).map(|i| i.mtu).min();
    }
    ifs.iter().filter(|i| i.addrs.contains(&ip)).map(|i| i.mtu).min()
}

fn sockaddr_ip(sa: *const libc::sockaddr) -> Option<IpAddr> {
    if sa.is_null() {
        return None;
    }
    // SAFETY: sa points to a sockaddr of the family it names.
    unsafe {
        match (*sa).sa_family as i32 {
            libc::AF_INET => {
                let v4 = &*(sa as *const libc::sockaddr_in);
                Some(IpAddr::from(u32::from_be(v4.sin_addr.s_addr).to_be_bytes()))
            }
            libc::AF_INET6 => {
                let v6 = &*(sa as *const libc::sockaddr_in6);
                Some(IpAddr::from(v6.sin6_addr.s6_addr))
            }
            _ => None,
        }
    }
}

fn interface_mtu(name: &str) -> io::Result<u32> {
    // SAFETY: a plain datagram socket for the ioctl, closed below.
    let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: ifreq is plain data; all-zero is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(name.bytes().take(libc::IFNAMSIZ - 1)) {
        *dst = src as libc::c_char;
    }
    // SAFETY: SIOCGIFMTU reads ifr_name and writes ifr_ifru.ifru_mtu.
    let rc = unsafe { libc::ioctl(fd, libc::SIOCGIFMTU as _, &mut req) };
    let err = io::Error::last_os_error();
    // SAFETY: fd is ours.
    unsafe { libc::close(fd) };
    if rc < 0 {
        return Err(err);
    }
    // SAFETY: the ioctl succeeded, so the union holds the MTU.
    Ok(unsafe { req.ifr_ifru.ifru_mtu }.max(0) as u32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_up_and_has_its_mtu() {
        let ifs = interfaces().unwrap();
        let lo = ifs.iter().find(|i| i.loopback).expect("a loopback interface");
        assert!(lo.mtu >= 1280, "{lo:?}");
        assert_eq!(bound_mtu(&"127.0.0.1:9000".parse().unwrap()).unwrap(), Some(lo.mtu));
        assert!(bound_mtu(&"0.0.0.0:9000".parse().unwrap()).unwrap().is_some());
        // an address no interface has
        assert_eq!(bound_mtu(&"192.0.2.77:9000".parse().unwrap()).unwrap(), None);
    }

    #[test]
    fn an_unspecified_address_takes_the_smallest_mtu_but_not_loopbacks() {
        let i = |name: &str, loopback, mtu| Interface { name: name.into(), loopback, mtu, addrs: vec![] };
        let ifs = [i("lo", true, 65536), i("eth0", false, 9000), i("veth1", false, 1500)];
        assert_eq!(mtu_for("0.0.0.0".parse().unwrap(), &ifs), Some(1500));
        assert_eq!(mtu_for("0.0.0.0".parse().unwrap(), &ifs[..1]), Some(65536));
        assert_eq!(mtu_for("127.0.0.5".parse().unwrap(), &ifs), Some(65536));
    }
}
