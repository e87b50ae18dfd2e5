//! The TCP backend's transport: one connection per pair of ranks, framed messages, and a
//! mailbox per process into which a reader thread per peer files every arriving message.
//!
//! A frame is a [`MessageHeader`] (dtype and shape, 64 bytes), the group id, the call's sequence
//! number, the channel (a collective's phase, or point-to-point), the sender's description of
//! its call (for mismatch errors), then the elements' raw little-endian bytes. Frames to one
//! peer are written whole under that peer's lock, so frames from several threads never
//! interleave, and TCP keeps them in order.

use std::collections::{HashMap, VecDeque};
use std::io::{BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream, ToSocketAddrs, UdpSocket};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use meshgrad_tensor::storage::CpuStorage;
use meshgrad_tensor::{cpu_map, CommErrorKind, DType, Error, Result};

use crate::comm::rendezvous::MessageHeader;
use crate::comm::store::TcpStore;

/// Bytes that open every connection's handshake.
const HELLO: &[u8; 4] = b"MGT1";

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Which stream of messages a frame belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(super) enum Channel {
    /// Phase `phase` of collective number `seq` of a group.
    Collective { seq: u64, phase: u8 },
    /// Point-to-point messages (in send order per sender).
    P2p,
}

/// The elements of a message: their dtype and raw little-endian bytes.
pub(super) type Bytes<'a> = (DType, &'a [u8]);

/// A message as it arrived.
pub(super) struct Message {
    /// The shape the sender gave.
    pub dims: Vec<usize>,
    /// The sender's description of its call, e.g. `all_reduce(sum, f32 [4])`.
    pub call: String,
    /// The elements.
    pub data: CpuStorage,
}

/// Why a wait for a message ended without one.
pub(super) enum Missing {
    /// Nothing came before the deadline.
    Timeout,
    /// The connection to the sender closed: `None` when it ended cleanly (the process exited),
    /// else the error that broke it.
    Gone(Option<String>),
}

type Key = (u64, Channel, usize);

#[derive(Default)]
struct Boxes {
    queues: HashMap<Key, VecDeque<Message>>,
    /// Peers whose connection closed, with the error when it broke.
    gone: HashMap<usize, Option<String>>,
}

/// Messages that arrived and wait to be taken, by (group, channel, sender's global rank).
#[derive(Default)]
pub(super) struct Mailbox {
    boxes: Mutex<Boxes>,
    arrived: Condvar,
}

impl Mailbox {
    fn put(&self, key: Key, m: Message) {
        lock(&self.boxes)
            .queues
            .entry(key)
            .or_default()
            .push_back(m);
        self.arrived.notify_all();
    }

    fn close(&self, peer: usize, reason: Option<String>) {
        lock(&self.boxes).gone.entry(peer).or_insert(reason);
        self.arrived.notify_all();
    }

    /// Whether a message for `key` is waiting.
    pub(super) fn has(&self, group: u64, chan: Channel, src: usize) -> bool {
        lock(&self.boxes)
            .queues
            .get(&(group, chan, src))
            .is_some_and(|q| !q.is_empty())
    }

    /// Takes the next message for (`group`, `chan`, `src`), waiting until `deadline`. Messages
    /// that arrived before the sender's connection closed are still delivered.
    pub(super) fn take(
        &self,
        group: u64,
        chan: Channel,
        src: usize,
        deadline: Instant,
    ) -> std::result::Result<Message, Missing> {
        let key = (group, chan, src);
        let mut b = lock(&self.boxes);
        loop {
            if let Some(q) = b.queues.get_mut(&key) {
                if let Some(m) = q.pop_front() {
                    if q.is_empty() {
                        b.queues.remove(&key);
                    }
                    return Ok(m);
                }
            }
            if let Some(why) = b.gone.get(&src) {
                return Err(Missing::Gone(why.clone()));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Missing::Timeout);
            }
            b = self
                .arrived
                .wait_timeout(b, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// The connections of one process to every other rank of the job, and its mailbox.
pub(super) struct Net {
    /// Writers to each peer (`None` at this rank's own index).
    peers: Vec<Option<Mutex<BufWriter<TcpStream>>>>,
    /// Where the reader threads file arriving messages.
    pub mailbox: Arc<Mailbox>,
}

impl Net {
    /// Connects rank `rank` of `world` ranks to all the others: each rank listens on a free
    /// port, publishes `host:port` in `store`, connects to every lower rank and accepts the
    /// higher ones, all within `timeout`. `host` is the address the others reach this rank at.
    pub(super) fn connect(
        rank: usize,
        world: usize,
        host: &str,
        store: &TcpStore,
        timeout: Duration,
    ) -> Result<Net> {
        let fail = |what: String| Error::msg(format!("rank {rank}: tcp backend: {what}"));
        let listener = TcpListener::bind(("0.0.0.0", 0))
            .map_err(|e| fail(format!("cannot listen on a free port: {e}")))?;
        let port = listener
            .local_addr()
            .map_err(|e| fail(e.to_string()))?
            .port();
        store.set(&addr_key(rank), format!("{host}:{port}").as_bytes())?;
        let deadline = Instant::now() + timeout;
        let mut streams: Vec<Option<TcpStream>> = (0..world).map(|_| None).collect();
        for (peer, slot) in streams.iter_mut().enumerate().take(rank) {
            let addr = String::from_utf8_lossy(&store.get(&addr_key(peer))?).into_owned();
            let mut s = connect_until(&addr, deadline)
                .map_err(|e| fail(format!("cannot connect to rank {peer} at {addr}: {e}")))?;
            let mut hello = HELLO.to_vec();
            hello.extend_from_slice(&(rank as u32).to_le_bytes());
            s.write_all(&hello)
                .map_err(|e| fail(format!("handshake with rank {peer}: {e}")))?;
            *slot = Some(s);
        }
        listener
            .set_nonblocking(true)
            .map_err(|e| fail(e.to_string()))?;
        let mut expected = world - 1 - rank;
        while expected > 0 {
            match listener.accept() {
                Ok((mut s, from)) => {
                    s.set_nonblocking(false).map_err(|e| fail(e.to_string()))?;
                    let left = deadline.saturating_duration_since(Instant::now());
                    let _ = s.set_read_timeout(Some(left.max(Duration::from_secs(1))));
                    let mut hello = [0u8; 8];
                    s.read_exact(&mut hello)
                        .map_err(|e| fail(format!("handshake from {from}: {e}")))?;
                    let peer = u32::from_le_bytes(hello[4..].try_into().expect("4 bytes")) as usize;
                    if &hello[..4] != HELLO || peer <= rank || peer >= world {
                        return Err(fail(format!(
                            "{from} is not a meshgrad rank of this job above {rank}"
                        )));
                    }
                    let _ = s.set_read_timeout(None);
                    if streams[peer].replace(s).is_some() {
                        return Err(fail(format!("rank {peer} connected twice")));
                    }
                    expected -= 1;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        let missing: Vec<String> = (rank + 1..world)
                            .filter(|&p| streams[p].is_none())
                            .map(|p| p.to_string())
                            .collect();
                        return Err(fail(format!(
                            "ranks {} did not connect within {:?}",
                            missing.join(","),
                            timeout
                        )));
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(fail(format!("accept: {e}"))),
            }
        }
        let mailbox = Arc::new(Mailbox::default());
        let mut peers = Vec::with_capacity(world);
        for (peer, s) in streams.into_iter().enumerate() {
            let Some(s) = s else {
                peers.push(None);
                continue;
            };
            let _ = s.set_nodelay(true);
            let reader = s.try_clone().map_err(|e| fail(e.to_string()))?;
            let mb = mailbox.clone();
            std::thread::Builder::new()
                .name(format!("meshgrad-tcp-{rank}<-{peer}"))
                .spawn(move || read_loop(BufReader::with_capacity(1 << 16, reader), peer, mb))
                .map_err(|e| fail(format!("cannot start a reader thread: {e}")))?;
            peers.push(Some(Mutex::new(BufWriter::with_capacity(1 << 16, s))));
        }
        Ok(Net { peers, mailbox })
    }

    /// Writes one frame to global rank `dst`.
    pub(super) fn send(
        &self,
        dst: usize,
        group: u64,
        chan: Channel,
        call: &str,
        dims: &[usize],
        data: Bytes<'_>,
    ) -> std::io::Result<()> {
        let peer = self
            .peers
            .get(dst)
            .and_then(Option::as_ref)
            .ok_or_else(|| std::io::Error::other(format!("no connection to rank {dst}")))?;
        let mut w = lock(peer);
        write_frame(&mut *w, group, chan, call, dims, data)?;
        w.flush()
    }
}

impl Drop for Net {
    fn drop(&mut self) {
        // Ends the peers' reader threads for this rank and this rank's own readers.
        for p in self.peers.iter().flatten() {
            let w = lock(p);
            let _ = w.get_ref().shutdown(Shutdown::Both);
        }
    }
}

fn addr_key(rank: usize) -> String {
    format!("tcp/addr/{rank}")
}

/// Connects to `addr`, retrying until `deadline`.
fn connect_until(addr: &str, deadline: Instant) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("the address resolves to nothing");
    loop {
        for a in addr.to_socket_addrs()? {
            match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
                Ok(s) => return Ok(s),
                Err(e) => last = e,
            }
        }
        if Instant::now() >= deadline {
            return Err(last);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The address other ranks reach this one at: `MESHGRAD_TCP_HOST` when set, else the local
/// interface that routes to the store's host (`master`), else the loopback address.
pub(super) fn local_host(master: Option<&str>) -> String {
    if let Ok(h) = std::env::var("MESHGRAD_TCP_HOST") {
        if !h.trim().is_empty() {
            return h.trim().to_string();
        }
    }
    let routed = || -> Option<String> {
        let master = master?;
        let target = (master, 9).to_socket_addrs().ok()?.find(|a| a.is_ipv4())?;
        if target.ip().is_loopback() {
            return None;
        }
        let sock = UdpSocket::bind("0.0.0.0:0").ok()?;
        sock.connect(target).ok()?;
        Some(sock.local_addr().ok()?.ip().to_string())
    };
    routed().unwrap_or_else(|| "127.0.0.1".to_string())
}

/// Whether an I/O error means the peer's process is gone (it closed or reset the connection).
fn peer_gone(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        ErrorKind::ConnectionReset | ErrorKind::ConnectionAborted | ErrorKind::BrokenPipe
    )
}

/// The error of a failed write to global rank `peer`: the peer exited when its connection is
/// gone, else the I/O error.
pub(super) fn write_error(peer: usize, e: &std::io::Error) -> CommErrorKind {
    if peer_gone(e) {
        CommErrorKind::PeerExited { ranks: vec![peer] }
    } else {
        CommErrorKind::Backend(format!("writing to rank {peer}: {e}"))
    }
}

/// Writes one frame (see the module docs).
fn write_frame(
    w: &mut impl Write,
    group: u64,
    chan: Channel,
    call: &str,
    dims: &[usize],
    (dtype, bytes): Bytes<'_>,
) -> std::io::Result<()> {
    let header = MessageHeader {
        dtype,
        dims: dims.to_vec(),
    }
    .encode()
    .map_err(|e| std::io::Error::other(e.to_string()))?;
    let (seq, kind, phase) = match chan {
        Channel::Collective { seq, phase } => (seq, 0u8, phase),
        Channel::P2p => (0, 1u8, 0),
    };
    let call = &call.as_bytes()[..call.len().min(u16::MAX as usize)];
    w.write_all(&header)?;
    w.write_all(&group.to_le_bytes())?;
    w.write_all(&seq.to_le_bytes())?;
    w.write_all(&[kind, phase])?;
    w.write_all(&(call.len() as u16).to_le_bytes())?;
    w.write_all(call)?;
    w.write_all(bytes)
}

/// Reads frames from `peer` into `mailbox` until the connection closes.
fn read_loop(mut r: BufReader<TcpStream>, peer: usize, mailbox: Arc<Mailbox>) {
    loop {
        match read_frame(&mut r) {
            Ok(Some((key, m))) => mailbox.put((key.0, key.1, peer), m),
            Ok(None) => {
                mailbox.close(peer, None);
                return;
            }
            // A process that ends (or is killed) with unread data in its socket resets the
            // connection instead of closing it: it exited all the same.
            Err(e) if peer_gone(&e) => {
                mailbox.close(peer, None);
                return;
            }
            Err(e) => {
                mailbox.close(peer, Some(format!("its connection failed: {e}")));
                return;
            }
        }
    }
}

/// One frame, or `None` at a clean end of the stream.
fn read_frame(r: &mut impl Read) -> std::io::Result<Option<((u64, Channel), Message)>> {
    let mut header = [0u8; MessageHeader::BYTES];
    match r.read_exact(&mut header) {
        Ok(()) => {}
        Err(e) if e.kind() == ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let h = MessageHeader::decode(&header).map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut fixed = [0u8; 20];
    r.read_exact(&mut fixed)?;
    let group = u64::from_le_bytes(fixed[..8].try_into().expect("8 bytes"));
    let seq = u64::from_le_bytes(fixed[8..16].try_into().expect("8 bytes"));
    let chan = match fixed[16] {
        0 => Channel::Collective {
            seq,
            phase: fixed[17],
        },
        1 => Channel::P2p,
        k => return Err(std::io::Error::other(format!("unknown frame kind {k}"))),
    };
    let call_len = u16::from_le_bytes(fixed[18..20].try_into().expect("2 bytes")) as usize;
    let mut call = vec![0u8; call_len];
    r.read_exact(&mut call)?;
    let mut data = CpuStorage::zeros(h.dtype, h.elem_count());
    cpu_map!(&mut data, v => r.read_exact(bytemuck::cast_slice_mut(v.as_mut_slice())))?;
    Ok(Some((
        (group, chan),
        Message {
            dims: h.dims,
            call: String::from_utf8_lossy(&call).into_owned(),
            data,
        },
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let data = CpuStorage::F32(vec![1.5, -2.0, 3.25]);
        let mut buf = Vec::new();
        let chan = Channel::Collective { seq: 11, phase: 1 };
        let bytes = (data.dtype(), data.as_bytes());
        write_frame(&mut buf, 7, chan, "abc", &[3], bytes).unwrap();
        write_frame(&mut buf, 9, Channel::P2p, "", &[1, 3], bytes).unwrap();
        let mut r = &buf[..];
        let ((group, chan), m) = read_frame(&mut r).unwrap().unwrap();
        assert_eq!(group, 7);
        assert_eq!(chan, Channel::Collective { seq: 11, phase: 1 });
        assert_eq!(m.call, "abc");
        assert_eq!(m.dims, vec![3]);
        assert_eq!(m.data.as_bytes(), data.as_bytes());
        let ((group, chan), m) = read_frame(&mut r).unwrap().unwrap();
        assert_eq!((group, chan, m.dims), (9, Channel::P2p, vec![1, 3]));
        assert!(read_frame(&mut r).unwrap().is_none(), "clean end");
        let mut short = &buf[..buf.len() - 1];
        assert!(
            read_frame(&mut short).unwrap().is_some(),
            "the whole first frame"
        );
        assert!(read_frame(&mut short).is_err(), "a truncated frame");
    }
}
