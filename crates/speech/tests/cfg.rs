//! Classifier-free guidance: qualified by equality at γ = 0, effective at γ > 0, batched ==
//! separate, never applied without a reference, and per-request γ validated.

use speech::{
    CfgOptions, Engine, EngineOptions, ReferenceAudio, ReferenceInput, RequestErrorKind,
    SynthesisRequest,
};
use std::sync::Arc;

fn engine(cfg: CfgOptions) -> Arc<Engine> {
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    Engine::load(EngineOptions {
        context: Some(1024),
        cfg,
        voices_dir: Some(cache.join("voices-cfg")),
        ..Default::default()
    })
    .unwrap()
}

fn reference() -> ReferenceInput {
    // Codes straight from a small deterministic pattern (the codec encoder is tested elsewhere).
    let codes: Vec<Vec<i64>> = (0..6)
        .map(|f| (0..10).map(|c| ((f * 7 + c * 3) % 16) as i64).collect())
        .collect();
    ReferenceInput {
        audio: ReferenceAudio::Codes(codes),
        transcript: "A short reference line.".into(),
    }
}

fn run(e: &Arc<Engine>, refs: bool, gamma: Option<f32>) -> (String, bool) {
    let r = SynthesisRequest {
        text: "Guided speech, one sentence.".into(),
        references: if refs { vec![reference()] } else { vec![] },
        seed: Some(11),
        max_frames: Some(20),
        cfg_gamma: gamma,
        ..Default::default()
    };
    let (_, s) = e.submit(r).unwrap().wait().unwrap();
    (s.pcm_sha256, s.guided)
}

#[test]
fn forced_guided_path_at_zero_equals_unguided() {
    let plain = run(&engine(CfgOptions::default()), true, None);
    assert!(!plain.1);
    let forced = run(
        &engine(CfgOptions {
            force_guided: true,
            ..Default::default()
        }),
        true,
        None,
    );
    assert!(forced.1, "the forced path must run both branches");
    assert_eq!(forced.0, plain.0);
    let forced_b = run(
        &engine(CfgOptions {
            force_guided: true,
            batched: true,
            ..Default::default()
        }),
        true,
        None,
    );
    assert_eq!(forced_b.0, plain.0);
}

#[test]
fn guidance_changes_output_and_batched_equals_separate() {
    let plain = run(&engine(CfgOptions::default()), true, None);
    let g = run(
        &engine(CfgOptions {
            gamma: 3.0,
            ..Default::default()
        }),
        true,
        None,
    );
    assert!(g.1);
    assert_ne!(g.0, plain.0, "γ = 3 should change the semantic draws");
    let gb = run(
        &engine(CfgOptions {
            gamma: 3.0,
            batched: true,
            ..Default::default()
        }),
        true,
        None,
    );
    assert_eq!(gb.0, g.0);
}

#[test]
fn no_reference_is_never_guided() {
    let plain = run(&engine(CfgOptions::default()), false, None);
    let g = run(
        &engine(CfgOptions {
            gamma: 3.0,
            force_guided: true,
            ..Default::default()
        }),
        false,
        None,
    );
    assert!(!g.1);
    assert_eq!(g.0, plain.0);
}

#[test]
fn request_gamma_is_validated() {
    let e = engine(CfgOptions::default());
    let mk = |g: f32| SynthesisRequest {
        text: "x.".into(),
        references: vec![reference()],
        cfg_gamma: Some(g),
        max_frames: Some(4),
        ..Default::default()
    };
    let err = e.submit(mk(1.0)).err().unwrap();
    assert_eq!(err.code, "cfg_gamma_not_allowed");
    let e = engine(CfgOptions {
        allow_request_gamma: true,
        ..Default::default()
    });
    for bad in [f32::NAN, f32::INFINITY, -0.5, 10.5] {
        let err = e.submit(mk(bad)).err().unwrap();
        assert_eq!(err.kind, RequestErrorKind::Invalid);
        assert_eq!(err.code, "invalid_cfg_gamma");
    }
    let ok = run(&e, true, Some(3.0));
    let server = run(
        &engine(CfgOptions {
            gamma: 3.0,
            ..Default::default()
        }),
        true,
        None,
    );
    assert_eq!(ok.0, server.0);
}

#[test]
fn request_gammas_replay_and_sequences_match() {
    let e = engine(CfgOptions {
        allow_request_gamma: true,
        ..Default::default()
    });
    let g1 = run(&e, true, Some(1.0));
    let g2 = run(&e, true, Some(2.0));
    assert!(g1.1 && g2.1);
    assert_ne!(g1.0, g2.0);
    // Each γ reproduces its own hash, in any order: A, A -> B -> A.
    assert_eq!(run(&e, true, Some(1.0)).0, g1.0);
    assert_eq!(run(&e, true, Some(2.0)).0, g2.0);
    assert_eq!(run(&e, true, Some(1.0)).0, g1.0);
    // A after a cancelled guided request.
    let mut h = e
        .submit(SynthesisRequest {
            text: "A guided request that is abandoned. It has two sentences.".into(),
            references: vec![reference()],
            seed: Some(5),
            max_frames: Some(200),
            cfg_gamma: Some(2.0),
            ..Default::default()
        })
        .unwrap();
    while let Some(ev) = h.blocking_recv() {
        if matches!(ev, speech::JobEvent::Audio(_) | speech::JobEvent::Done(_)) {
            break;
        }
    }
    drop(h);
    assert_eq!(run(&e, true, Some(1.0)).0, g1.0);
}

#[test]
fn guided_request_filling_the_window_is_admitted() {
    // The pool holds a second window per lane when guidance can run: a guided request whose
    // conditional branch fills C (default cap shrunk to C - P - 1) is admitted, not refused.
    let e = engine(CfgOptions {
        gamma: 1.0,
        ..Default::default()
    });
    let r = SynthesisRequest {
        text: "Fill it.".into(),
        references: vec![reference()],
        seed: Some(1),
        ..Default::default()
    };
    let p = e.prompt_rows(&r).unwrap()[0];
    let h = e.submit(r).unwrap();
    let (_, s) = h.wait().unwrap();
    assert!(s.guided);
    assert_eq!(s.frame_cap, 1024 - p - 1);
    assert_eq!(s.cap, speech::CapApplied::DefaultShrunk);
}
