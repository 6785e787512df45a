//! The daemon control channel's connections (docs/kv.md §10, "Failed
//! senders").
//!
//! A sender's daemon keeps one TCP connection ([`ControlSession`]) to the
//! receiver's daemon for as long as it sends on a channel: `join` on it,
//! then a `progress` report every [`progress_interval`], then `finished`
//! (its FIN was acknowledged) or `fail`. What the receiver's daemon makes of
//! them (joined, finished, failed channels; when a silent one is declared
//! failed) is the sans-IO [`fanin_proto::kv::TaskLedger`]. A sender is
//! declared failed when
//! * the connection closes before `finished` (the daemon was killed or its
//!   host rebooted: the kernel closes the socket), or
//! * no report showed progress (more packets acknowledged) for the task's
//!   `silence_ms` (a hung daemon, a host gone without closing the socket,
//!   or a sender cut off from the switch).

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

pub use fanin_proto::kv::{progress_interval, ProgressReport};
use serde_json::Value;

/// A connection to another daemon's control channel: one JSON line out,
/// one JSON line back, as often as needed.
pub struct ControlSession {
    writer: TcpStream,
    reader: BufReader<TcpStream>,
}

/// Write `msg` and a newline with one `write` (a JSON line of the local API
/// or the daemons' control channel). `writeln!` with a `Value` would issue a
/// write per formatting piece: tiny TCP segments, and a reader that sees the
/// line in fragments.
pub fn write_line(w: &mut (impl Write + ?Sized), msg: &Value) -> std::io::Result<()> {
    let mut line = msg.to_string();
    line.push('\n');
    w.write_all(line.as_bytes())?;
    w.flush()
}

impl ControlSession {
    pub fn connect(addr: &str) -> std::io::Result<Self> {
        let addr: SocketAddr = addr.parse().map_err(|_| std::io::Error::other(format!("bad address {addr:?}")))?;
        let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
        stream.set_read_timeout(Some(Duration::from_secs(10)))?;
        stream.set_nodelay(true)?;
        Ok(Self { reader: BufReader::new(stream.try_clone()?), writer: stream })
    }

    pub fn call(&mut self, msg: &Value) -> std::io::Result<Value> {
        write_line(&mut self.writer, msg)?;
        let mut line = String::new();
        if self.reader.read_line(&mut line)? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the peer closed the connection"));
        }
        serde_json::from_str(&line).map_err(std::io::Error::other)
    }
}
