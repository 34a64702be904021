//! The vendored tiny fixture: byte-for-byte copy, loads, passes the manifest, goldens readable.

use checkpoint::{Checkpoint, Store};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

#[test]
fn vendored_fixture_matches_sha256_list() {
    let dir = fixture();
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("golden/meta.json")).unwrap())
            .unwrap();
    let list = meta["sha256"].as_object().unwrap();
    assert!(list.len() >= 11);
    for (rel, want) in list {
        let bytes = std::fs::read(dir.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        let got = hex::encode(Sha256::digest(&bytes));
        assert_eq!(
            &got,
            want.as_str().unwrap(),
            "{rel} differs from the fixture"
        );
    }
}

#[test]
fn vendored_fixture_passes_manifest() {
    let ck = Checkpoint::open(&fixture()).unwrap();
    assert!(ck.report.ok());
    assert_eq!(ck.expert_format, checkpoint::ExpertFormat::Fp8Block128);
    // Every stored tensor is used and every expected one found.
    assert_eq!(ck.report.expected, ck.store.tensors.len());
    let s = ck
        .tensor("model.language_model.layers.0.mlp.experts.3.down_proj.weight_scale_inv")
        .unwrap();
    assert_eq!(s.shape(), &[1, 2]);
    assert!(s.to_f32().iter().all(|v| v.is_finite() && *v > 0.0));
}

/// Every golden tensor the fixture README lists, with its shape and dtype.
#[test]
fn golden_tensors_readable() {
    let dir = fixture().join("golden");
    let want: &[(&str, &str, &[usize])] = &[
        ("prompt_rows", "I64", &[99, 11]),
        ("prompt_input_embeds", "F32", &[99, 128]),
        ("prompt_final_hidden", "F32", &[99, 128]),
        ("prompt_layer_outputs", "F32", &[4, 99, 128]),
        ("prompt_full_logits", "F32", &[99, 512]),
        ("prompt_semantic_logits", "F32", &[99, 65]),
        ("candidate_token_ids", "I64", &[65]),
        ("gen_frames", "I64", &[16, 11]),
        ("gen_semantic_logits", "F32", &[16, 65]),
        ("gen_hidden", "F32", &[16, 128]),
        ("gen_codebook_logits", "F32", &[16, 9, 64]),
        ("tf_sequence", "I64", &[115, 11]),
        ("tf_final_hidden", "F32", &[115, 128]),
        ("tf_semantic_logits", "F32", &[115, 65]),
        ("tf_shared_out", "F32", &[114, 128]),
        ("tf_tower_layer_outputs", "F32", &[13, 114, 128]),
        ("tf_codebook_logits", "F32", &[114, 9, 64]),
        ("codec_decode_codes", "I64", &[10, 16]),
        ("codec_decode_pcm_f32", "F32", &[32768]),
        ("codec_decode_pcm_f64", "F64", &[32768]),
        ("codec_encode_input_chirp", "F32", &[22050]),
        ("codec_encode_codes", "I64", &[10, 11]),
    ];
    let long: &[(&str, &str, &[usize])] = &[
        ("codec_long_decode_codes", "I64", &[10, 300]),
        ("codec_long_decode_pcm_f64", "F64", &[614400]),
        ("codec_long_encode_input", "F32", &[352800]),
        ("codec_long_encode_codes", "I64", &[10, 173]),
    ];
    for (file, list) in [
        ("golden.safetensors", want),
        ("golden_long.safetensors", long),
    ] {
        let store = Store::open_file(&dir.join(file)).unwrap();
        for (name, dt, shape) in list.iter() {
            let v = store.get(name).unwrap_or_else(|e| panic!("{file}: {e}"));
            assert_eq!(v.dtype().name(), *dt, "{name}");
            assert_eq!(v.shape(), *shape, "{name}");
            assert_eq!(v.to_f64().len(), shape.iter().product::<usize>());
        }
    }
}
