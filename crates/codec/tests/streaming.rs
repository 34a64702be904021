//! Streamed decode equals the whole decode bit for bit, for any chunking, including across the
//! 128-frame window of `post_module`; and load/input errors are clear.

mod common;

use codec::{Codec, CodecConfig, CodecError, Codes};
use common::{codec, fixture, long, short};

fn streamed(codes: &Codes, chunk: usize) -> Vec<f32> {
    let mut st = codec().decoder_state();
    let mut pcm = Vec::new();
    let mut f = 0;
    while f < codes.frames() {
        let end = (f + chunk).min(codes.frames());
        let part = st.push(&codes.slice(f, end)).unwrap();
        assert_eq!(part.len(), (end - f) * codec().frame_length());
        pcm.extend(part);
        f = end;
    }
    assert_eq!(st.frames(), codes.frames() as u64);
    pcm
}

fn first_diff(a: &[f32], b: &[f32]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x.to_bits() != y.to_bits())
}

#[test]
fn short_chunked_equals_whole() {
    let codes = short().codes("codec_decode_codes");
    let whole = codec().decode(&codes).unwrap();
    for chunk in [1, 2, 3, 5, 16] {
        let pcm = streamed(&codes, chunk);
        assert_eq!(pcm.len(), whole.len());
        assert_eq!(first_diff(&pcm, &whole), None, "chunk {chunk}");
    }
}

#[test]
fn long_chunked_equals_whole_across_the_window() {
    let codes = long().codes("codec_long_decode_codes");
    assert!(
        codes.frames() > 2 * 128,
        "the long codes must cross the 128-frame window"
    );
    let whole = codec().decode(&codes).unwrap();
    // One push of all 300 frames, and chunkings that straddle frame 128 differently.
    for chunk in [300, 1, 3, 16, 127, 129] {
        let pcm = streamed(&codes, chunk);
        assert_eq!(first_diff(&pcm, &whole), None, "chunk {chunk}");
    }
}

#[test]
fn mixed_chunk_sizes_equal_whole() {
    let codes = long().codes("codec_long_decode_codes").slice(0, 200);
    let whole = codec().decode(&codes).unwrap();
    let mut st = codec().decoder_state();
    let mut pcm = Vec::new();
    let mut f = 0;
    // The official streaming cadence: 4 frames first, then 16 at a time, plus odd sizes.
    for step in [4, 16, 16, 1, 7, 16, 64, 16, 60] {
        let end = (f + step).min(codes.frames());
        pcm.extend(st.push(&codes.slice(f, end)).unwrap());
        f = end;
    }
    assert_eq!(f, 200);
    assert_eq!(first_diff(&pcm, &whole), None);
}

#[test]
fn state_bytes_are_bounded_by_the_estimate() {
    let codes = long().codes("codec_long_decode_codes").slice(0, 150);
    let mut st = codec().decoder_state();
    st.push(&codes).unwrap();
    assert!(st.bytes() > 0);
    assert!(
        st.bytes() <= codec().decoder_state_bytes(),
        "{} > {}",
        st.bytes(),
        codec().decoder_state_bytes()
    );
    assert!(codec().decoder_workspace_bytes(16) > codec().decoder_workspace_bytes(1));
}

#[test]
fn geometry() {
    let c = codec();
    assert_eq!(c.sample_rate(), 44100);
    assert_eq!(c.frame_length(), 2048);
    assert_eq!(c.num_codebooks(), 10);
    assert_eq!(CodecConfig::default().frame_length(), 2048);
    assert_eq!(CodecConfig::default().latent_dim(), 1024);
}

#[test]
fn wrong_codebook_count_is_an_error() {
    let codes = Codes::new(9, 2, vec![0; 18]).unwrap();
    let e = codec().decode(&codes).unwrap_err();
    assert!(matches!(e, CodecError::Codes(_)), "{e}");
    assert!(Codes::new(10, 2, vec![0; 19]).is_err());
    assert!(Codes::from_i64(1, 1, &[-1]).is_err());
}

#[test]
fn codes_from_frames_transposes() {
    let c = Codes::from_frames(3, &[vec![1, 2, 3], vec![4, 5, 6]]).unwrap();
    assert_eq!(c.data(), &[1, 4, 2, 5, 3, 6]);
    assert_eq!(c.get(2, 1), 6);
}

#[test]
fn bad_audio_is_an_error() {
    assert!(matches!(codec().encode(&[]), Err(CodecError::Audio(_))));
    assert!(matches!(
        codec().encode(&[0.0, f32::NAN]),
        Err(CodecError::Audio(_))
    ));
}

#[test]
fn config_mismatch_names_the_tensor() {
    // The real Drama 3 geometry against the tiny checkpoint: the first tensor checked is wrong.
    let e = Codec::load(&fixture().join("codec.pth"), Some(CodecConfig::default())).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, CodecError::Shape { .. }), "{msg}");
    assert!(msg.contains("encoder.block.0.conv"), "{msg}");
    // Too few quantizer layers configured: the extra layer is refused, not ignored.
    let mut cfg = codec().config().clone();
    cfg.quantizer.n_layer = 1;
    let e = Codec::load(&fixture(), Some(cfg)).unwrap_err();
    assert!(e.to_string().contains("pre_module"), "{e}");
}

#[test]
fn missing_file_is_an_error() {
    let e = Codec::load(&fixture().join("nope.pth"), None).unwrap_err();
    assert!(matches!(e, CodecError::Pth(_)), "{e}");
}
