//! Stopping a training run on SIGINT / SIGTERM: the first signal asks the run to finish its
//! current step, write a checkpoint and exit non-zero; a second signal exits at once (status
//! 130), as an impatient user expects.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use anyhow::{Context, Result};
use signal_hook::consts::{SIGINT, SIGTERM};

/// Set by the first SIGINT or SIGTERM (see the [module docs](self)).
#[derive(Clone, Debug)]
pub struct StopSignal {
    flag: Arc<AtomicBool>,
}

impl StopSignal {
    /// Installs the handlers for SIGINT and SIGTERM (once per process is enough; installing
    /// again adds handlers that share the same behaviour).
    pub fn install() -> Result<Self> {
        let flag = Arc::new(AtomicBool::new(false));
        for sig in [SIGINT, SIGTERM] {
            // Registered first, so it sees the flag as the previous signal left it: a second
            // signal (flag already set) exits at once.
            signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())
                .context("installing the signal handler")?;
            signal_hook::flag::register(sig, flag.clone())
                .context("installing the signal handler")?;
        }
        Ok(StopSignal { flag })
    }

    /// A stop signal that no OS signal sets (tests, library use); [`StopSignal::request`] sets it.
    pub fn manual() -> Self {
        StopSignal {
            flag: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Whether a stop was requested.
    pub fn requested(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Requests a stop (as a first signal does).
    pub fn request(&self) {
        self.flag.store(true, Ordering::SeqCst);
    }
}

static INSTALLED: OnceLock<StopSignal> = OnceLock::new();

/// Installs the process's SIGINT / SIGTERM handlers once ([`StopSignal::install`]) and returns
/// the signal every training loop of the process watches.
pub fn install_once() -> Result<&'static StopSignal> {
    if let Some(s) = INSTALLED.get() {
        return Ok(s);
    }
    let s = StopSignal::install()?;
    Ok(INSTALLED.get_or_init(|| s))
}

/// The installed signal, if [`install_once`] ran (the `meshgrad` binary installs it for
/// `train`; library callers that do not install one are never stopped by a signal).
pub fn installed() -> Option<&'static StopSignal> {
    INSTALLED.get()
}
