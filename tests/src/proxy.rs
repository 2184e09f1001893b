use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

/// What a [`FaultProxy`] does with traffic.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProxyMode {
    /// Forward both ways.
    Pass,
    /// Forward both ways, adding this much to every round trip: each chunk read from
    /// either side is written to the other half this long after it was read (so a
    /// query's answer arrives this much later). Bytes are never reordered or dropped: a
    /// chunk waits for those read before it, so after a switch to a shorter latency (or
    /// `Pass`) the chunks already waiting keep the latency they were read under.
    Latency(Duration),
    /// Stop forwarding both ways but keep every socket open, like a network
    /// partition: nothing is lost, nothing arrives. New connections hang.
    BlackHole,
    /// Close both sides of every connection (like a crashed middlebox); new
    /// connections are accepted and closed at once until the mode changes.
    Cut,
}

/// A TCP proxy on 127.0.0.1 between a client and PostgreSQL, whose traffic a test can
/// slow down, black-hole or cut. It runs on the current tokio runtime and stops when
/// dropped.
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
    /// Where new connections go.
    upstream: SocketAddr,
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
            upstream,
        });
        let task = tokio::spawn(async move {
            let mut tasks = Vec::new();
            while let Ok((client, _)) = listener.accept().await {
                let rx = rx.clone();
                let cuts = rx.borrow().cuts;
                tasks.retain(|t: &JoinHandle<()>| !t.is_finished());
                tasks.push(tokio::spawn(async move {
                    let _ = serve(client, rx, cuts).await;
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

    /// Sends new connections to another server (like a DNS name or a virtual IP moved
    /// to a promoted standby); existing connections stay where they are.
    pub fn set_upstream(&self, upstream: SocketAddr) {
        self.mode.send_modify(|s| s.upstream = upstream);
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

async fn serve(client: TcpStream, mut mode: watch::Receiver<State>, cuts: u64) -> io::Result<()> {
    if !wait_pass(&mut mode, cuts).await {
        return Ok(());
    }
    // Where the connection goes is decided when it may go.
    let upstream = mode.borrow().upstream;
    let server = TcpStream::connect(upstream).await?;
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    tokio::join!(pump(cr, sw, mode.clone(), cuts), pump(sr, cw, mode, cuts));
    Ok(())
}

/// Waits until the mode forwards (`Pass` or `Latency`: true), or is `Cut` or was cut
/// since the connection was accepted (false).
async fn wait_pass(mode: &mut watch::Receiver<State>, cuts: u64) -> bool {
    loop {
        let state = *mode.borrow_and_update();
        if state.cuts != cuts {
            return false;
        }
        match state.mode {
            ProxyMode::Pass | ProxyMode::Latency(_) => return true,
            ProxyMode::Cut => return false,
            ProxyMode::BlackHole => {}
        }
        if mode.changed().await.is_err() {
            return false;
        }
    }
}

/// The latency each direction adds: half the round trip.
fn one_way(mode: ProxyMode) -> Duration {
    match mode {
        ProxyMode::Latency(rtt) => rtt / 2,
        _ => Duration::ZERO,
    }
}

/// What the reader hands the writer: a chunk, or the end of the stream (`None`), with
/// when it may be passed on.
type Item = (tokio::time::Instant, Option<Vec<u8>>);

/// One direction: a reader that stamps each chunk with when it may be written, and a
/// writer that writes them in order, each at its time. Ends (closing the write half,
/// after every chunk read before an end of stream, and as late: a close is delayed
/// like data) when the reading side closes, or at once on a cut or when the proxy is
/// dropped.
async fn pump(from: OwnedReadHalf, to: OwnedWriteHalf, mode: watch::Receiver<State>, cuts: u64) {
    let (tx, rx) = mpsc::unbounded_channel();
    let writer = write_half(to, rx, mode.clone(), cuts);
    tokio::pin!(writer);
    tokio::select! {
        // The reader ended (end of stream, or a cut) and dropped its sender: the writer
        // writes what is queued, then ends (at once on a cut).
        () = read_half(from, tx, mode, cuts) => writer.await,
        // The writer ended (the other side closed, or a cut): stop reading too.
        () = &mut writer => {}
    }
}

async fn read_half(
    mut from: OwnedReadHalf,
    tx: mpsc::UnboundedSender<Item>,
    mut mode: watch::Receiver<State>,
    cuts: u64,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        // Nothing is read while black-holed (held back, not lost, like TCP
        // retransmission).
        if !wait_pass(&mut mode, cuts).await {
            return;
        }
        tokio::select! {
            read = from.read(&mut buf) => {
                let due = tokio::time::Instant::now() + one_way(mode.borrow().mode);
                let n = match read {
                    Ok(0) | Err(_) => {
                        let _ = tx.send((due, None));
                        return;
                    }
                    Ok(n) => n,
                };
                if tx.send((due, Some(buf[..n].to_vec()))).is_err() {
                    return;
                }
            }
            changed = mode.changed() => if changed.is_err() { return },
        }
    }
}

async fn write_half(
    mut to: OwnedWriteHalf,
    mut rx: mpsc::UnboundedReceiver<Item>,
    mut mode: watch::Receiver<State>,
    cuts: u64,
) {
    let mut cut = mode.clone();
    loop {
        let (due, chunk) = tokio::select! {
            next = rx.recv() => match next {
                Some(next) => next,
                // The reader ended without an end of stream: a cut.
                None => return,
            },
            // A cut, or the proxy dropped, while idle.
            () = until_cut(&mut cut, cuts) => return,
        };
        // Held back while black-holed, and until its time.
        loop {
            if !wait_pass(&mut mode, cuts).await {
                return;
            }
            tokio::select! {
                () = tokio::time::sleep_until(due) => break,
                changed = mode.changed() => if changed.is_err() { return },
            }
        }
        // The mode may have turned to black-hole at the very instant the sleep ended.
        if !wait_pass(&mut mode, cuts).await {
            return;
        }
        // The end of the stream: closing the write half passes it on.
        let Some(chunk) = chunk else {
            return;
        };
        tokio::select! {
            written = to.write_all(&chunk) => if written.is_err() { return },
            () = until_cut(&mut cut, cuts) => return,
        }
    }
}

/// Resolves when the connection is cut (or the proxy dropped).
async fn until_cut(mode: &mut watch::Receiver<State>, cuts: u64) {
    loop {
        let state = *mode.borrow_and_update();
        if state.cuts != cuts || state.mode == ProxyMode::Cut {
            return;
        }
        if mode.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;

    /// An echo server on loopback; it ends with the runtime.
    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut socket, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = socket.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                });
            }
        });
        addr
    }

    async fn round_trip(stream: &mut TcpStream, byte: u8) -> Duration {
        let t = Instant::now();
        stream.write_all(&[byte]).await.unwrap();
        let mut got = [0u8; 1];
        stream.read_exact(&mut got).await.unwrap();
        assert_eq!(got[0], byte);
        t.elapsed()
    }

    #[tokio::test]
    async fn latency_adds_to_the_round_trip_and_pass_removes_it() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(round_trip(&mut stream, 1).await < Duration::from_millis(150));
        proxy.set(ProxyMode::Latency(Duration::from_millis(300)));
        let slow = round_trip(&mut stream, 2).await;
        assert!(slow >= Duration::from_millis(300), "{slow:?}");
        assert!(slow < Duration::from_secs(3), "{slow:?}");
        proxy.set(ProxyMode::Pass);
        assert!(round_trip(&mut stream, 3).await < Duration::from_millis(150));
    }

    #[tokio::test]
    async fn latency_keeps_every_byte_in_order_across_mode_changes() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        let stream = TcpStream::connect(proxy.addr()).await.unwrap();
        let (mut r, mut w) = stream.into_split();
        let sent: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let expected = sent.clone();
        let reader = tokio::spawn(async move {
            let mut got = vec![0u8; expected.len()];
            r.read_exact(&mut got).await.unwrap();
            assert!(got == expected, "bytes reordered or lost");
        });
        let writer = tokio::spawn(async move {
            for piece in sent.chunks(997) {
                w.write_all(piece).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            w
        });
        // Modes change while bytes flow, whatever the socket buffers let through.
        for mode in [
            ProxyMode::Latency(Duration::from_millis(200)),
            ProxyMode::Pass,
            ProxyMode::Latency(Duration::from_millis(50)),
            ProxyMode::BlackHole,
            ProxyMode::Latency(Duration::from_millis(10)),
        ] {
            proxy.set(mode);
            tokio::time::sleep(Duration::from_millis(40)).await;
        }
        proxy.set(ProxyMode::Pass);
        let _w = writer.await.unwrap();
        tokio::time::timeout(Duration::from_secs(20), reader)
            .await
            .expect("every byte arrives")
            .unwrap();
    }

    #[tokio::test]
    async fn a_close_is_delayed_like_data() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let proxy = FaultProxy::start(listener.local_addr().unwrap())
            .await
            .unwrap();
        proxy.set(ProxyMode::Latency(Duration::from_millis(600)));
        let mut client = TcpStream::connect(proxy.addr()).await.unwrap();
        let (mut server, _) = listener.accept().await.unwrap();
        let t = Instant::now();
        client.write_all(b"last words").await.unwrap();
        client.shutdown().await.unwrap();
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        assert_eq!(got, b"last words");
        let after = t.elapsed();
        assert!(
            after >= Duration::from_millis(300),
            "closed after {after:?}"
        );
    }

    #[tokio::test]
    async fn dropping_the_proxy_closes_delayed_connections() {
        let proxy = FaultProxy::start(echo().await).await.unwrap();
        let mut stream = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut stream, 1).await;
        proxy.set(ProxyMode::Latency(Duration::from_secs(3600)));
        stream.write_all(&[2]).await.unwrap();
        drop(proxy);
        let mut got = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut got))
            .await
            .expect("the proxy's tasks end and close the connection");
        assert!(matches!(read, Ok(0) | Err(_)), "{read:?}");
    }
}
