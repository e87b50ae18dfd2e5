//! [`Work`]: the asynchronous handle every collective returns.

use meshgrad_tensor::{Error, Result, Tensor};

/// The backend side of an operation in flight. A backend implements it for its pending
/// operations; users only see [`Work`].
pub trait Pending<T>: Send {
    /// Whether [`Pending::wait`] would return without blocking.
    fn is_completed(&self) -> bool;
    /// Blocks until the operation completes (or fails, or times out) and returns its result.
    fn wait(self: Box<Self>) -> Result<T>;
}

enum State<T> {
    Done(Result<T>),
    Pending(Box<dyn Pending<T>>),
}

/// An asynchronous handle to a communication operation: launching returns at once, so
/// communication overlaps compute, and [`Work::wait`] yields the result (a tensor for collectives,
/// `()` for barriers and sends). Dropping a `Work` without waiting abandons the result (the
/// operation itself still happens, so peers are not left waiting).
#[must_use = "a collective's result is only available through Work::wait"]
pub struct Work<T = Tensor> {
    state: State<T>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match &self.state {
            State::Done(Ok(_)) => "done",
            State::Done(Err(_)) => "failed",
            State::Pending(_) => "pending",
        };
        write!(f, "Work({s})")
    }
}

impl<T: Send + 'static> Work<T> {
    /// A handle that is already complete with `value`.
    pub fn done(value: T) -> Self {
        Work {
            state: State::Done(Ok(value)),
        }
    }

    /// A handle that has already failed with `error`.
    pub fn failed(error: Error) -> Self {
        Work {
            state: State::Done(Err(error)),
        }
    }

    /// A handle over a backend's pending operation.
    pub fn pending(op: Box<dyn Pending<T>>) -> Self {
        Work {
            state: State::Pending(op),
        }
    }

    /// Whether [`Work::wait`] would return without blocking.
    pub fn is_completed(&self) -> bool {
        match &self.state {
            State::Done(_) => true,
            State::Pending(p) => p.is_completed(),
        }
    }

    /// Blocks until the operation completes and returns its result, or the error that ended it
    /// (a peer that failed or did not join within the timeout, a mismatched call, ...).
    pub fn wait(self) -> Result<T> {
        match self.state {
            State::Done(r) => r,
            State::Pending(p) => p.wait(),
        }
    }

    /// A handle whose result is `f` applied to this one's (run by [`Work::wait`]).
    pub fn map<U: Send + 'static>(
        self,
        f: impl FnOnce(T) -> Result<U> + Send + 'static,
    ) -> Work<U> {
        match self.state {
            State::Done(r) => Work {
                state: State::Done(r.and_then(f)),
            },
            State::Pending(p) => Work::pending(Box::new(Mapped { inner: p, f })),
        }
    }
}

struct Mapped<T, F> {
    inner: Box<dyn Pending<T>>,
    f: F,
}

impl<T, U, F> Pending<U> for Mapped<T, F>
where
    F: FnOnce(T) -> Result<U> + Send,
{
    fn is_completed(&self) -> bool {
        self.inner.is_completed()
    }
    fn wait(self: Box<Self>) -> Result<U> {
        let Mapped { inner, f } = *self;
        inner.wait().and_then(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn done_failed_and_map() {
        let w = Work::done(2u32).map(|v| Ok(v * 3));
        assert!(w.is_completed());
        assert_eq!(w.wait().unwrap(), 6);
        let e: Work<u32> = Work::failed(Error::msg("boom"));
        assert_eq!(e.wait().unwrap_err().to_string(), "boom");
    }
}
