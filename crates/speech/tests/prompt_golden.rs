//! The prompt builder reproduces the fixture's `prompt_rows` exactly.

use checkpoint::Store;
use speech::prompt::{PromptBuilder, PromptSpec, Reference};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

fn golden(name: &str) -> (Vec<i64>, Vec<usize>) {
    let s = Store::open_file(&fixture().join("golden/golden.safetensors")).unwrap();
    let v = s.get(name).unwrap();
    (v.to_i64(), v.shape().to_vec())
}

#[test]
fn prompt_rows_match_golden() {
    let tok = tokenizers::Tokenizer::from_file(fixture().join("tokenizer.json")).unwrap();
    let (rows, shape) = golden("prompt_rows");
    let (codes, cshape) = golden("codec_encode_codes");
    let frames = cshape[1];
    let refcodes: Vec<Vec<i64>> = (0..frames)
        .map(|f| (0..10).map(|c| codes[c * frames + f]).collect())
        .collect();
    let b = PromptBuilder {
        tokenizer: &tok,
        spec: PromptSpec {
            semantic_start: 374,
            num_codebooks: 10,
            semantic_codebook_size: 64,
            residual_codebook_size: 16,
        },
    };
    let p = b
        .build(
            "<|speaker:1|> Hello world. [laughs] Fine.",
            &[Reference {
                transcript: "We asked over twenty people.".into(),
                codes: refcodes,
            }],
        )
        .unwrap();
    let flat: Vec<i64> = p.rows.iter().flatten().copied().collect();
    assert_eq!(p.rows.len(), shape[0]);
    assert_eq!(flat, rows);
    assert_eq!(p.reference_frames, 11);
}
