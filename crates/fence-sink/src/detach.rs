//! Futures that finish their work even when their caller stops waiting.

use std::{
    future::Future,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

pub(crate) type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// A boxed future that runs in its caller's task while the caller waits for it and, when
/// made with [`finishing`](Self::finishing) and dropped unfinished (a client went away), is handed to a
/// task of its own to finish there: the request it carries then stays in flight until its
/// effect is over, as if it had been spawned from the start, without the cost of a task per
/// request when nobody goes away. Without a tokio runtime at the drop, it is dropped.
pub(crate) struct Detachable<T> {
    future: Option<BoxFuture<T>>,
    /// What a drop does with an unfinished future, if anything.
    detach: Option<fn(BoxFuture<T>)>,
    /// With `detach`: the drop detaches only once this is set, and cancels before (see
    /// [`finishing_once`](Detachable::finishing_once)).
    once: Option<Arc<AtomicBool>>,
}

fn finish_in_a_task<T: 'static>(future: BoxFuture<T>) {
    #[cfg(test)]
    let Some(future) = under_shuttle::finish(future) else {
        return;
    };
    if let Ok(runtime) = tokio::runtime::Handle::try_current() {
        // The box moves, the future inside it does not: it stays pinned.
        runtime.spawn(async move {
            let _ = future.await;
        });
    }
}

impl<T: 'static> Detachable<T> {
    /// Finishes in a task of its own if dropped unfinished.
    pub(crate) fn finishing(future: BoxFuture<T>) -> Self {
        Self {
            future: Some(future),
            detach: Some(finish_in_a_task),
            once: None,
        }
    }

    /// Cancelled when dropped until `committed` is set (the service answered a request whose
    /// answer must still be recorded); finishes in a task of its own if dropped after.
    pub(crate) fn finishing_once(future: BoxFuture<T>, committed: Arc<AtomicBool>) -> Self {
        Self {
            future: Some(future),
            detach: Some(finish_in_a_task),
            once: Some(committed),
        }
    }
}

impl<T> Detachable<T> {
    /// Cancelled when dropped, as any future.
    pub(crate) fn cancelled_with_caller(future: BoxFuture<T>) -> Self {
        Self {
            future: Some(future),
            detach: None,
            once: None,
        }
    }
}

impl<T> Future for Detachable<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        let future = self.future.as_mut().expect("polled after completion");
        // A future that panicked is done: dropped here, not handed to a task of its own to
        // be polled again (which would panic a second time, outside any catch of the first).
        let polled =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| future.as_mut().poll(cx)));
        match polled {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => {
                self.future = None;
                Poll::Ready(output)
            }
            Err(panic) => {
                self.future = None;
                std::panic::resume_unwind(panic)
            }
        }
    }
}

impl<T> Drop for Detachable<T> {
    fn drop(&mut self) {
        let Some(future) = self.future.take() else {
            return;
        };
        let committed = self
            .once
            .as_ref()
            .is_none_or(|committed| committed.load(Ordering::Acquire));
        if let (Some(detach), true) = (self.detach, committed) {
            detach(future);
        }
    }
}

/// In the gate's model check (tests only), a detached future becomes a shuttle task that the
/// check awaits, so every schedule of it is explored too.
#[cfg(test)]
pub(crate) mod under_shuttle {
    use std::cell::RefCell;

    use super::BoxFuture;

    thread_local! {
        static TASKS: RefCell<Option<Vec<shuttle::future::JoinHandle<()>>>> =
            const { RefCell::new(None) };
    }

    /// From now on, on this thread, detached futures run as shuttle tasks.
    pub(crate) fn start() {
        TASKS.with(|t| *t.borrow_mut() = Some(Vec::new()));
    }

    /// The shuttle tasks detached since the last call.
    pub(crate) fn take() -> Vec<shuttle::future::JoinHandle<()>> {
        TASKS.with(|t| {
            t.borrow_mut()
                .as_mut()
                .map(std::mem::take)
                .unwrap_or_default()
        })
    }

    /// Detached futures go to tokio again.
    pub(crate) fn stop() {
        TASKS.with(|t| *t.borrow_mut() = None);
    }

    /// `None` when `future` was handed to a shuttle task.
    pub(super) fn finish<T: 'static>(future: BoxFuture<T>) -> Option<BoxFuture<T>> {
        if TASKS.with(|t| t.borrow().is_none()) {
            return Some(future);
        }
        // Spawning is a scheduling point: no borrow is held across it.
        let task = shuttle::future::spawn(async move {
            let _ = future.await;
        });
        TASKS.with(|t| t.borrow_mut().get_or_insert_default().push(task));
        None
    }
}
