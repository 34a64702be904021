//! The synthetic checkpoint writer: a written tiny fixture loads and passes the manifest, is
//! deterministic whatever the thread count, and holds O(1) values.

use checkpoint::fixture::{self, CodecSource, FixtureExperts, FixtureOptions, FixtureSummary};
use checkpoint::geometry::Geometry;
use checkpoint::{Checkpoint, DType, ExpertFormat};
use sha2::{Digest, Sha256};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn vendored() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

fn opts(out: &Path, seed: u64, experts: FixtureExperts) -> FixtureOptions {
    FixtureOptions {
        geometry: Geometry::Tiny,
        seed,
        out: out.to_path_buf(),
        experts,
        codec: Some(CodecSource::Bytes(
            std::fs::read(vendored().join("codec.pth")).unwrap(),
        )),
    }
}

fn write(o: &FixtureOptions) -> FixtureSummary {
    fixture::write(o, &|_, _| {}).unwrap()
}

/// sha256 of every file in `dir`, by name.
fn hashes(dir: &Path) -> BTreeMap<String, String> {
    let mut m = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let e = e.unwrap();
        let bytes = std::fs::read(e.path()).unwrap();
        m.insert(
            e.file_name().to_string_lossy().into_owned(),
            hex::encode(Sha256::digest(&bytes)),
        );
    }
    m
}

#[test]
fn tiny_fixture_opens_and_passes_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let seen = RefCell::new(Vec::new());
    let s = fixture::write(&opts(tmp.path(), 5, FixtureExperts::Fp8), &|d, t| {
        seen.borrow_mut().push((d, t))
    })
    .unwrap();
    let ck = Checkpoint::open(tmp.path()).unwrap();
    assert!(ck.report.ok(), "{}", ck.report.describe());
    assert_eq!(ck.expert_format, ExpertFormat::Fp8Block128);
    assert_eq!(ck.report.expected, ck.store.tensors.len());
    assert_eq!(s.tensors, ck.store.tensors.len());
    assert_eq!(s.tensor_bytes, ck.store.total_bytes());
    assert_eq!(s.shards, 2);
    assert_eq!(
        ck.store.metadata["total_size"].as_u64(),
        Some(s.tensor_bytes)
    );

    // Same layout as the vendored fixture: backbone in shard 1, lm_head and tower in shard 2.
    for (name, info) in &ck.store.tensors {
        let want = usize::from(!name.starts_with("model.language_model."));
        assert_eq!(info.shard, want, "{name}");
    }
    let vend = Checkpoint::open(&vendored()).unwrap();
    let names = |c: &Checkpoint| c.store.tensors.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(&ck).len(), names(&vend).len());
    for (name, info) in &ck.store.tensors {
        let v = vend.tensor(name).unwrap();
        assert_eq!(
            (info.dtype, &info.shape[..]),
            (v.dtype(), v.shape()),
            "{name}"
        );
    }

    let file = |n: &str| std::fs::read(tmp.path().join(n)).unwrap();
    assert_eq!(file("config.json"), file_of_vendored("config.json"));
    assert_eq!(file("tokenizer.json"), file_of_vendored("tokenizer.json"));
    assert_eq!(file("codec.pth"), file_of_vendored("codec.pth"));
    let gen: serde_json::Value = serde_json::from_slice(&file("generation_config.json")).unwrap();
    assert_eq!(gen["top_k"], 30);
    assert_eq!(gen["top_p"], 0.9);
    assert_eq!(gen["temperature"], 1.0);
    assert_eq!(gen["eos_token_id"], 354);
    assert!(!tmp
        .path()
        .join("model-00001-of-00002.safetensors.partial")
        .exists());

    // Progress: monotone, ends at the total, which is the shard bytes.
    let seen = seen.into_inner();
    assert!(seen.windows(2).all(|p| p[0].0 <= p[1].0));
    let (done, total) = *seen.last().unwrap();
    assert_eq!(done, total);
    let shard_bytes: u64 = s
        .files
        .iter()
        .filter(|(n, _)| n.ends_with(".safetensors"))
        .map(|(_, b)| b)
        .sum();
    assert_eq!(total, shard_bytes);
    for (n, b) in &s.files {
        assert_eq!(
            std::fs::metadata(tmp.path().join(n)).unwrap().len(),
            *b,
            "{n}"
        );
    }
}

fn file_of_vendored(n: &str) -> Vec<u8> {
    std::fs::read(vendored().join(n)).unwrap()
}

#[test]
fn same_seed_is_byte_identical_whatever_the_threads() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write(&opts(a.path(), 11, FixtureExperts::Fp8));
    let one = rayon::ThreadPoolBuilder::new()
        .num_threads(1)
        .build()
        .unwrap();
    one.install(|| write(&opts(b.path(), 11, FixtureExperts::Fp8)));
    let (ha, hb) = (hashes(a.path()), hashes(b.path()));
    assert_eq!(ha.len(), 8, "{ha:?}");
    assert_eq!(ha, hb);
}

#[test]
fn different_seed_differs() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write(&opts(a.path(), 1, FixtureExperts::Fp8));
    write(&opts(b.path(), 2, FixtureExperts::Fp8));
    let (ha, hb) = (hashes(a.path()), hashes(b.path()));
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ] {
        assert_ne!(ha[f], hb[f], "{f}");
    }
    assert_eq!(ha["config.json"], hb["config.json"]);
    // Every tensor differs, not just some.
    let (ca, cb) = (
        Checkpoint::open(a.path()).unwrap(),
        Checkpoint::open(b.path()).unwrap(),
    );
    for name in ca.store.tensors.keys() {
        assert_ne!(
            ca.tensor(name).unwrap().bytes,
            cb.tensor(name).unwrap().bytes,
            "{name}"
        );
    }
}

fn std_of(v: &[f32]) -> f32 {
    let n = v.len() as f32;
    let m = v.iter().sum::<f32>() / n;
    (v.iter().map(|x| (x - m) * (x - m)).sum::<f32>() / n).sqrt()
}

#[test]
fn values_are_finite_and_order_one() {
    let tmp = tempfile::tempdir().unwrap();
    write(&opts(tmp.path(), 3, FixtureExperts::Fp8));
    let ck = Checkpoint::open(tmp.path()).unwrap();
    for name in ck.store.tensors.keys() {
        let t = ck.tensor(name).unwrap();
        let v = t.to_f32();
        assert!(v.iter().all(|x| x.is_finite()), "{name}");
        // Stored FP8 codes span ±448 by design; everything else is O(1).
        if t.dtype() != DType::F8E4M3 && !name.ends_with("weight_scale_inv") {
            assert!(v.iter().all(|x| x.abs() < 4.0), "{name}");
        }
    }
    let get = |n: &str| ck.tensor(n).unwrap().to_f32();
    let l = "model.language_model.layers.0";
    let emb = std_of(&get("model.language_model.embed_tokens.weight"));
    assert!((0.45..0.55).contains(&emb), "embedding std {emb}");
    let q = std_of(&get(&format!("{l}.linear_attn.in_proj_qkv.weight")));
    let want = 1.0 / 128f32.sqrt();
    assert!((q / want - 1.0).abs() < 0.05, "matrix std {q} vs {want}");
    let norm = get(&format!("{l}.input_layernorm.weight"));
    assert!(norm.iter().all(|x| x.abs() <= 0.101));
    assert!(std_of(&norm) > 0.03);
    let gn = get(&format!("{l}.linear_attn.norm.weight"));
    assert!(gn.iter().all(|x| (0.89..=1.11).contains(x)));
    let a_log = get(&format!("{l}.linear_attn.A_log"));
    assert!(a_log.iter().all(|x| (0.0..=16f32.ln() + 0.01).contains(x)));

    // FP8 experts dequantise (code · scale_inv per 128x128 block) to N(0, 1/in).
    let x = format!("{l}.mlp.experts.5.down_proj");
    let w = get(&format!("{x}.weight"));
    let s = get(&format!("{x}.weight_scale_inv"));
    assert_eq!(
        ck.tensor(&format!("{x}.weight")).unwrap().dtype(),
        DType::F8E4M3
    );
    let (rows, cols) = (128, 256);
    let deq: Vec<f32> = (0..rows * cols)
        .map(|i| w[i] * s[(i / cols / 128) * 2 + (i % cols) / 128])
        .collect();
    let d = std_of(&deq);
    let want = 1.0 / 256f32.sqrt();
    assert!((d / want - 1.0).abs() < 0.05, "expert std {d} vs {want}");
    // The largest code of each block is 448 (scale = amax/448).
    let amax = w.iter().fold(0f32, |a, v| a.max(v.abs()));
    assert_eq!(amax, 448.0);
}

#[test]
fn tiny_nvfp4_fixture_opens_and_matches_fp8_weights() {
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let s = write(&opts(
        a.path(),
        4,
        FixtureExperts::Nvfp4Pruned { keep: 0.6 },
    ));
    let ck = Checkpoint::open(a.path()).unwrap();
    assert!(ck.report.ok(), "{}", ck.report.describe());
    let ExpertFormat::Nvfp4Pruned { kept } = &ck.expert_format else {
        panic!("expected NVFP4, found {:?}", ck.expert_format)
    };
    assert_eq!(&ck.expert_format, &s.expert_format);
    assert_eq!(kept.len(), 4);
    assert!(kept.iter().all(|k| k.len() >= 8 && k.len() < 16));
    assert_eq!(ck.store.metadata["expert_format"], "nvfp4-pruned");

    // Slot 1 of layer 2 holds original expert kept[2][1]: its dequantised NVFP4 weights are
    // close to the FP8 fixture's weights of that expert for the same seed.
    write(&opts(b.path(), 4, FixtureExperts::Fp8));
    let fp8 = Checkpoint::open(b.path()).unwrap();
    let orig = kept[2][1];
    let n = "model.language_model.layers.2.mlp.experts";
    let pk = ck.tensor(&format!("{n}.1.gate_proj.weight")).unwrap();
    assert_eq!((pk.dtype(), pk.shape()), (DType::U8, &[256usize, 64][..]));
    let sc = ck.tensor(&format!("{n}.1.gate_proj.weight_scale")).unwrap();
    assert_eq!(
        (sc.dtype(), sc.shape()),
        (DType::F8E4M3, &[256usize, 8][..])
    );
    let g = ck
        .tensor(&format!("{n}.1.gate_proj.weight_scale_2"))
        .unwrap();
    assert!(g.shape().is_empty());
    let g = g.to_f32()[0];
    let sc = sc.to_f32();
    let deq: Vec<f32> = (0..256 * 128)
        .map(|i| {
            let b = pk.bytes[i / 2];
            let nib = if i % 2 == 0 { b & 15 } else { b >> 4 };
            checkpoint::dtype::e2m1_to_f32(nib) * sc[i / 16] * g
        })
        .collect();
    let w = fp8
        .tensor(&format!("{n}.{orig}.gate_proj.weight"))
        .unwrap()
        .to_f32();
    let s = fp8
        .tensor(&format!("{n}.{orig}.gate_proj.weight_scale_inv"))
        .unwrap()
        .to_f32();
    let reference: Vec<f32> = (0..256 * 128).map(|i| w[i] * s[i / 128 / 128]).collect();
    let err: Vec<f32> = deq.iter().zip(&reference).map(|(a, b)| a - b).collect();
    let rel = std_of(&err) / std_of(&reference);
    assert!(rel < 0.15, "NVFP4 vs FP8 relative error {rel}");
}

#[test]
fn drama3_tokenizer_has_the_full_semantic_band() {
    use tokenizers::Tokenizer;
    let json = fixture::tokenizer_json(Geometry::Drama3).unwrap();
    let tok = Tokenizer::from_bytes(json.as_bytes()).unwrap();
    let cfg = Geometry::Drama3.config();
    assert_eq!(tok.token_to_id("<|semantic:0|>"), Some(374));
    assert_eq!(tok.token_to_id("<|semantic:63|>"), Some(437));
    assert_eq!(tok.token_to_id("<|semantic:64|>"), Some(438));
    assert_eq!(
        tok.token_to_id("<|semantic:4095|>"),
        Some(cfg.semantic_end_token_id)
    );
    assert_eq!(cfg.semantic_end_token_id, 4469);
    let enc = tok.encode("<|semantic:4095|>", false).unwrap();
    assert_eq!(enc.get_ids(), &[4469]);
    let enc = tok.encode("<|im_start|><|semantic:100|>hi", false).unwrap();
    assert_eq!(&enc.get_ids()[..2], &[353, 474]);
    assert!(tok.get_vocab_size(true) <= cfg.text_config.vocab_size);

    let tiny = Tokenizer::from_bytes(fixture::tokenizer_json(Geometry::Tiny).unwrap()).unwrap();
    assert_eq!(tiny.token_to_id("<|semantic:63|>"), Some(437));
    assert_eq!(tiny.token_to_id("<|semantic:64|>"), None);
}

#[test]
fn no_codec_means_no_codec_file() {
    let tmp = tempfile::tempdir().unwrap();
    let mut o = opts(tmp.path(), 1, FixtureExperts::Fp8);
    o.codec = None;
    let s = write(&o);
    assert!(!tmp.path().join("codec.pth").exists());
    assert!(s.files.iter().all(|(n, _)| n != "codec.pth"));
    Checkpoint::open(tmp.path()).unwrap();
}

/// Manual throughput probe (not run by default): writes `$DRAMATIS_PROBE_GEOMETRY` (default
/// drama3, about 36 GB) to `$DRAMATIS_PROBE_DIR`, prints MB/s every GB, then opens it.
/// `DRAMATIS_PROBE_DIR=/tmp/d3 cargo test --release -p checkpoint --test fixture_writer -- --ignored --nocapture`
#[test]
#[ignore]
fn write_probe() {
    let Ok(dir) = std::env::var("DRAMATIS_PROBE_DIR") else {
        eprintln!("set DRAMATIS_PROBE_DIR");
        return;
    };
    let geometry = std::env::var("DRAMATIS_PROBE_GEOMETRY")
        .ok()
        .and_then(|g| Geometry::parse(&g))
        .unwrap_or(Geometry::Drama3);
    let t0 = std::time::Instant::now();
    let next = std::cell::Cell::new(0u64);
    let o = FixtureOptions {
        geometry,
        seed: 1,
        out: PathBuf::from(&dir),
        experts: FixtureExperts::Fp8,
        codec: None,
    };
    let s = fixture::write(&o, &|d, t| {
        if d >= next.get() || d == t {
            let secs = t0.elapsed().as_secs_f64();
            eprintln!(
                "{:7.1} s  {:6.2} / {:6.2} GB  {:7.0} MB/s",
                secs,
                d as f64 / 1e9,
                t as f64 / 1e9,
                d as f64 / 1e6 / secs
            );
            next.set(d + 1_000_000_000);
        }
    })
    .unwrap();
    let secs = t0.elapsed().as_secs_f64();
    eprintln!(
        "wrote {} tensors, {} bytes in {secs:.3} s ({:.0} MB/s, {} threads)",
        s.tensors,
        s.tensor_bytes,
        s.tensor_bytes as f64 / 1e6 / secs,
        rayon::current_num_threads()
    );
    let t1 = std::time::Instant::now();
    let ck = Checkpoint::open(Path::new(&dir)).unwrap();
    eprintln!(
        "opened and verified in {:.1} s: {} tensors",
        t1.elapsed().as_secs_f64(),
        ck.store.tensors.len()
    );
    assert_eq!(ck.store.tensors.len(), s.tensors);
}
