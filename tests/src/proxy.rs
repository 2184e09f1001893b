use std::io;
use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// What a [`FaultProxy`] does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward both ways.
    Pass,
    /// Stop forwarding both ways but keep every socket open, like a network
    /// partition: nothing is lost, nothing arrives. New connections hang.
    BlackHole,
    /// Close both sides of every connection (like a crashed middlebox); new
    /// connections are accepted and closed at once until the mode changes.
    Cut,
}

/// A TCP proxy on 127.0.0.1 between a client and PostgreSQL, whose traffic a test can
/// black-hole or cut. It runs on the current tokio runtime and stops when dropped.
#[derive(Debug)]
pub struct FaultProxy {
    addr: SocketAddr,
    mode: watch::Sender<State>,
    task: JoinHandle<()>,
}

/// The mode, and how many times it was set to `Cut`: a connection remembers the count
/// it was accepted under and closes when it changes, so a cut that is healed before a
/// pump looks still closes every connection it should.
#[derive(Clone, Copy, Debug)]
struct State {
    mode: ProxyMode,
    cuts: u64,
}

impl FaultProxy {
    /// Starts a proxy to `upstream` on a free loopback port.
    ///
    /// # Errors
    ///
    /// When no loopback port can be bound.
    pub async fn start(upstream: SocketAddr) -> io::Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (mode, rx) = watch::channel(State {
            mode: ProxyMode::Pass,
            cuts: 0,
        });
        let task = tokio::spawn(async move {
            let mut tasks = Vec::new();
            while let Ok((client, _)) = listener.accept().await {
                let rx = rx.clone();
                let cuts = rx.borrow().cuts;
                tasks.retain(|t: &JoinHandle<()>| !t.is_finished());
                tasks.push(tokio::spawn(async move {
                    let _ = serve(client, upstream, rx, cuts).await;
                }));
            }
            for t in tasks {
                t.abort();
            }
        });
        Ok(Self { addr, mode, task })
    }

    /// The address clients connect to.
    #[must_use]
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A connection URL through the proxy, from a direct URL of the form
    /// `postgres://user:pw@127.0.0.1:PORT/db`.
    #[must_use]
    pub fn url(&self, direct_url: &str, upstream_port: u16) -> String {
        direct_url.replace(
            &format!("127.0.0.1:{upstream_port}"),
            &format!("127.0.0.1:{}", self.addr.port()),
        )
    }

    /// Changes what the proxy does, for existing and new connections.
    pub fn set(&self, mode: ProxyMode) {
        self.mode.send_modify(|s| {
            s.mode = mode;
            if mode == ProxyMode::Cut {
                s.cuts += 1;
            }
        });
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.set(ProxyMode::Cut);
        self.task.abort();
    }
}

async fn serve(
    client: TcpStream,
    upstream: SocketAddr,
    mut mode: watch::Receiver<State>,
    cuts: u64,
) -> io::Result<()> {
    if !wait_pass(&mut mode, cuts).await {
        return Ok(());
    }
    let server = TcpStream::connect(upstream).await?;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::join!(pump(cr, sw, mode.clone(), cuts), pump(sr, cw, mode, cuts));
    Ok(())
}

/// Waits until the mode is `Pass` (true), or `Cut` or a cut since the connection was
/// accepted (false).
async fn wait_pass(mode: &mut watch::Receiver<State>, cuts: u64) -> bool {
    loop {
        let state = *mode.borrow_and_update();
        if state.cuts != cuts {
            return false;
        }
        match state.mode {
            ProxyMode::Pass => return true,
            ProxyMode::Cut => return false,
            ProxyMode::BlackHole => {}
        }
        if mode.changed().await.is_err() {
            return false;
        }
    }
}

async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut mode: watch::Receiver<State>,
    cuts: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        if !wait_pass(&mut mode, cuts).await {
            return;
        }
        tokio::select! {
            read = from.read(&mut buf) => {
                let n = match read {
                    Ok(0) | Err(_) => return,
                    Ok(n) => n,
                };
                // Held back (not lost) while black-holed, like TCP retransmission.
                if !wait_pass(&mut mode, cuts).await || to.write_all(&buf[..n]).await.is_err() {
                    return;
                }
            }
            changed = mode.changed() => if changed.is_err() { return },
        }
    }
}
