//! A bounded soak: hundreds of requests, several at once, random cancellations and malformed
//! bodies. It must end with zero unexpected statuses, zero hash mismatches, and every lane free.

mod support;

use serde_json::json;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;
use support::*;
use tokio::io::AsyncReadExt;

const REQUESTS: usize = 240;
const CONCURRENCY: usize = 4;
const SEEDS: u64 = 6;

fn splitmix(x: &mut u64) -> u64 {
    *x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn body(seed: u64) -> serde_json::Value {
    json!({"input": format!("Soak line {seed}. Second part."), "seed": seed, "max_frames": 6})
}

fn vm_rss_kib() -> Option<u64> {
    std::fs::read_to_string("/proc/self/status")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak() {
    let srv = TestServer::with(|o| o.parallel = 2, Vec::new()).await;
    let mut expected = HashMap::new();
    for seed in 0..SEEDS {
        let r = srv.post_json("/v1/audio/speech", &body(seed)).await;
        assert_eq!(r.status, 200, "{}", r.text());
        expected.insert(seed, r.header("x-dramatis-pcm-sha256").unwrap().to_string());
    }
    let expected = Arc::new(expected);
    let rss_start = vm_rss_kib();
    let next = Arc::new(AtomicUsize::new(0));
    let failures = Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let counts = Arc::new(std::sync::Mutex::new(HashMap::<&'static str, usize>::new()));
    let addr = srv.addr;
    let workers: Vec<_> = (0..CONCURRENCY)
        .map(|w| {
            let (expected, next, failures, counts) = (
                Arc::clone(&expected),
                Arc::clone(&next),
                Arc::clone(&failures),
                Arc::clone(&counts),
            );
            tokio::spawn(async move {
                let mut rng = 0x5EED_0000 + w as u64;
                loop {
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if i >= REQUESTS {
                        break;
                    }
                    let roll = splitmix(&mut rng) % 100;
                    let seed = splitmix(&mut rng) % SEEDS;
                    let kind: &'static str = if roll < 10 {
                        let r = request(
                            addr,
                            "POST",
                            "/v1/audio/speech",
                            &[("content-type", "application/json")],
                            b"{\"input\": ",
                        )
                        .await;
                        if r.status != 400 {
                            failures
                                .lock()
                                .unwrap()
                                .push(format!("malformed -> {}", r.status));
                        }
                        "malformed"
                    } else if roll < 25 {
                        // Cancel: open a stream, read a little, hang up.
                        let mut b = body(seed);
                        b["stream"] = json!(true);
                        b["max_frames"] = json!(200);
                        let text = b.to_string();
                        let (mut conn, _) = open(
                            addr,
                            "/v1/audio/speech",
                            &[("content-type", "application/json")],
                            text.as_bytes(),
                        )
                        .await;
                        let mut buf = [0u8; 1024];
                        let _ =
                            tokio::time::timeout(Duration::from_millis(50), conn.read(&mut buf))
                                .await;
                        drop(conn);
                        "cancelled"
                    } else if roll < 45 {
                        let mut b = body(seed);
                        b["stream"] = json!(true);
                        let r = request(
                            addr,
                            "POST",
                            "/v1/audio/speech",
                            &[("content-type", "application/json")],
                            b.to_string().as_bytes(),
                        )
                        .await;
                        let (audio, _, done) = sse(&r.body);
                        if r.status != 200 || !done || sha256_hex(&audio) != expected[&seed] {
                            failures
                                .lock()
                                .unwrap()
                                .push(format!("sse seed {seed}: {}", r.status));
                        }
                        "sse"
                    } else {
                        let r = request(
                            addr,
                            "POST",
                            "/v1/audio/speech",
                            &[("content-type", "application/json")],
                            body(seed).to_string().as_bytes(),
                        )
                        .await;
                        let ok = r.status == 200
                            && r.header("x-dramatis-pcm-sha256") == Some(expected[&seed].as_str())
                            && sha256_hex(wav_samples(&r.body)) == expected[&seed];
                        if !ok {
                            failures.lock().unwrap().push(format!(
                                "whole seed {seed}: {} {}",
                                r.status,
                                r.text().chars().take(200).collect::<String>()
                            ));
                        }
                        "whole"
                    };
                    *counts.lock().unwrap().entry(kind).or_default() += 1;
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    let failures = failures.lock().unwrap().clone();
    assert!(
        failures.is_empty(),
        "{} failures: {failures:?}",
        failures.len()
    );
    let counts = counts.lock().unwrap().clone();
    for kind in ["malformed", "cancelled", "sse", "whole"] {
        assert!(
            counts.get(kind).copied().unwrap_or(0) > 0,
            "{kind} never ran: {counts:?}"
        );
    }
    assert!(
        srv.wait_lanes(0, Duration::from_secs(10)).await,
        "every lane is free at the end"
    );
    // After all that, every seed still gives its solo take.
    for seed in 0..SEEDS {
        let r = srv.post_json("/v1/audio/speech", &body(seed)).await;
        assert_eq!(
            r.header("x-dramatis-pcm-sha256"),
            Some(expected[&seed].as_str())
        );
    }
    if let (Some(a), Some(b)) = (rss_start, vm_rss_kib()) {
        assert!(
            b < a + 256 * 1024,
            "resident memory grew from {a} KiB to {b} KiB"
        );
    }
}
