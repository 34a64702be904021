//! The engine's promises: solo == concurrent, cancellation leaves no trace, overload refuses.

use speech::{Engine, EngineOptions, JobEvent, RequestErrorKind, SynthesisRequest};
use std::sync::Arc;

fn engine(parallel: usize, queue: usize) -> Arc<Engine> {
    engine_with(EngineOptions {
        parallel,
        queue: Some(queue),
        ..Default::default()
    })
}

/// An engine on the built-in checkpoint with the tests' cache, voices and a 2048-row window.
/// Prompts of up to 4095 rows take the CPU's exact linears, so prompts starting together are
/// prefilled joined (`Model::prefill_joined`), and the solo-equals-concurrent checks cover it.
fn engine_with(opts: EngineOptions) -> Arc<Engine> {
    exact_prompts();
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    Engine::load(EngineOptions {
        context: Some(2048),
        voices_dir: Some(cache.join("voices")),
        ..opts
    })
    .unwrap()
}

/// Every test sets this before its first engine, so the process reads one value whatever the
/// order the tests run in.
fn exact_prompts() {
    std::env::set_var("DRAMATIS_CPU_BULK_MIN_ROWS", "4096");
}

fn req(text: &str, seed: u64, frames: u64) -> SynthesisRequest {
    SynthesisRequest {
        text: text.into(),
        seed: Some(seed),
        max_frames: Some(frames),
        ..Default::default()
    }
}

#[test]
fn concurrent_requests_equal_their_solo_runs() {
    let texts = [
        "First voice speaks. And more.",
        "Second, a different line.",
        "Third one here!",
    ];
    let solo = engine(1, 4);
    let want: Vec<String> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            solo.submit(req(t, 10 + i as u64, 20))
                .unwrap()
                .wait()
                .unwrap()
                .1
                .pcm_sha256
        })
        .collect();
    drop(solo);
    let multi = engine(3, 4);
    let handles: Vec<_> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| multi.submit(req(t, 10 + i as u64, 20)).unwrap())
        .collect();
    let got: Vec<String> = handles
        .into_iter()
        .map(|h| h.wait().unwrap().1.pcm_sha256)
        .collect();
    assert_eq!(got, want);
    // Different seeds give different audio (the comparison above can fail).
    assert_ne!(
        want[0],
        multi
            .submit(req(texts[0], 99, 20))
            .unwrap()
            .wait()
            .unwrap()
            .1
            .pcm_sha256
    );
}

#[test]
fn a_start_limit_defers_prefills_and_changes_no_output() {
    let long: String = "A long opening request keeps the engine busy prefilling. ".repeat(12);
    let texts = [
        "Second, a different line.",
        "Third one here!",
        "And a fourth.",
    ];
    let run = |starts: usize, rows: Option<usize>| -> (Vec<String>, speech::EngineStats) {
        let e = engine_with(EngineOptions {
            parallel: 4,
            queue: Some(4),
            starts_per_round: starts,
            start_rows_per_round: rows,
            ..Default::default()
        });
        // the later three are queued while the first one's long prompt is prefilled, so the
        // worker's next look finds three waiting jobs and free lanes
        let mut handles = vec![e.submit(req(&long, 5, 12)).unwrap()];
        handles.extend(
            texts
                .iter()
                .enumerate()
                .map(|(i, t)| e.submit(req(t, 20 + i as u64, 12)).unwrap()),
        );
        let hashes = handles
            .into_iter()
            .map(|h| h.wait().unwrap().1.pcm_sha256)
            .collect();
        (hashes, e.stats())
    };
    let (free, free_stats) = run(0, Some(0));
    let (limited, limited_stats) = run(1, Some(0));
    // the default row limit (the plan's prefill chunk) holds the three short prompts together
    let (chunked, chunked_stats) = run(0, None);
    assert!(
        chunked_stats.starts_most >= 2,
        "{}",
        chunked_stats.starts_most
    );
    assert_eq!(chunked, free, "the default row limit changes no output");
    // a row limit of one starts one job a round (at least one always starts)
    let (by_rows, rows_stats) = run(0, Some(1));
    assert_eq!(rows_stats.starts_most, 1);
    assert!(
        rows_stats.starts_deferred >= 2,
        "{}",
        rows_stats.starts_deferred
    );
    assert_eq!(by_rows, free, "a row limit changes no output");
    // without a limit the three queued jobs start between the same two rounds, prefilled
    // joined (the lanes' PCM below equals the limited run's, where each starts alone)
    assert!(free_stats.starts_most >= 2, "{}", free_stats.starts_most);
    assert!(
        free_stats.prefills_joined >= 2,
        "{}",
        free_stats.prefills_joined
    );
    assert_eq!(limited_stats.prefills_joined, 0);
    // with it, never more than one, and the others waited (each counted once)
    assert_eq!(limited_stats.starts_most, 1);
    assert!(
        limited_stats.starts_deferred >= 2,
        "{}",
        limited_stats.starts_deferred
    );
    assert!(
        limited_stats.starts_deferred <= 3,
        "{}",
        limited_stats.starts_deferred
    );
    assert_eq!(
        limited, free,
        "a lane's output does not depend on when its neighbours start"
    );
}

#[test]
fn cancellation_leaves_the_next_request_unchanged() {
    let e = engine(1, 4);
    let fresh = e
        .submit(req("After the cancel.", 5, 16))
        .unwrap()
        .wait()
        .unwrap()
        .1
        .pcm_sha256;
    let mut h = e
        .submit(req("A long request that will be cancelled early.", 3, 200))
        .unwrap();
    // Wait for the first audio, then walk away.
    loop {
        match h.blocking_recv() {
            Some(JobEvent::Audio(_)) => break,
            Some(JobEvent::Done(_)) | None => break,
            _ => {}
        }
    }
    drop(h);
    let after = e
        .submit(req("After the cancel.", 5, 16))
        .unwrap()
        .wait()
        .unwrap()
        .1
        .pcm_sha256;
    assert_eq!(after, fresh);
    assert_eq!(e.stats().lanes_busy, 0);
}

#[test]
fn overload_is_refused_and_refusals_do_not_disturb() {
    let e = engine(1, 1);
    let h1 = e
        .submit(req("Keep the lane busy for a while.", 1, 300))
        .unwrap();
    let h2 = e.submit(req("Queued.", 2, 4)).unwrap();
    let r = e.submit(req("Refused.", 3, 4));
    let err = r.err().expect("third request must be refused");
    assert_eq!(err.kind, RequestErrorKind::Overloaded);
    h1.cancel();
    drop(h1);
    let _ = h2.wait().unwrap();
    // Invalid requests are refused before any work.
    let bad = e.submit(req("<|im_start|> sneaky", 1, 4)).err().unwrap();
    assert_eq!(bad.code, "structural_token");
    let big = e.submit(req("fits", 1, 5000)).err().unwrap();
    assert_eq!(big.kind, RequestErrorKind::Limit);
    assert!(big.message.contains("largest cap"), "{}", big.message);
}

#[test]
fn streamed_chunks_hash_to_the_summary() {
    let e = engine(1, 2);
    let (pcm, s) = e.submit(req("Hash me.", 4, 12)).unwrap().wait().unwrap();
    assert_eq!(speech::pcm::pcm_sha256(&pcm), s.pcm_sha256);
    assert_eq!(pcm.len() as u64, s.frames * 2048);
    assert_eq!(s.samples, pcm.len() as u64);
}

#[test]
fn window_boundary_is_exact_with_and_without_references() {
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    let c = 300u64;
    exact_prompts();
    let e = Engine::load(EngineOptions {
        context: Some(c),
        voices_dir: Some(cache.join("voices-window")),
        ..Default::default()
    })
    .unwrap();
    let reference = speech::ReferenceInput {
        audio: speech::ReferenceAudio::Codes(
            (0..40)
                .map(|f| (0..10).map(|k| (f + k) % 16).collect())
                .collect(),
        ),
        transcript: "Forty frames of reference.".into(),
    };
    for refs in [vec![], vec![reference]] {
        let mut r = req("One prompt, counted exactly.", 1, 1);
        r.references = refs.clone();
        let p = e.prompt_rows(&r).unwrap()[0];
        assert!(p > 2);
        // P + F + 1 = C: admitted with exactly that cap.
        r.max_frames = Some(c - p - 1);
        let h = e.submit(r.clone()).unwrap();
        let (_, s) = h.wait().unwrap();
        assert_eq!(s.frame_cap, c - p - 1);
        assert!(s.frames < c - p);
        // One more frame: refused, naming the largest F that fits.
        r.max_frames = Some(c - p);
        let err = e.submit(r.clone()).err().unwrap();
        assert_eq!(err.code, "frames_exceeded");
        assert!(
            err.message.contains(&format!("{}", c - p - 1)),
            "{}",
            err.message
        );
        // Without a cap the default (1024) shrinks to C - P - 1 and says so.
        r.max_frames = None;
        let (_, s) = e.submit(r.clone()).unwrap().wait().unwrap();
        assert_eq!(s.frame_cap, c - p - 1);
        assert_eq!(s.cap, speech::CapApplied::DefaultShrunk);
    }
    // One more prompt row than fits: a text longer than the window is refused before any work.
    let long = "word ".repeat(400);
    let err = e.submit(req(&long, 1, 1)).err().unwrap();
    assert_eq!(err.code, "window_exceeded");
}

fn wav(rate: u32, samples: usize) -> Vec<u8> {
    let pcm: Vec<i16> = (0..samples)
        .map(|i| ((i as f32 * 0.03).sin() * 9000.0) as i16)
        .collect();
    let mut s16 = speech::pcm::wav_bytes(&pcm, 44100);
    s16[24..28].copy_from_slice(&rate.to_le_bytes());
    s16[28..32].copy_from_slice(&rate.wrapping_mul(2).to_le_bytes());
    s16
}

#[test]
fn hostile_reference_clips_are_refused_before_work() {
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    let e = engine(1, 2);
    let with_clip = |bytes: Vec<u8>| {
        let mut r = req("Clone it.", 1, 4);
        r.references = vec![speech::ReferenceInput {
            audio: speech::ReferenceAudio::Wav(bytes),
            transcript: "A clip.".into(),
        }];
        r
    };
    // A header claiming 4.29 GHz must not size the resampler.
    let err = e.submit(with_clip(wav(4_294_967_291, 64))).err().unwrap();
    assert_eq!(err.code, "invalid_audio", "{}", err.message);
    // One whose header is consistent but whose rate is absurdly low is refused by rate too.
    let err = e.submit(with_clip(wav(1, 64))).err().unwrap();
    assert!(err.message.contains("sample rate"), "{}", err.message);
    // A clip longer than 646 frames (30 s) is refused from its length, before encoding.
    let t = std::time::Instant::now();
    let err = e.submit(with_clip(wav(8000, 8000 * 40))).err().unwrap();
    assert_eq!(err.code, "reference_too_long_frames", "{}", err.message);
    assert!(
        t.elapsed().as_secs_f64() < 2.0,
        "refused only after work: {:?}",
        t.elapsed()
    );
    // The next request is unaffected.
    let ok = e
        .submit(with_clip(wav(16000, 16000)))
        .unwrap()
        .wait()
        .unwrap();
    assert!(ok.1.frames >= 1);
}

#[test]
fn sentence_groups_are_bounded() {
    let e = engine(1, 2);
    let mut r = req(&"Hi. ".repeat(5000), 1, 2);
    r.chunk_length = Some(1);
    let err = e.submit(r).err().unwrap();
    assert_eq!(err.code, "too_many_segments");
    assert!(err.message.contains("4096"), "{}", err.message);
}

#[test]
fn whole_replies_are_checked_against_host_memory() {
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    exact_prompts();
    let e = Engine::load(EngineOptions {
        host_gib: Some(4.0),
        prompt_cache_gib: 0.0,
        voices_dir: Some(cache.join("voices-whole")),
        ..Default::default()
    })
    .unwrap();
    // The CPU plan is all host memory: nothing for a device receipt to compare with.
    assert_eq!(e.planned_device_bytes(), None);
    let plan = e.memory_plan();
    let host = plan.total(admission::Memory::Host).unwrap();
    // the host total is the sum of the plan's classes, against the 4 GiB given
    let summed: u64 = plan.classes.iter().map(|c| c.bytes.0).sum();
    assert_eq!(host.needed.0, summed, "{host:?}");
    assert!(summed > 0);
    assert_eq!(host.budget.map(|b| b.bytes.0), Some(4 << 30), "{host:?}");
    // 200000 frames x 2048 samples x 4 bytes = 1.6 GB: more than one of 5 in-flight replies
    // may hold in what 4 GiB leaves beside the plan.
    let mut r = req("Long.", 1, 200_000);
    r.whole_reply = true;
    let err = e.submit(r.clone()).err().unwrap();
    assert_eq!(err.code, "whole_reply_too_large", "{}", err.message);
    assert!(err.message.contains("1638400000"), "{}", err.message);
    // Streamed, the same request is admitted (then abandoned).
    r.whole_reply = false;
    let h = e.submit(r).unwrap();
    h.cancel();
}

/// A caller that stops reading pauses its own job once a set amount of audio waits unread, and
/// the job resumes, unchanged, as the caller reads; a lane beside it keeps going meanwhile.
#[test]
fn a_caller_that_stops_reading_pauses_its_job_only() {
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    exact_prompts();
    let e = Engine::load(EngineOptions {
        parallel: 2,
        queue: Some(4),
        context: Some(2048),
        voices_dir: Some(cache.join("voices")),
        max_unread_audio_seconds: 0.05,
        ..Default::default()
    })
    .unwrap();
    let frame = e.codec().frame_length() as u64;
    let limit = (0.05 * f64::from(e.codec().sample_rate())) as u64;
    // (the random-weight checkpoint ends this one after 81 frames, 3.8 s of audio)
    let text = "A long request that will be cancelled early.";
    let eager = e.submit(req(text, 3, 300)).unwrap().wait().unwrap().1;
    assert!(
        eager.frames >= 40,
        "too short to tell: {} frames",
        eager.frames
    );
    let mut slow = e.submit(req(text, 3, 300)).unwrap();
    // the other lane finishes while the slow one is paused
    let other = e.submit(req("Meanwhile, another caller.", 4, 40)).unwrap();
    let mut peak = 0;
    for _ in 0..30 {
        std::thread::sleep(std::time::Duration::from_millis(50));
        peak = peak.max(slow.unread_samples());
    }
    let (_, other_done) = other.wait().unwrap();
    // Frames count as unread from the moment they are made, so a lane under the limit makes at
    // most one more frame before it pauses; without the pause, 1.5 s of generation leaves far
    // more audio unread.
    assert!(
        peak <= limit + frame,
        "unread audio reached {peak} samples; the limit is {limit} (+ one frame of {frame})"
    );
    let mut pcm = 0u64;
    let done = loop {
        match slow.blocking_recv() {
            Some(JobEvent::Audio(a)) => pcm += a.len() as u64,
            Some(JobEvent::Done(s)) => break s,
            Some(JobEvent::Failed(m)) => panic!("the slow job failed: {m}"),
            Some(_) => {}
            None => panic!("the engine dropped the slow job"),
        }
    };
    assert_eq!(pcm, done.samples);
    assert_eq!(
        done.pcm_sha256, eager.pcm_sha256,
        "pausing changed the audio"
    );
    assert!(other_done.frames > 0);
    assert_eq!(slow.unread_samples(), 0);
}

/// A caller that reads nothing for longer than the pause limit loses its job, with an error that
/// names the figures, and its lane serves the next request.
#[test]
fn a_caller_that_never_reads_is_stopped_and_its_lane_freed() {
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    exact_prompts();
    let e = Engine::load(EngineOptions {
        parallel: 1,
        queue: Some(4),
        context: Some(2048),
        voices_dir: Some(cache.join("voices")),
        max_unread_audio_seconds: 0.05,
        max_pause_seconds: 0.3,
        ..Default::default()
    })
    .unwrap();
    let text = "A long request that will be cancelled early.";
    let mut stalled = e.submit(req(text, 3, 300)).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let failure = loop {
        match stalled.blocking_recv() {
            Some(JobEvent::Failed(m)) => break m,
            Some(JobEvent::Done(s)) => panic!("the stalled job finished ({} frames)", s.frames),
            Some(_) => {}
            None => panic!("no failure event"),
        }
    };
    // the message names the pause limit (0.3 s) and the unread limit (0.05 s)
    assert!(failure.contains("read no audio for 0.30 s"), "{failure}");
    assert!(failure.contains("unread (limit 0.05 s)"), "{failure}");
    // the one lane is free again
    let (_, next) = e
        .submit(req("Meanwhile, another caller.", 4, 40))
        .unwrap()
        .wait()
        .unwrap();
    assert!(next.frames > 0);
    assert_eq!(e.stats().lanes_busy, 0);
}

#[test]
fn a_cuda_plan_past_the_device_budget_is_refused_before_loading() {
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    // 1 MiB of device memory holds no weights: start-up names the device side and the flag,
    // on any build (the plan is checked before a backend exists)
    exact_prompts();
    let err = Engine::load(EngineOptions {
        backend: speech::BackendChoice::Cuda,
        device_gib: Some(1.0 / 1024.0),
        voices_dir: Some(cache.join("voices-device")),
        ..Default::default()
    })
    .err()
    .expect("a plan over the device budget must be refused");
    let msg = err.to_string();
    assert!(msg.contains("refused by the memory plan"), "{msg}");
    assert!(msg.contains("--device-gib"), "{msg}");
    assert!(msg.contains("device_memory_exceeded"), "{msg}");
    // a bad figure is named as such
    let err = Engine::load(EngineOptions {
        backend: speech::BackendChoice::Cuda,
        device_gib: Some(-1.0),
        ..Default::default()
    })
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("--device-gib -1"), "{err}");
}
