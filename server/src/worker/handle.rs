//! [`WorkerThread`]: a worker on an OS thread of its own, for tests and benches.

use super::options::{Summary, WorkOptions};
use super::threads::work;
use crate::error::{Error, Result};

/// A worker running on a thread of its own with a single-threaded runtime (how tests and
/// benches run several workers in one process without sharing the server's runtime).
#[derive(Debug)]
pub struct WorkerThread {
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    kill: Option<tokio::sync::oneshot::Sender<()>>,
    handle: std::thread::JoinHandle<Option<Result<Summary>>>,
}

impl WorkerThread {
    /// Starts a worker with `opts`.
    pub fn spawn(opts: WorkOptions) -> Self {
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let (kill, kill_rx) = tokio::sync::oneshot::channel::<()>();
        let handle = std::thread::spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => return Some(Err(Error::io("building a runtime", e))),
            };
            rt.block_on(async move {
                let stopped = async move {
                    let _ = stop_rx.await;
                };
                tokio::select! {
                    r = work(opts, stopped) => Some(r),
                    // Dropping the worker mid-flight closes its sockets without a goodbye, as
                    // a crashed process would.
                    _ = kill_rx => None,
                }
            })
        });
        Self {
            stop: Some(stop),
            kill: Some(kill),
            handle,
        }
    }

    /// True once the worker has returned.
    pub fn is_finished(&self) -> bool {
        self.handle.is_finished()
    }

    /// Asks the worker to stop (it says goodbye) and waits for its summary.
    ///
    /// # Errors
    /// What [`work`] returned, or an error when the thread panicked.
    pub fn stop(mut self) -> Result<Summary> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        self.join()
    }

    /// Waits for the worker to finish by itself (step or time limit).
    ///
    /// # Errors
    /// As [`WorkerThread::stop`].
    pub fn join(self) -> Result<Summary> {
        match self.handle.join() {
            Ok(Some(r)) => r,
            Ok(None) => Err(Error::Task("worker was killed".into())),
            Err(_) => Err(Error::Task("worker thread panicked".into())),
        }
    }

    /// Kills the worker abruptly: its connections drop without Bye or Close frames.
    pub fn kill(mut self) {
        if let Some(k) = self.kill.take() {
            let _ = k.send(());
        }
        let _ = self.handle.join();
    }
}
