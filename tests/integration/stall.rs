//! Issue 10, client timeouts: a worker whose link stalls (a TCP proxy in the test that accepts,
//! forwards a little, then stops forwarding without closing) gives the session up within its
//! stall deadline and recovers once the link is good again; and SIGTERM stops the real
//! `crowdgrad work` binary within 2 s while it is stuck in a stalled partition download.

use crate::util::{config, server, wait_for, Proc};
use crowdgrad::worker::{WorkOptions, WorkerThread};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A loopback proxy to `upstream`. A connection stalls (stops forwarding server bytes, keeps
/// the socket open) after `after` bytes when it is among the first `stall_first` connections.
struct StallProxy {
    addr: SocketAddr,
    stalled: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl StallProxy {
    async fn start(upstream: SocketAddr, after: usize, stall_first: usize) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let stalled = Arc::new(AtomicUsize::new(0));
        let st = stalled.clone();
        let task = tokio::spawn(async move {
            let mut n = 0usize;
            while let Ok((client, _)) = listener.accept().await {
                let stall = n < stall_first;
                n += 1;
                let st = st.clone();
                tokio::spawn(async move {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        return;
                    };
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = tokio::spawn(async move {
                        let _ = tokio::io::copy(&mut cr, &mut sw).await;
                    });
                    let mut sent = 0usize;
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        let k = match sr.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(k) => k,
                        };
                        if stall && sent + k > after {
                            // Stop forwarding and hold both sockets open: a stalled link.
                            st.fetch_add(1, Ordering::SeqCst);
                            tokio::time::sleep(Duration::from_secs(600)).await;
                            break;
                        }
                        if cw.write_all(&buf[..k]).await.is_err() {
                            break;
                        }
                        sent += k;
                    }
                    up.abort();
                });
            }
        });
        Self {
            addr,
            stalled,
            task,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for StallProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_on_a_stalled_download_gives_up_within_its_deadline_and_recovers() {
    let running = server(config()).await;
    // The first connection carries the join and stalls 64 KiB into the partition download.
    let proxy = StallProxy::start(running.addr, 64 * 1024, 1).await;
    let mut o = WorkOptions::new(proxy.url());
    o.duration = Some(Duration::from_secs(60));
    o.timeouts.stall = Duration::from_secs(1);
    o.max_backoff = Duration::from_millis(500);
    let t0 = Instant::now();
    let w = WorkerThread::spawn(o);
    wait_for(
        &running.url(),
        Duration::from_secs(20),
        "training after the stall",
        |s| s["totals"]["pushes_applied"].as_u64() > Some(20),
    )
    .await;
    assert_eq!(
        proxy.stalled.load(Ordering::SeqCst),
        1,
        "the link did stall"
    );
    assert!(t0.elapsed() < Duration::from_secs(15));
    let summary = w.stop().expect("summary");
    assert!(summary.sessions >= 2, "{summary:?}");
    let why = summary.last_error.unwrap_or_default();
    assert!(
        why.to_lowercase().contains("timeout") || why.contains("timed out"),
        "{why}"
    );
    running.stop().await.expect("stops");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_a_worker_stuck_on_a_stalled_link_within_2_s() {
    let running = server(config()).await;
    // Every connection stalls 64 KiB in: the download never finishes; the stall deadline is
    // the default (30 s), far longer than the signal may take.
    let proxy = StallProxy::start(running.addr, 64 * 1024, usize::MAX).await;
    let mut child = Proc::crowdgrad(
        "stalled-worker",
        &["work", "--quiet", "--server", &proxy.url()],
    );
    let t0 = Instant::now();
    while proxy.stalled.load(Ordering::SeqCst) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the download never stalled"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(child.running(), "still waiting on the link");
    let sent = Instant::now();
    child.terminate();
    let status = child
        .exit_within(Duration::from_secs(5))
        .await
        .expect("the worker stops on SIGTERM within 5 s");
    let took = sent.elapsed();
    assert!(took < Duration::from_secs(2), "stopped after {took:?}");
    assert!(status.success(), "{status:?}");
    running.stop().await.expect("stops");
}
