//! End to end over real HTTP on a loopback port, against the built-in tiny engine (random weights:
//! the audio is noise, but every stage runs).

mod support;

use serde_json::json;
use std::time::Duration;
use support::*;

fn take(seed: u64) -> serde_json::Value {
    json!({"input": "Hello there. How are you?", "seed": seed, "max_frames": 12})
}

/// Posts an OpenAI request and returns (status, pcm hash header, frames header).
async fn whole_hash(srv: &TestServer, body: serde_json::Value) -> (String, u64) {
    let r = srv.post_json("/v1/audio/speech", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    (
        r.header("x-dramatis-pcm-sha256").expect("hash").to_string(),
        r.header("x-dramatis-frames")
            .expect("frames")
            .parse()
            .unwrap(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn formats_share_one_pcm_hash() {
    let srv = TestServer::start().await;
    let mut body = take(7);
    let wav = srv.post_json("/v1/audio/speech", &body).await;
    assert_eq!(wav.status, 200, "{}", wav.text());
    assert_eq!(wav.header("content-type"), Some("audio/wav"));
    assert_eq!(wav.header("x-dramatis-seed"), Some("7"));
    assert_eq!(wav.header("x-dramatis-cap"), Some("explicit"));
    assert_eq!(wav.header("x-dramatis-frame-cap"), Some("12"));
    let frames: u64 = wav.header("x-dramatis-frames").unwrap().parse().unwrap();
    assert!((1..=12 * 2).contains(&frames), "frames {frames}");
    let hash = wav.header("x-dramatis-pcm-sha256").unwrap().to_string();
    let samples = wav_samples(&wav.body);
    assert_eq!(
        sha256_hex(samples),
        hash,
        "the header hashes the s16 samples sent"
    );
    assert_eq!(
        u32::from_le_bytes(wav.body[24..28].try_into().unwrap()),
        44_100
    );
    assert_eq!(
        u32::from_le_bytes(wav.body[40..44].try_into().unwrap()) as usize,
        samples.len()
    );

    body["response_format"] = json!("pcm");
    let pcm = srv.post_json("/v1/audio/speech", &body).await;
    assert_eq!(pcm.status, 200);
    assert_eq!(pcm.header("x-dramatis-pcm-sha256"), Some(hash.as_str()));
    assert_eq!(pcm.body, samples);

    body["response_format"] = json!("flac");
    let flac = srv.post_json("/v1/audio/speech", &body).await;
    assert_eq!(flac.status, 200);
    assert_eq!(flac.header("content-type"), Some("audio/flac"));
    assert_eq!(flac.header("x-dramatis-pcm-sha256"), Some(hash.as_str()));
    let mut reader = claxon::FlacReader::new(std::io::Cursor::new(&flac.body)).expect("FLAC");
    assert_eq!(reader.streaminfo().sample_rate, 44_100);
    assert_eq!(reader.streaminfo().channels, 1);
    let decoded: Vec<u8> = reader
        .samples()
        .flat_map(|s| (s.expect("sample") as i16).to_le_bytes())
        .collect();
    assert_eq!(
        sha256_hex(&decoded),
        hash,
        "FLAC decodes to the same samples"
    );

    // Another seed gives another take (the hash is not a constant).
    let (other, _) = whole_hash(&srv, take(8)).await;
    assert_ne!(other, hash);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_equal_the_whole_reply() {
    let srv = TestServer::start().await;
    let (hash, frames) = whole_hash(&srv, take(11)).await;

    let mut body = take(11);
    body["stream"] = json!(true);
    let r = srv.post_json("/v1/audio/speech", &body).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert!(r
        .header("content-type")
        .unwrap()
        .starts_with("text/event-stream"));
    assert_eq!(r.header("x-dramatis-seed"), Some("11"));
    assert!(r.complete);
    let (audio, done, finished) = sse(&r.body);
    assert!(finished, "ends with [DONE]");
    let done = done.expect("done event");
    assert_eq!(
        sha256_hex(&audio),
        hash,
        "SSE deltas decode to the whole reply's PCM"
    );
    assert_eq!(done["pcm_sha256"], hash.as_str());
    assert_eq!(done["frames"], frames);

    body["stream_format"] = json!("audio");
    body["response_format"] = json!("pcm");
    let r = srv.post_json("/v1/audio/speech", &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    assert!(r.complete);
    assert_eq!(sha256_hex(&r.body), hash, "raw pcm stream");

    body["response_format"] = json!("wav");
    let r = srv.post_json("/v1/audio/speech", &body).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("audio/wav"));
    assert_eq!(&r.body[4..8], &[0xff; 4], "streaming RIFF size");
    assert_eq!(&r.body[40..44], &[0xff; 4], "streaming data size");
    assert_eq!(sha256_hex(wav_samples(&r.body)), hash, "raw wav stream");

    // Fish streaming: chunked WAV of the same take.
    let fish = json!({"text": "Hello there. How are you?", "seed": 11, "max_new_tokens": 12, "streaming": true});
    let r = srv.post_json("/v1/tts", &fish).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("transfer-encoding"), Some("chunked"));
    assert_eq!(sha256_hex(wav_samples(&r.body)), hash, "fish stream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fish_tts_json_and_msgpack() {
    let srv = TestServer::start().await;
    let (hash, _) = whole_hash(&srv, take(5)).await;
    let fish = json!({
        "text": "Hello there. How are you?", "seed": 5, "max_new_tokens": 12, "format": "wav",
        "normalize": true, "latency": "normal", "repetition_penalty": 1.1, "use_memory_cache": "off"
    });
    let r = srv.post_json("/v1/tts", &fish).await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("x-dramatis-pcm-sha256"), Some(hash.as_str()));
    assert_eq!(
        r.header("x-dramatis-ignored"),
        Some("repetition_penalty, latency, use_memory_cache, normalize")
    );
    assert_eq!(
        r.header("content-disposition"),
        Some("attachment; filename=audio.wav")
    );

    // msgpack body, reference audio as raw bytes (as fish-speech's client sends it).
    #[derive(serde::Serialize)]
    struct Ref<'a> {
        #[serde(serialize_with = "as_bytes")]
        audio: &'a [u8],
        text: &'a str,
    }
    fn as_bytes<S: serde::Serializer>(b: &&[u8], s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(b)
    }
    #[derive(serde::Serialize)]
    struct Tts<'a> {
        text: &'a str,
        references: Vec<Ref<'a>>,
        reference_id: Option<String>,
        format: &'a str,
        seed: u64,
        max_new_tokens: u64,
        prosody: Option<u8>,
    }
    let clip = sine_wav(0.5, 44_100);
    let body = rmp_serde::to_vec_named(&Tts {
        text: "Hello there.",
        references: vec![Ref {
            audio: &clip,
            text: "A reference line.",
        }],
        reference_id: None,
        format: "pcm",
        seed: 3,
        max_new_tokens: 8,
        prosody: None,
    })
    .unwrap();
    let r = request(
        srv.addr,
        "POST",
        "/v1/tts",
        &[("content-type", "application/msgpack")],
        &body,
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.header("content-type"), Some("audio/pcm"));
    assert_eq!(
        Some(sha256_hex(&r.body).as_str()),
        r.header("x-dramatis-pcm-sha256")
    );
    assert!(r.header("x-dramatis-ignored").is_none());

    // The same reference inline in the OpenAI schema gives the same take.
    let openai = json!({
        "input": "Hello there.", "seed": 3, "max_frames": 8, "response_format": "pcm",
        "references": [{"audio": b64(&clip), "text": "A reference line."}]
    });
    let (h, _) = whole_hash(&srv, openai).await;
    assert_eq!(Some(h.as_str()), r.header("x-dramatis-pcm-sha256"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_requests_are_400_and_leave_the_next_take_unchanged() {
    let srv = TestServer::start().await;
    let (baseline, _) = whole_hash(&srv, take(21)).await;
    let raw = |body: &'static str| async move {
        request(
            srv.addr,
            "POST",
            "/v1/audio/speech",
            &[("content-type", "application/json")],
            body.as_bytes(),
        )
        .await
    };
    let cases: Vec<(Reply, &str)> = vec![
        (raw("{\"input\": \"hi\"").await, "invalid_json"),
        (raw("").await, "invalid_json"),
        (
            srv.post_json("/v1/audio/speech", &json!({"input": 42}))
                .await,
            "invalid_type",
        ),
        (
            srv.post_json("/v1/audio/speech", &json!({"voice": "x"}))
                .await,
            "missing_field",
        ),
        (
            srv.post_json("/v1/audio/speech", &json!({"input": "a <|im_start|> b"}))
                .await,
            "structural_token",
        ),
        (
            srv.post_json(
                "/v1/audio/speech",
                &json!({"input": "<|speaker:16|> hello"}),
            )
            .await,
            "invalid_speaker_tag",
        ),
        (
            srv.post_json(
                "/v1/audio/speech",
                &json!({"input": "hi", "temperature": 2.5}),
            )
            .await,
            "invalid_temperature",
        ),
        (
            srv.post_json("/v1/audio/speech", &json!({"input": "hi", "top_p": 1.01}))
                .await,
            "invalid_top_p",
        ),
        (
            srv.post_json("/v1/audio/speech", &json!({"input": "hi", "top_k": 5000}))
                .await,
            "invalid_top_k",
        ),
        (
            srv.post_json("/v1/audio/speech", &json!({"input": "hi", "speed": 2.0}))
                .await,
            "unsupported_speed",
        ),
        (
            srv.post_json(
                "/v1/audio/speech",
                &json!({"input": "hi", "voice": "nobody"}),
            )
            .await,
            "unknown_voice",
        ),
        (
            srv.post_json(
                "/v1/audio/speech",
                &json!({"input": "hi", "response_format": "mp3"}),
            )
            .await,
            "unsupported_response_format",
        ),
        (
            srv.post_json(
                "/v1/audio/speech",
                &json!({"input": "hi", "cfg_gamma": 1.0}),
            )
            .await,
            "cfg_gamma_not_allowed",
        ),
        (
            srv.post_json("/v1/audio/speech", &json!({"input": "   "}))
                .await,
            "empty_input",
        ),
        (
            srv.post_json("/v1/audio/speech", &json!({"input": "hi", "max_frames": 0}))
                .await,
            "frames_zero",
        ),
        (
            srv.post_json(
                "/v1/audio/speech",
                &json!({"input": "hi", "references": [{"audio": b64(b"not a wav"), "text": "t"}]}),
            )
            .await,
            "invalid_audio",
        ),
        (
            srv.post_json(
                "/v1/tts",
                &json!({"text": "hi", "streaming": true, "format": "pcm"}),
            )
            .await,
            "streaming_requires_wav",
        ),
        (
            srv.post_json("/v1/tts", &json!({"text": "hi", "format": "mp3"}))
                .await,
            "unsupported_format",
        ),
        (
            srv.post_json("/v1/tts", &json!({"text": "hi", "top_p": 0}))
                .await,
            "invalid_top_p",
        ),
    ];
    for (reply, want) in cases {
        let code = reply.error_code(400, "invalid_request_error");
        assert_eq!(code, want, "{}", reply.text());
        assert!(reply.header("x-dramatis-pcm-sha256").is_none());
    }
    // Wrong types carry the field as `param`.
    let r = srv
        .post_json("/v1/audio/speech", &json!({"input": "hi", "seed": "seven"}))
        .await;
    r.error_code(400, "invalid_request_error");
    assert_eq!(r.json()["error"]["param"], "seed");
    // Unknown routes and methods answer in the same shape.
    let r = srv.get("/v1/nothing").await;
    assert_eq!(r.error_code(404, "invalid_request_error"), "not_found");
    let r = srv.get("/v1/audio/speech").await;
    assert_eq!(
        r.error_code(405, "invalid_request_error"),
        "method_not_allowed"
    );

    let (after, _) = whole_hash(&srv, take(21)).await;
    assert_eq!(after, baseline, "refusals leave the next take unchanged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn over_limits_are_413_with_figures() {
    let srv = TestServer::with(
        |o| {
            o.limits.input_policy.max_body_bytes = admission::InputBytes(64 * 1024);
            o.limits.input_policy.max_text_bytes = admission::InputBytes(1000);
        },
        Vec::new(),
    )
    .await;
    let facts = srv.get("/v1/models").await.json()["data"][0]["speech"].clone();
    assert_eq!(facts["input_policy"]["max_body_bytes"], 65_536);

    let r = srv
        .post_json("/v1/audio/speech", &json!({"input": "a".repeat(1001)}))
        .await;
    assert_eq!(r.error_code(413, "limit_exceeded"), "text_too_long_bytes");
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("1001") && msg.contains("1000"), "{msg}");

    let frames_max = facts["frames_max"].as_u64().unwrap();
    let r = srv
        .post_json(
            "/v1/audio/speech",
            &json!({"input": "hi", "max_frames": frames_max + 1}),
        )
        .await;
    assert_eq!(r.error_code(413, "limit_exceeded"), "frames_exceeded");
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains(&(frames_max + 1).to_string()), "{msg}");
    assert_eq!(r.json()["error"]["param"], "max_frames");

    let big = json!({"input": "hi", "pad": "x".repeat(70 * 1024)});
    let r = srv.post_json("/v1/audio/speech", &big).await;
    assert_eq!(r.error_code(413, "limit_exceeded"), "body_too_large");
    let msg = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(msg.contains("65536 bytes"), "{msg}");
    // Chunked bodies (no Content-Length) are cut at the limit too.
    let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let chunk = vec![b' '; 32 * 1024];
    let mut req = b"POST /v1/audio/speech HTTP/1.1\r\nhost: t\r\nconnection: close\r\ntransfer-encoding: chunked\r\ncontent-type: application/json\r\n\r\n".to_vec();
    for _ in 0..3 {
        req.extend_from_slice(format!("{:x}\r\n", chunk.len()).as_bytes());
        req.extend_from_slice(&chunk);
        req.extend_from_slice(b"\r\n");
    }
    req.extend_from_slice(b"0\r\n\r\n");
    let _ = s.write_all(&req).await;
    let mut raw = Vec::new();
    let _ = s.read_to_end(&mut raw).await;
    let r = parse(&raw);
    assert_eq!(r.error_code(413, "limit_exceeded"), "body_too_large");

    // A request right after is served.
    let (_, frames) = whole_hash(&srv, take(1)).await;
    assert!(frames >= 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_keys_guard_everything_but_health() {
    let srv = TestServer::with(|_| {}, vec!["k1".into(), "k2".into()]).await;
    let r = srv.get("/health").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.json()["status"], "ok");
    for path in ["/v1/models", "/v1/voices", "/metrics", "/openapi.json"] {
        let r = srv.get(path).await;
        assert_eq!(
            r.error_code(401, "authentication_error"),
            "missing_api_key",
            "{path}"
        );
    }
    let r = srv.post_json("/v1/audio/speech", &take(1)).await;
    assert_eq!(r.error_code(401, "authentication_error"), "missing_api_key");
    let r = request(
        srv.addr,
        "GET",
        "/v1/models",
        &[("authorization", "Bearer nope")],
        b"",
    )
    .await;
    assert_eq!(r.error_code(401, "authentication_error"), "invalid_api_key");
    let r = request(
        srv.addr,
        "GET",
        "/v1/models",
        &[("authorization", "Bearer k2")],
        b"",
    )
    .await;
    assert_eq!(r.status, 200);
    let body = take(2).to_string();
    let r = request(
        srv.addr,
        "POST",
        "/v1/audio/speech",
        &[
            ("authorization", "Bearer k1"),
            ("content-type", "application/json"),
        ],
        body.as_bytes(),
    )
    .await;
    assert_eq!(r.status, 200, "{}", r.text());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_openapi_and_metrics() {
    let srv = TestServer::start().await;
    let m = srv.get("/v1/models").await;
    assert_eq!(m.status, 200);
    let v = m.json();
    assert_eq!(v["object"], "list");
    let model = &v["data"][0];
    assert_eq!(model["object"], "model");
    let id = model["id"].as_str().unwrap().to_string();
    let s = &model["speech"];
    assert_eq!(s["window_rows"], WINDOW);
    for key in [
        "prompt_rows_max",
        "frames_default",
        "frames_max",
        "sample_rate",
        "frame_length",
        "codebooks",
        "lanes",
        "backend",
        "expert_format",
    ] {
        assert!(!s[key].is_null(), "{key}");
    }
    assert_eq!(s["frames_default"], 1024);
    assert_eq!(s["sample_rate"], 44_100);
    assert_eq!(s["input_policy"]["max_body_bytes"], 32 << 20);
    assert_eq!(s["input_policy"]["max_code_points"], 262_144);
    assert_eq!(s["reference_limits"]["max_passages"], 4);
    assert_eq!(srv.get(&format!("/v1/models/{id}")).await.status, 200);
    assert_eq!(srv.get("/v1/models/other").await.status, 404);

    let doc = srv.get("/openapi.json").await;
    assert_eq!(doc.status, 200);
    let d = doc.json();
    assert!(d["openapi"].as_str().unwrap().starts_with('3'));
    for p in [
        "/v1/audio/speech",
        "/v1/tts",
        "/v1/models",
        "/v1/voices",
        "/health",
        "/metrics",
        "/openapi.json",
    ] {
        assert!(d["paths"][p].is_object(), "{p}");
    }
    assert!(d["components"]["schemas"]["SpeechRequest"]["properties"]["references"].is_object());

    // One success, two refusals, then the exposition counts them.
    whole_hash(&srv, take(3)).await;
    srv.post_json("/v1/audio/speech", &json!({"input": "hi", "top_p": 7}))
        .await;
    srv.post_json("/v1/audio/speech", &json!({"input": "hi", "top_p": 7}))
        .await;
    srv.post_json("/v1/audio/speech", &json!({"input": "<|im_end|>"}))
        .await;
    let r = srv.get("/metrics").await;
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/plain"));
    let samples = prometheus_samples(&r.text());
    let get = |name: &str| {
        samples
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .unwrap_or_else(|| panic!("{name} missing in\n{}", r.text()))
    };
    assert_eq!(
        get(r#"dramatis_refusals_total{reason="invalid_top_p"}"#),
        2.0
    );
    assert_eq!(
        get(r#"dramatis_refusals_total{reason="structural_token"}"#),
        1.0
    );
    assert_eq!(
        get(r#"dramatis_http_requests_total{route="/v1/audio/speech",status="400"}"#),
        3.0
    );
    assert_eq!(
        get(r#"dramatis_http_requests_total{route="/v1/audio/speech",status="200"}"#),
        1.0
    );
    assert!(get("dramatis_frames_generated_total") >= 1.0);
    // no --starts-per-round: nothing is ever deferred
    assert_eq!(get("dramatis_starts_deferred_total"), 0.0);
    // one request alone: prefilled alone; its audio came from codec calls of at least a frame
    assert_eq!(get("dramatis_prefills_joined_total"), 0.0);
    assert!(get("dramatis_codec_calls_total") >= 1.0);
    assert!(get("dramatis_codec_frames_total") >= get("dramatis_codec_calls_total"));
    assert!(get("dramatis_codec_frames_total") <= get("dramatis_frames_generated_total"));
    assert!(get("dramatis_codec_busy_seconds_total") > 0.0);
    // the CPU backend draws on the host: at least one host round per frame generated
    assert!(
        get(r#"dramatis_frame_rounds_total{how="host"}"#) >= get("dramatis_frames_generated_total")
    );
    assert_eq!(get("dramatis_time_to_first_audio_seconds_count"), 1.0);
    assert_eq!(get("dramatis_lanes"), 1.0);
    assert_eq!(get("dramatis_lanes_busy"), 0.0);
    assert_eq!(get("dramatis_queue_depth"), 0.0);
}

/// Parses the Prometheus text format strictly enough to catch a malformed exposition:
/// every non-comment line is `name{labels} value`, every metric has HELP and TYPE.
fn prometheus_samples(text: &str) -> Vec<(String, f64)> {
    let mut typed = std::collections::HashSet::new();
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.is_empty()) {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            typed.insert(parts.next().unwrap().to_string());
            let kind = parts.next().unwrap();
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind),
                "{line}"
            );
            continue;
        }
        if line.starts_with("# HELP ") {
            continue;
        }
        assert!(!line.starts_with('#'), "{line}");
        let (name, value) = line.rsplit_once(' ').unwrap_or_else(|| panic!("{line}"));
        let value: f64 = value.parse().unwrap_or_else(|_| panic!("value in {line}"));
        let base = name.split('{').next().unwrap();
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| base.strip_suffix(s).filter(|b| typed.contains(*b)))
            .unwrap_or(base);
        assert!(typed.contains(family), "no TYPE for {name}");
        if let Some(labels) = name.split_once('{').map(|(_, l)| l) {
            assert!(labels.ends_with('}'), "{line}");
        }
        out.push((name.to_string(), value));
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voices_add_list_use_remove() {
    let srv = TestServer::start().await;
    let clip = sine_wav(0.6, 22_050);
    let r = srv
        .post_json(
            "/v1/voices",
            &json!({"name": "ann", "audio": b64(&clip), "text": "A short line."}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    assert_eq!(r.json()["name"], "ann");
    assert!(r.json()["frames"].as_u64().unwrap() >= 1);
    let list = srv.get("/v1/voices").await.json();
    assert_eq!(list["object"], "list");
    assert_eq!(list["data"][0]["name"], "ann");

    let mut body = take(4);
    body["voice"] = json!("ann");
    let (with_voice, _) = whole_hash(&srv, body.clone()).await;
    let (builtin, _) = whole_hash(&srv, take(4)).await;
    assert_ne!(with_voice, builtin, "the voice conditions the take");
    let mut fish = json!({"text": "Hello there. How are you?", "seed": 4, "max_new_tokens": 12, "reference_id": "ann"});
    let r = srv.post_json("/v1/tts", &fish).await;
    // The second take of the voice restores its reference prefill from the cache: a hit equals
    // the first take's miss.
    assert_eq!(r.header("x-dramatis-pcm-sha256"), Some(with_voice.as_str()));
    let metrics = srv.get("/metrics").await.text();
    assert!(
        metrics.contains("dramatis_prompt_cache_hits 1"),
        "{metrics}"
    );

    let r = srv
        .post_json(
            "/v1/voices",
            &json!({"name": "../x", "audio": b64(&clip), "text": "t"}),
        )
        .await;
    assert_eq!(
        r.error_code(400, "invalid_request_error"),
        "invalid_voice_name"
    );
    let r = srv
        .post_json(
            "/v1/voices",
            &json!({"name": "bob", "audio": b64(b"junk"), "text": "t"}),
        )
        .await;
    assert_eq!(r.error_code(400, "invalid_request_error"), "invalid_audio");

    let r = request(srv.addr, "DELETE", "/v1/voices/ann", &[], b"").await;
    assert_eq!(r.status, 200, "{}", r.text());
    assert_eq!(r.json()["deleted"], true);
    let r = request(srv.addr, "DELETE", "/v1/voices?name=ann", &[], b"").await;
    assert_eq!(
        r.error_code(404, "invalid_request_error"),
        "voice_not_found"
    );
    fish["reference_id"] = json!("ann");
    let r = srv.post_json("/v1/tts", &fish).await;
    assert_eq!(r.error_code(400, "invalid_request_error"), "unknown_voice");
    assert_eq!(srv.get("/v1/voices").await.json()["data"], json!([]));
}

/// About a minute of generation on the tiny engine: 100 one-sentence segments.
fn long_take(seed: u64) -> serde_json::Value {
    let text: String = (0..100).map(|i| format!("Sentence number {i}. ")).collect();
    json!({"input": text, "seed": seed, "chunk_length": 1})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn full_lanes_and_queue_give_503_and_disconnects_cancel() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let srv = TestServer::with(|o| o.queue = Some(0), Vec::new()).await;
    let (baseline, _) = whole_hash(&srv, take(9)).await;
    let frames_start = srv.engine.stats().frames_total;

    // A long raw stream: read some audio, then stop reading and hang up.
    let mut long = long_take(1);
    long["stream"] = json!(true);
    long["stream_format"] = json!("audio");
    long["response_format"] = json!("pcm");
    let long = long.to_string();
    let (mut conn, head) = open(
        srv.addr,
        "/v1/audio/speech",
        &[("content-type", "application/json")],
        long.as_bytes(),
    )
    .await;
    let mut got = head.len();
    let mut buf = [0u8; 8192];
    while got < 64 * 1024 {
        got += conn.read(&mut buf).await.unwrap();
    }
    assert_eq!(
        srv.engine.stats().lanes_busy,
        1,
        "the stream holds the lane"
    );
    let r = srv.post_json("/v1/audio/speech", &take(9)).await;
    assert_eq!(r.error_code(503, "overloaded"), "overloaded");
    assert_eq!(r.header("retry-after"), Some("1"));
    drop(conn);
    assert!(
        srv.wait_lanes(0, Duration::from_secs(5)).await,
        "a dropped stream frees its lane at the next frame"
    );

    // A whole reply abandoned mid-generation is cancelled too.
    let long_whole = long_take(2).to_string();
    let mut s = tokio::net::TcpStream::connect(srv.addr).await.unwrap();
    s.write_all(
        format!(
            "POST /v1/audio/speech HTTP/1.1\r\nhost: t\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{long_whole}",
            long_whole.len()
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    assert!(srv.wait_lanes(1, Duration::from_secs(10)).await);
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(s);
    assert!(
        srv.wait_lanes(0, Duration::from_secs(5)).await,
        "a dropped whole reply frees its lane"
    );
    // Both long takes would have generated thousands of frames.
    let spent = srv.engine.stats().frames_total - frames_start;
    assert!(
        spent < 1500,
        "{spent} frames generated after the clients left"
    );

    let (after, _) = whole_hash(&srv, take(9)).await;
    assert_eq!(
        after, baseline,
        "cancellations leave the next take unchanged"
    );
    let metrics = srv.get("/metrics").await.text();
    assert!(
        metrics.contains("dramatis_refusals_total{reason=\"overloaded\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("dramatis_jobs_cancelled_total 2"),
        "{metrics}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_takes_equal_solo_takes() {
    let srv = TestServer::with(|o| o.parallel = 2, Vec::new()).await;
    let bodies: Vec<serde_json::Value> = (0..4)
        .map(|i| json!({"input": format!("Line number {i}. And more."), "seed": 100 + i, "max_frames": 10}))
        .collect();
    let mut solo = Vec::new();
    for b in &bodies {
        solo.push(whole_hash(&srv, b.clone()).await.0);
    }
    let addr = srv.addr;
    let tasks: Vec<_> = bodies
        .iter()
        .map(|b| {
            let body = b.to_string();
            tokio::spawn(async move {
                request(
                    addr,
                    "POST",
                    "/v1/audio/speech",
                    &[("content-type", "application/json")],
                    body.as_bytes(),
                )
                .await
            })
        })
        .collect();
    for (t, want) in tasks.into_iter().zip(&solo) {
        let r = t.await.unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.header("x-dramatis-pcm-sha256"), Some(want.as_str()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_cancels_streams_and_returns_ok() {
    let srv = TestServer::start().await;
    let mut long = long_take(3);
    long["stream"] = json!(true);
    let long = long.to_string();
    let (mut conn, _) = open(
        srv.addr,
        "/v1/audio/speech",
        &[("content-type", "application/json")],
        long.as_bytes(),
    )
    .await;
    assert!(srv.wait_lanes(1, Duration::from_secs(10)).await);
    let engine = std::sync::Arc::clone(&srv.engine);
    let addr = srv.addr;
    srv.stop().await.expect("graceful shutdown returns Ok");
    assert_eq!(engine.stats().lanes_busy, 0);
    // The open stream was ended (with an error event), and nothing listens any more.
    use tokio::io::AsyncReadExt;
    let mut rest = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), conn.read_to_end(&mut rest)).await;
    let rest = String::from_utf8_lossy(&rest);
    assert!(
        rest.contains(r#""type":"error""#),
        "the stream ends with an error event"
    );
    assert!(
        !rest.contains("[DONE]"),
        "a cancelled take never looks complete"
    );
    assert!(tokio::net::TcpStream::connect(addr).await.is_err());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn voices_persist_across_restart() {
    let kept = tempfile::tempdir().unwrap();
    let opts = engine_options(kept.path());
    let srv = TestServer::on(opts.clone(), Vec::new(), tempfile::tempdir().unwrap()).await;
    let clip = sine_wav(0.4, 44_100);
    let r = srv
        .post_json(
            "/v1/voices",
            &json!({"name": "kept", "audio": b64(&clip), "text": "Kept."}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.text());
    let mut body = take(6);
    body["voice"] = json!("kept");
    let (first, _) = whole_hash(&srv, body.clone()).await;
    srv.stop().await.unwrap();

    let srv = TestServer::on(opts, Vec::new(), tempfile::tempdir().unwrap()).await;
    assert_eq!(
        srv.get("/v1/voices").await.json()["data"][0]["name"],
        "kept"
    );
    let (again, _) = whole_hash(&srv, body).await;
    assert_eq!(
        again, first,
        "a restarted server gives the same take with the stored voice"
    );
}
