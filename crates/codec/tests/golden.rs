//! The codec against the fixture's goldens (sglang-omni's ModifiedDAC, f64 PCM, exact codes).

mod common;

use std::sync::OnceLock;

use codec::max_abs_diff;
use common::{codec, long, short};

/// The long decode, computed once and shared by the tests that need it.
fn long_pcm() -> &'static Vec<f32> {
    static P: OnceLock<Vec<f32>> = OnceLock::new();
    P.get_or_init(|| {
        codec()
            .decode(&long().codes("codec_long_decode_codes"))
            .unwrap()
    })
}

#[test]
fn decode_matches_golden() {
    let codes = short().codes("codec_decode_codes");
    let pcm = codec().decode(&codes).unwrap();
    let gold = short().f64s("codec_decode_pcm_f64");
    let err = max_abs_diff(&pcm, &gold).expect("same length");
    eprintln!("decode max |err| {err:.3e}");
    assert!(err <= 1e-4, "decode max |err| {err:.3e} > 1e-4");
}

#[test]
fn encode_matches_golden() {
    let pcm = short().f32s("codec_encode_input_chirp");
    let codes = codec().encode(&pcm).unwrap();
    let gold = short().codes("codec_encode_codes");
    assert_eq!(codes, gold);
}

#[test]
fn long_decode_matches_golden() {
    let gold = long().f64s("codec_long_decode_pcm_f64");
    let err = max_abs_diff(long_pcm(), &gold).expect("same length");
    eprintln!("long decode max |err| {err:.3e}");
    assert!(err <= 1e-4, "long decode max |err| {err:.3e} > 1e-4");
}

#[test]
fn long_encode_matches_golden() {
    let pcm = long().f32s("codec_long_encode_input");
    let codes = codec().encode(&pcm).unwrap();
    let gold = long().codes("codec_long_encode_codes");
    let diff = codes
        .data()
        .iter()
        .zip(gold.data())
        .filter(|(a, b)| a != b)
        .count();
    assert_eq!(diff, 0, "{diff} of {} codes differ", gold.data().len());
    assert_eq!(codes, gold);
}
