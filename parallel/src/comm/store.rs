//! A small TCP key-value store for rendezvous: rank 0 serves it at `MASTER_ADDR:MASTER_PORT`,
//! the other ranks connect to it. This is how the ranks of a multi-process job share what one of
//! them creates (NCCL's unique id, a run folder's name) and wait for each other before any
//! communicator exists.
//!
//! * [`TcpStore::set`] stores bytes under a key (replacing any earlier value);
//!   [`TcpStore::get`] returns them, waiting until the key is set, up to the store's timeout;
//!   [`TcpStore::add`] adds to a counter atomically; [`TcpStore::barrier`] returns once every
//!   rank has entered the barrier of that name.
//! * The server runs in rank 0's process, one thread per connection; rank 0 itself uses the
//!   table directly. It stops when rank 0's [`TcpStore`] is dropped: the drop first waits, up to
//!   the store's timeout, for the other ranks to disconnect (to drop their [`TcpStore`]), so
//!   the replies to their last requests (a final [`TcpStore::barrier`]) reach them.
//! * Protocol (std::net only): every request is an op byte (`1` set, `2` get, `3` add), the key
//!   (a u32 length, little-endian, then UTF-8 bytes) and an operand (set: a u32 length and the
//!   value; get: the wait in milliseconds as a u64; add: an i64). Every reply is a status byte
//!   (`0` ok, `1` timed out) and, when ok, a u32 length and the value (add: the new count as 8
//!   bytes, little-endian).
//!
//! Errors are one line naming the rank, the store's address and the key, e.g.
//! `rank 2: store 127.0.0.1:29500: get "nccl_id": not set within 30s`.

use std::collections::HashMap;
use std::io::{BufReader, BufWriter, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use meshgrad_tensor::{Error, Result};

use super::env::RankEnv;
use super::in_process::fmt_duration;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_ADD: u8 = 3;
const OK: u8 = 0;
const TIMED_OUT: u8 = 1;
/// The largest key or value accepted (a bad peer cannot make the server allocate more).
const MAX_LEN: u32 = 256 << 20;

/// The table and a condition variable signalled on every change.
#[derive(Default)]
struct Table {
    map: Mutex<HashMap<String, Vec<u8>>>,
    cv: Condvar,
}

impl Table {
    fn set(&self, key: &str, value: Vec<u8>) {
        self.map
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key.to_string(), value);
        self.cv.notify_all();
    }

    /// The value of `key`, waiting up to `wait` for it to be set.
    fn get(&self, key: &str, wait: Duration) -> Option<Vec<u8>> {
        let deadline = Instant::now() + wait;
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(v) = map.get(key) {
                return Some(v.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            map = self
                .cv
                .wait_timeout(map, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    fn add(&self, key: &str, delta: i64) -> i64 {
        let mut map = self.map.lock().unwrap_or_else(|e| e.into_inner());
        let old = map
            .get(key)
            .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
            .map(i64::from_le_bytes)
            .unwrap_or(0);
        let new = old.wrapping_add(delta);
        map.insert(key.to_string(), new.to_le_bytes().to_vec());
        self.cv.notify_all();
        new
    }
}

/// Rank 0's server: the listener thread and its stop flag.
struct Server {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    /// The open connections, shut down when the server stops.
    conns: Arc<Mutex<Vec<TcpStream>>>,
    /// How many connection threads run, and a signal when one ends.
    active: Arc<(Mutex<usize>, Condvar)>,
    /// How long dropping the server waits for the other ranks to disconnect.
    linger: Duration,
    thread: Option<JoinHandle<()>>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop; it sees the flag and returns.
        let wake = match self.addr {
            SocketAddr::V4(a) if a.ip().is_unspecified() => {
                SocketAddr::from(([127, 0, 0, 1], a.port()))
            }
            a => a,
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        // Let the other ranks finish their last requests (the reply to the final barrier's
        // set may still be on its way) and disconnect, up to the linger time.
        let deadline = Instant::now() + self.linger;
        let (count, cv) = &*self.active;
        let mut n = count.lock().unwrap_or_else(|e| e.into_inner());
        while *n > 0 {
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            n = cv
                .wait_timeout(n, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        drop(n);
        for c in self
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .drain(..)
        {
            let _ = c.shutdown(Shutdown::Both);
        }
    }
}

enum Backend {
    /// Rank 0: the table itself, served to the others.
    Local { table: Arc<Table>, server: Server },
    /// Another rank: a connection to rank 0's server.
    Remote(Mutex<TcpStream>),
}

/// One rank's handle on the job's key-value store (see the [module docs](self)).
pub struct TcpStore {
    backend: Backend,
    rank: usize,
    world_size: usize,
    addr: String,
    timeout: Duration,
}

impl std::fmt::Debug for TcpStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TcpStore(rank {} of {} at {})",
            self.rank, self.world_size, self.addr
        )
    }
}

impl TcpStore {
    /// Rank 0's store: listens on all interfaces at `port` (0 picks a free port; see
    /// [`TcpStore::port`]) and serves the other `world_size - 1` ranks. `timeout` bounds every
    /// wait of [`TcpStore::get`] and [`TcpStore::barrier`].
    pub fn serve(port: u16, world_size: usize, timeout: Duration) -> Result<TcpStore> {
        let listener = TcpListener::bind(("0.0.0.0", port))
            .map_err(|e| Error::msg(format!("rank 0: store: cannot listen on port {port}: {e}")))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::msg(format!("rank 0: store: {e}")))?;
        let table = Arc::new(Table::default());
        let stop = Arc::new(AtomicBool::new(false));
        let conns = Arc::new(Mutex::new(Vec::new()));
        let active = Arc::new((Mutex::new(0usize), Condvar::new()));
        let thread = {
            let table = table.clone();
            let stop = stop.clone();
            let conns = conns.clone();
            let active = active.clone();
            std::thread::Builder::new()
                .name("meshgrad-store".into())
                .spawn(move || accept_loop(listener, table, stop, conns, active))
                .map_err(|e| Error::msg(format!("rank 0: store: cannot start its thread: {e}")))?
        };
        Ok(TcpStore {
            backend: Backend::Local {
                table,
                server: Server {
                    addr,
                    stop,
                    conns,
                    active,
                    linger: timeout,
                    thread: Some(thread),
                },
            },
            rank: 0,
            world_size,
            addr: format!("0.0.0.0:{}", addr.port()),
            timeout,
        })
    }

    /// Rank `rank`'s connection to the store at `host:port`, retrying until `timeout` while rank
    /// 0 is not listening yet.
    pub fn connect(
        host: &str,
        port: u16,
        rank: usize,
        world_size: usize,
        timeout: Duration,
    ) -> Result<TcpStore> {
        let addr = format!("{host}:{port}");
        // A name that does not resolve will not start to: fail now, not after the timeout.
        addr.to_socket_addrs().map_err(|e| {
            Error::msg(format!(
                "rank {rank}: store {addr}: the address does not resolve: {e}"
            ))
        })?;
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_millis(20);
        let stream = loop {
            let attempt = addr.to_socket_addrs().and_then(|mut addrs| {
                let mut last = std::io::Error::other("the name resolves to no address");
                for a in addrs.by_ref() {
                    match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
                        Ok(s) => return Ok(s),
                        Err(e) => last = e,
                    }
                }
                Err(last)
            });
            match attempt {
                Ok(s) => break s,
                Err(e) if Instant::now() + pause >= deadline => {
                    return Err(Error::msg(format!(
                        "rank {rank}: store {addr}: could not connect within {}: {e}",
                        fmt_duration(timeout)
                    )))
                }
                Err(_) => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(500));
                }
            }
        };
        let _ = stream.set_nodelay(true);
        Ok(TcpStore {
            backend: Backend::Remote(Mutex::new(stream)),
            rank,
            world_size,
            addr,
            timeout,
        })
    }

    /// The store of the job described by `env`: rank 0 serves at `MASTER_PORT`, the others
    /// connect to `MASTER_ADDR:MASTER_PORT` (both must be set, except on a single process).
    pub fn from_env(env: &RankEnv, timeout: Duration) -> Result<TcpStore> {
        let port = env.master_port.ok_or_else(|| {
            Error::msg(format!(
                "rank {}: MASTER_PORT is not set: the ranks cannot find rank 0's store",
                env.rank
            ))
        })?;
        if env.rank == 0 {
            TcpStore::serve(port, env.world_size, timeout)
        } else {
            let host = env.master_addr.as_deref().ok_or_else(|| {
                Error::msg(format!(
                    "rank {}: MASTER_ADDR is not set: the ranks cannot find rank 0's store",
                    env.rank
                ))
            })?;
            TcpStore::connect(host, port, env.rank, env.world_size, timeout)
        }
    }

    /// The port the store listens on (rank 0) or connects to.
    pub fn port(&self) -> u16 {
        match &self.backend {
            Backend::Local { server, .. } => server.addr.port(),
            Backend::Remote(s) => s
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .peer_addr()
                .map(|a| a.port())
                .unwrap_or(0),
        }
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    fn err(&self, what: &str, key: &str, reason: impl std::fmt::Display) -> Error {
        Error::msg(format!(
            "rank {}: store {}: {what} {key:?}: {reason}",
            self.rank, self.addr
        ))
    }

    /// One request and its reply over the connection.
    fn request(&self, what: &str, key: &str, op: u8, operand: &[u8]) -> Result<Option<Vec<u8>>> {
        let Backend::Remote(stream) = &self.backend else {
            return Err(self.err(what, key, "internal error: rank 0 has no connection"));
        };
        let mut stream = stream.lock().unwrap_or_else(|e| e.into_inner());
        let io = |e: std::io::Error| {
            self.err(
                what,
                key,
                format!("the connection to rank 0 failed (did rank 0 exit?): {e}"),
            )
        };
        let mut msg = Vec::with_capacity(1 + 4 + key.len() + operand.len());
        msg.push(op);
        msg.extend_from_slice(&(key.len() as u32).to_le_bytes());
        msg.extend_from_slice(key.as_bytes());
        msg.extend_from_slice(operand);
        stream.write_all(&msg).map_err(io)?;
        let mut status = [0u8; 1];
        stream.read_exact(&mut status).map_err(io)?;
        match status[0] {
            OK => Ok(Some(read_bytes(&mut *stream).map_err(io)?)),
            TIMED_OUT => Ok(None),
            s => Err(self.err(what, key, format!("bad reply status {s} from rank 0"))),
        }
    }

    /// Stores `value` under `key`, replacing any earlier value.
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        match &self.backend {
            Backend::Local { table, .. } => {
                table.set(key, value.to_vec());
                Ok(())
            }
            Backend::Remote(_) => {
                let mut operand = (value.len() as u32).to_le_bytes().to_vec();
                operand.extend_from_slice(value);
                self.request("set", key, OP_SET, &operand)?;
                Ok(())
            }
        }
    }

    /// The value of `key`, or `None` when it is not set within the store's timeout.
    fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match &self.backend {
            Backend::Local { table, .. } => Ok(table.get(key, self.timeout)),
            Backend::Remote(_) => {
                let ms = self.timeout.as_millis().min(u64::MAX as u128) as u64;
                self.request("get", key, OP_GET, &ms.to_le_bytes())
            }
        }
    }

    /// The value of `key`, waiting up to the store's timeout for some rank to set it.
    pub fn get(&self, key: &str) -> Result<Vec<u8>> {
        self.try_get(key)?.ok_or_else(|| {
            self.err(
                "get",
                key,
                format!("not set within {}", fmt_duration(self.timeout)),
            )
        })
    }

    /// Adds `delta` to the counter `key` (0 when unset) and returns the new value.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        match &self.backend {
            Backend::Local { table, .. } => Ok(table.add(key, delta)),
            Backend::Remote(_) => {
                let v = self
                    .request("add", key, OP_ADD, &delta.to_le_bytes())?
                    .unwrap_or_default();
                let b = <[u8; 8]>::try_from(v.as_slice())
                    .map_err(|_| self.err("add", key, "bad reply from rank 0"))?;
                Ok(i64::from_le_bytes(b))
            }
        }
    }

    /// Returns once all `world_size` ranks have entered the barrier `name` (each name once per
    /// rank), or fails after the store's timeout naming how many arrived.
    pub fn barrier(&self, name: &str) -> Result<()> {
        let count_key = format!("barrier/{name}/count");
        let done_key = format!("barrier/{name}/done");
        let n = self.add(&count_key, 1)?;
        if n == self.world_size as i64 {
            self.set(&done_key, b"1")?;
        }
        match self.try_get(&done_key)? {
            Some(_) => Ok(()),
            None => {
                let arrived = self.add(&count_key, 0).unwrap_or(-1);
                Err(self.err(
                    "barrier",
                    name,
                    format!(
                        "{arrived} of {} ranks arrived within {}",
                        self.world_size,
                        fmt_duration(self.timeout)
                    ),
                ))
            }
        }
    }
}

fn read_u32(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// A u32 length then that many bytes.
fn read_bytes(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let n = read_u32(r)?;
    if n > MAX_LEN {
        return Err(std::io::Error::other(format!(
            "a length of {n} bytes is above the limit"
        )));
    }
    let mut v = vec![0u8; n as usize];
    r.read_exact(&mut v)?;
    Ok(v)
}

fn accept_loop(
    listener: TcpListener,
    table: Arc<Table>,
    stop: Arc<AtomicBool>,
    conns: Arc<Mutex<Vec<TcpStream>>>,
    active: Arc<(Mutex<usize>, Condvar)>,
) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(conn) = conn else { continue };
        if let Ok(c) = conn.try_clone() {
            conns.lock().unwrap_or_else(|e| e.into_inner()).push(c);
        }
        let table = table.clone();
        *active.0.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        let done = active.clone();
        let spawned = std::thread::Builder::new()
            .name("meshgrad-store-conn".into())
            .spawn(move || {
                // A connection ends when the peer closes it or sends garbage.
                let _ = serve_connection(conn, &table);
                *done.0.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
                done.1.notify_all();
            });
        if spawned.is_err() {
            *active.0.lock().unwrap_or_else(|e| e.into_inner()) -= 1;
        }
    }
}

fn serve_connection(conn: TcpStream, table: &Table) -> std::io::Result<()> {
    let _ = conn.set_nodelay(true);
    let mut reader = BufReader::new(conn.try_clone()?);
    let mut writer = BufWriter::new(conn);
    loop {
        let mut op = [0u8; 1];
        if reader.read_exact(&mut op).is_err() {
            return Ok(());
        }
        let key = String::from_utf8(read_bytes(&mut reader)?)
            .map_err(|_| std::io::Error::other("a key is not UTF-8"))?;
        let reply: Option<Vec<u8>> = match op[0] {
            OP_SET => {
                table.set(&key, read_bytes(&mut reader)?);
                Some(Vec::new())
            }
            OP_GET => {
                let mut ms = [0u8; 8];
                reader.read_exact(&mut ms)?;
                table.get(&key, Duration::from_millis(u64::from_le_bytes(ms)))
            }
            OP_ADD => {
                let mut d = [0u8; 8];
                reader.read_exact(&mut d)?;
                Some(
                    table
                        .add(&key, i64::from_le_bytes(d))
                        .to_le_bytes()
                        .to_vec(),
                )
            }
            _ => {
                let _ = writer.get_ref().shutdown(Shutdown::Both);
                return Err(std::io::Error::other("unknown op"));
            }
        };
        match reply {
            Some(v) => {
                writer.write_all(&[OK])?;
                writer.write_all(&(v.len() as u32).to_le_bytes())?;
                writer.write_all(&v)?;
            }
            None => writer.write_all(&[TIMED_OUT])?,
        }
        writer.flush()?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T: Duration = Duration::from_secs(20);

    #[test]
    fn set_get_add_barrier_across_threads() {
        let world = 4;
        let server = TcpStore::serve(0, world, T).unwrap();
        let port = server.port();
        assert_ne!(port, 0);
        std::thread::scope(|s| {
            let mut handles = Vec::new();
            for rank in 1..world {
                handles.push(s.spawn(move || -> Result<Vec<u8>> {
                    let st = TcpStore::connect("127.0.0.1", port, rank, world, T)?;
                    st.set(&format!("r{rank}"), format!("hello {rank}").as_bytes())?;
                    st.add("count", rank as i64)?;
                    st.barrier("one")?;
                    // Blocks until rank 0 sets it after the barrier.
                    let id = st.get("id")?;
                    st.barrier("two")?;
                    Ok(id)
                }));
            }
            server.barrier("one").unwrap();
            for rank in 1..world {
                assert_eq!(
                    server.get(&format!("r{rank}")).unwrap(),
                    format!("hello {rank}").as_bytes()
                );
            }
            assert_eq!(server.add("count", 0).unwrap(), 1 + 2 + 3);
            std::thread::sleep(Duration::from_millis(50));
            server.set("id", &[7u8; 128]).unwrap();
            server.barrier("two").unwrap();
            for h in handles {
                assert_eq!(h.join().unwrap().unwrap(), vec![7u8; 128]);
            }
        });
    }

    #[test]
    fn connect_retries_until_the_server_listens() {
        // Find a free port, start the server on it only after the client has begun trying.
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let client = std::thread::spawn(move || {
            let st = TcpStore::connect("127.0.0.1", port, 1, 2, T)?;
            st.set("k", b"v")?;
            st.barrier("b")
        });
        std::thread::sleep(Duration::from_millis(300));
        let server = TcpStore::serve(port, 2, T).unwrap();
        server.barrier("b").unwrap();
        client.join().unwrap().unwrap();
        assert_eq!(server.get("k").unwrap(), b"v");
    }

    #[test]
    fn timeouts_are_one_line_errors() {
        let short = Duration::from_millis(200);
        let port = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let e = TcpStore::connect("127.0.0.1", port, 3, 4, short)
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with(&format!(
                "rank 3: store 127.0.0.1:{port}: could not connect within 200ms: "
            )),
            "{e}"
        );
        let server = TcpStore::serve(0, 3, short).unwrap();
        let c = TcpStore::connect("127.0.0.1", server.port(), 1, 3, short).unwrap();
        let e = c.get("missing").unwrap_err().to_string();
        assert_eq!(
            e,
            format!(
                "rank 1: store 127.0.0.1:{}: get \"missing\": not set within 200ms",
                server.port()
            )
        );
        let e = server.barrier("b").unwrap_err().to_string();
        assert!(
            e.ends_with("barrier \"b\": 1 of 3 ranks arrived within 200ms"),
            "{e}"
        );
        // Rank 0 gone: the connection fails in one line.
        drop(server);
        let e = c.set("k", b"v").and_then(|_| c.get("k").map(|_| ()));
        assert!(e.is_err());
        assert!(!e.unwrap_err().to_string().contains('\n'));
    }
}
