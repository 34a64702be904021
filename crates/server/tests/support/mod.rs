//! Test harness: a real server on a loopback port over the built-in tiny engine, and a minimal
//! HTTP/1.1 client (no extra dependencies) that can also hang up mid-reply.

#![allow(dead_code)]

use server::{ServeOptions, ServerError};
use sha2::{Digest, Sha256};
use speech::engine::{Engine, EngineOptions};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub const WINDOW: u64 = 4096;

pub struct TestServer {
    pub addr: SocketAddr,
    pub engine: Arc<Engine>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServerError>>>,
    pub voices: tempfile::TempDir,
}

pub fn engine_options(voices: &std::path::Path) -> EngineOptions {
    EngineOptions {
        model_dir: None,
        parallel: 1,
        context: Some(WINDOW),
        voices_dir: Some(voices.to_path_buf()),
        ..EngineOptions::default()
    }
}

impl TestServer {
    pub async fn start() -> Self {
        Self::with(|_| {}, Vec::new()).await
    }

    pub async fn with(tweak: impl FnOnce(&mut EngineOptions), keys: Vec<String>) -> Self {
        let voices = tempfile::tempdir().expect("temp dir");
        let mut opts = engine_options(voices.path());
        tweak(&mut opts);
        Self::on(opts, keys, voices).await
    }

    pub async fn on(opts: EngineOptions, keys: Vec<String>, voices: tempfile::TempDir) -> Self {
        let engine = tokio::task::spawn_blocking(move || Engine::load(opts))
            .await
            .expect("load task")
            .expect("the built-in engine loads");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = oneshot::channel::<()>();
        let serve_opts = ServeOptions {
            api_keys: keys,
            shutdown_grace: Duration::from_secs(5),
            ..ServeOptions::default()
        };
        let task = tokio::spawn(server::serve_on(
            listener,
            Arc::clone(&engine),
            serve_opts,
            async move {
                let _ = stopped.await;
            },
        ));
        Self {
            addr,
            engine,
            stop: Some(stop),
            task: Some(task),
            voices,
        }
    }

    /// Signals shutdown and waits for `serve_on` to return.
    pub async fn stop(mut self) -> Result<(), ServerError> {
        let _ = self.stop.take().expect("running").send(());
        let task = self.task.take().expect("running");
        tokio::time::timeout(Duration::from_secs(30), task)
            .await
            .expect("the server stops within 30 s")
            .expect("serve task")
    }

    pub async fn get(&self, path: &str) -> Reply {
        request(self.addr, "GET", path, &[], b"").await
    }

    pub async fn post_json(&self, path: &str, body: &serde_json::Value) -> Reply {
        request(
            self.addr,
            "POST",
            path,
            &[("content-type", "application/json")],
            body.to_string().as_bytes(),
        )
        .await
    }

    /// Waits until the engine reports `busy` lanes (and nothing queued when `busy` is 0).
    pub async fn wait_lanes(&self, busy: usize, within: Duration) -> bool {
        let until = Instant::now() + within;
        while Instant::now() < until {
            let s = self.engine.stats();
            if s.lanes_busy == busy && (busy > 0 || s.queued == 0) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        false
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
    /// The body ended cleanly (terminating chunk or full Content-Length).
    pub complete: bool,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): {:?}",
                String::from_utf8_lossy(&self.body[..self.body.len().min(400)])
            )
        })
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// Asserts an error reply of the SPEC shape and returns its `code`.
    pub fn error_code(&self, status: u16, kind: &str) -> String {
        assert_eq!(self.status, status, "{}", self.text());
        let v = self.json();
        let e = &v["error"];
        assert_eq!(e["type"], kind, "{v}");
        assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
        assert!(e.get("param").is_some(), "{v}");
        e["code"].as_str().expect("code").to_string()
    }
}

fn head(method: &str, path: &str, headers: &[(&str, &str)], body_len: usize) -> Vec<u8> {
    let mut h = format!(
        "{method} {path} HTTP/1.1\r\nhost: test\r\nconnection: close\r\ncontent-length: {body_len}\r\n"
    );
    for (k, v) in headers {
        h.push_str(&format!("{k}: {v}\r\n"));
    }
    h.push_str("\r\n");
    h.into_bytes()
}

pub async fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(&head(method, path, headers, body.len()))
        .await
        .expect("write head");
    // A server may answer (e.g. 413) before reading the body; a failed write is then expected.
    let _ = s.write_all(body).await;
    let mut raw = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(120), s.read_to_end(&mut raw))
        .await
        .expect("reply within 120 s");
    parse(&raw)
}

/// Sends a request and returns the open connection with the reply head read (for streams that
/// the test reads partly and then abandons).
pub async fn open(
    addr: SocketAddr,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> (TcpStream, Vec<u8>) {
    let mut s = TcpStream::connect(addr).await.expect("connect");
    s.write_all(&head("POST", path, headers, body.len()))
        .await
        .expect("write head");
    s.write_all(body).await.expect("write body");
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    while !buf.windows(4).any(|w| w == b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut chunk))
            .await
            .expect("head within 60 s")
            .expect("read");
        assert!(n > 0, "closed before the head");
        buf.extend_from_slice(&chunk[..n]);
    }
    (s, buf)
}

pub fn parse(raw: &[u8]) -> Reply {
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .unwrap_or_else(|| panic!("no HTTP head in {} bytes", raw.len()));
    let head = String::from_utf8_lossy(&raw[..split]).into_owned();
    let rest = &raw[split + 4..];
    let mut lines = head.split("\r\n");
    let status_line = lines.next().expect("status line");
    let status: u16 = status_line
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .expect("status");
    let headers: Vec<(String, String)> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_string()))
        .collect();
    let chunked = headers
        .iter()
        .any(|(k, v)| k == "transfer-encoding" && v.eq_ignore_ascii_case("chunked"));
    let (body, complete) = if chunked {
        dechunk(rest)
    } else {
        let len = headers
            .iter()
            .find(|(k, _)| k == "content-length")
            .and_then(|(_, v)| v.parse::<usize>().ok());
        match len {
            Some(n) => (rest[..n.min(rest.len())].to_vec(), rest.len() >= n),
            None => (rest.to_vec(), true),
        }
    };
    Reply {
        status,
        headers,
        body,
        complete,
    }
}

fn dechunk(mut b: &[u8]) -> (Vec<u8>, bool) {
    let mut out = Vec::new();
    loop {
        let Some(eol) = b.windows(2).position(|w| w == b"\r\n") else {
            return (out, false);
        };
        let size_text = String::from_utf8_lossy(&b[..eol]);
        let Ok(size) = usize::from_str_radix(size_text.split(';').next().unwrap_or("").trim(), 16)
        else {
            return (out, false);
        };
        b = &b[eol + 2..];
        if size == 0 {
            return (out, true);
        }
        if b.len() < size + 2 {
            out.extend_from_slice(&b[..size.min(b.len())]);
            return (out, false);
        }
        out.extend_from_slice(&b[..size]);
        b = &b[size + 2..];
    }
}

/// SHA-256 of s16le bytes: the PCM hash of SPEC.md when given the raw samples.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// The s16le sample bytes of a 16-bit mono WAV (44-byte header as `speech::pcm` writes it).
pub fn wav_samples(wav: &[u8]) -> &[u8] {
    assert_eq!(&wav[..4], b"RIFF");
    assert_eq!(&wav[8..12], b"WAVE");
    assert_eq!(&wav[36..40], b"data");
    &wav[44..]
}

/// A short sine clip as WAV bytes (a reference voice).
pub fn sine_wav(seconds: f32, rate: u32) -> Vec<u8> {
    let n = (seconds * rate as f32) as usize;
    let pcm: Vec<f32> = (0..n)
        .map(|i| (i as f32 * 220.0 * std::f32::consts::TAU / rate as f32).sin() * 0.3)
        .collect();
    speech::pcm::wav_bytes(&speech::pcm::to_s16_vec(&pcm), rate)
}

pub fn b64(bytes: &[u8]) -> String {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

pub fn unb64(text: &str) -> Vec<u8> {
    use base64::Engine as _;
    base64::engine::general_purpose::STANDARD
        .decode(text)
        .expect("base64")
}

/// Decodes an SSE body: the concatenated delta audio, the done event, and whether `[DONE]` came.
pub fn sse(body: &[u8]) -> (Vec<u8>, Option<serde_json::Value>, bool) {
    let text = String::from_utf8_lossy(body);
    let mut audio = Vec::new();
    let mut done = None;
    let mut finished = false;
    for event in text.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let data = event
            .strip_prefix("data: ")
            .unwrap_or_else(|| panic!("not an SSE data line: {event:?}"));
        if data == "[DONE]" {
            finished = true;
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(data).expect("event JSON");
        match v["type"].as_str() {
            Some("speech.audio.delta") => {
                audio.extend_from_slice(&unb64(v["audio"].as_str().expect("audio")))
            }
            Some("speech.audio.done") => done = Some(v),
            other => panic!("unexpected event type {other:?}: {v}"),
        }
    }
    (audio, done, finished)
}
