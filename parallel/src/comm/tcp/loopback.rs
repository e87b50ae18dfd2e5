//! A TCP world inside one process: each rank a thread with its own connections over the loopback
//! interface, as processes of `meshgrad launch` would have (for measurements and tests).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use meshgrad_tensor::{Error, Result};

use super::TcpCommunicator;
use crate::comm::store::TcpStore;

/// Runs `f` on every rank of a TCP world of `ranks` threads of this process (rank 0 serves the
/// store; every rank connects to the others over 127.0.0.1 within `timeout`) and returns the
/// ranks' results in rank order; the first error, or a panicked rank as one.
pub fn run_loopback_ranks<T: Send>(
    ranks: usize,
    timeout: Duration,
    f: impl Fn(Arc<TcpCommunicator>) -> Result<T> + Sync,
) -> Result<Vec<T>> {
    let first = TcpStore::serve(0, ranks, timeout)?;
    let port = first.port();
    let first = Mutex::new(Some(first));
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..ranks)
            .map(|r| {
                let (f, first) = (&f, &first);
                s.spawn(move || {
                    let served = match r {
                        0 => first.lock().ok().and_then(|mut g| g.take()),
                        _ => None,
                    };
                    let store = match served {
                        Some(store) => store,
                        None => TcpStore::connect("127.0.0.1", port, r, ranks, timeout)?,
                    };
                    let store = Arc::new(store);
                    f(TcpCommunicator::connect(
                        r,
                        ranks,
                        "127.0.0.1",
                        store,
                        timeout,
                    )?)
                })
            })
            .collect();
        handles
            .into_iter()
            .enumerate()
            .map(|(r, h)| {
                h.join()
                    .map_err(|_| Error::msg(format!("tcp loopback world: rank {r} panicked")))?
            })
            .collect()
    })
}
