//! The reference prefill cache: a hit gives exactly the uncached output; changed references miss.

use speech::{Engine, EngineOptions, ReferenceAudio, ReferenceInput, SynthesisRequest};
use std::sync::Arc;

fn engine(gib: f64) -> Arc<Engine> {
    let cache = std::env::temp_dir().join("dramatis-engine-tests-cache");
    std::env::set_var("XDG_CACHE_HOME", &cache);
    Engine::load(EngineOptions {
        context: Some(1024),
        prompt_cache_gib: gib,
        voices_dir: Some(cache.join("voices-pc")),
        ..Default::default()
    })
    .unwrap()
}

fn req(shift: i64, text: &str) -> SynthesisRequest {
    let codes: Vec<Vec<i64>> = (0..8)
        .map(|f| (0..10).map(|c| (f * 5 + c * 3 + shift) % 16).collect())
        .collect();
    SynthesisRequest {
        text: text.into(),
        references: vec![ReferenceInput {
            audio: ReferenceAudio::Codes(codes),
            transcript: "Reference words here.".into(),
        }],
        seed: Some(3),
        max_frames: Some(16),
        // One sentence per segment: both segments share the reference prefix.
        chunk_length: Some(10),
        ..Default::default()
    }
}

fn hash(e: &Arc<Engine>, r: SynthesisRequest) -> String {
    e.submit(r).unwrap().wait().unwrap().1.pcm_sha256
}

#[test]
fn hit_equals_miss_and_changed_references_miss() {
    let uncached = engine(0.0);
    let want = hash(&uncached, req(0, "First sentence. Second sentence."));
    assert_eq!(uncached.stats().prompt_cache_hits, 0);

    let e = engine(1.0);
    let miss = hash(&e, req(0, "First sentence. Second sentence."));
    // Two segments share the prefix: the second one already hits.
    let s = e.stats();
    assert_eq!((s.prompt_cache_misses, s.prompt_cache_hits), (1, 1));
    let hit = hash(&e, req(0, "First sentence. Second sentence."));
    assert_eq!(e.stats().prompt_cache_hits, 3);
    assert_eq!(miss, want);
    assert_eq!(hit, want);

    // Other references: a miss, and other audio.
    let other = hash(&e, req(1, "First sentence. Second sentence."));
    assert_eq!(e.stats().prompt_cache_misses, 2);
    assert_ne!(other, want);
}

/// A reference longer than one prefill chunk (512 rows): the prefix is prefilled in chunks from
/// its start and the text from the end of the prefix, so a hit still equals a miss.
#[test]
fn a_reference_longer_than_a_prefill_chunk_hits_like_it_misses() {
    let long = |shift: i64| {
        let mut r = req(shift, "Only one sentence here.");
        let codes: Vec<Vec<i64>> = (0..600)
            .map(|f| (0..10).map(|c| (f * 7 + c * 3 + shift) % 16).collect())
            .collect();
        r.references[0].audio = ReferenceAudio::Codes(codes);
        r
    };
    let want = hash(&engine(0.0), long(0));
    let e = engine(1.0);
    let miss = hash(&e, long(0));
    let hit = hash(&e, long(0));
    let s = e.stats();
    assert_eq!((s.prompt_cache_misses, s.prompt_cache_hits), (1, 1));
    assert_eq!(miss, want);
    assert_eq!(hit, want);
}
