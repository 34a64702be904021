//! Corrupted copies of the vendored tiny fixture: each is refused with its own clear error,
//! never a panic.

use checkpoint::{Checkpoint, CheckpointError};
use std::path::{Path, PathBuf};

const SHARD1: &str = "model-00001-of-00002.safetensors";
const SHARD2: &str = "model-00002-of-00002.safetensors";
const INDEX: &str = "model.safetensors.index.json";

fn vendored() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

/// A copy of the fixture's top-level files (goldens are not needed to open it).
fn copy_fixture() -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(vendored()).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
        }
    }
    tmp
}

/// One tensor of a shard as stored; `offsets` overrides the contiguous layout when set.
#[derive(Clone)]
struct Entry {
    name: String,
    dtype: String,
    shape: Vec<u64>,
    data: Vec<u8>,
    offsets: Option<[u64; 2]>,
}

/// A shard's `__metadata__` and its tensors in data order.
fn read_shard(path: &Path) -> (serde_json::Value, Vec<Entry>) {
    let bytes = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let data = &bytes[8 + n..];
    let mut meta = serde_json::Value::Null;
    let mut out = Vec::new();
    for (name, v) in header {
        if name == "__metadata__" {
            meta = v;
            continue;
        }
        let off: Vec<usize> = serde_json::from_value(v["data_offsets"].clone()).unwrap();
        out.push((
            off[0],
            Entry {
                name,
                dtype: v["dtype"].as_str().unwrap().to_string(),
                shape: serde_json::from_value(v["shape"].clone()).unwrap(),
                data: data[off[0]..off[1]].to_vec(),
                offsets: None,
            },
        ));
    }
    out.sort_by_key(|(start, _)| *start);
    (meta, out.into_iter().map(|(_, e)| e).collect())
}

/// Re-serialises a shard. The header is written by hand so that duplicate names survive.
fn write_shard(path: &Path, meta: &serde_json::Value, entries: &[Entry]) {
    let mut parts = vec![format!("\"__metadata__\":{meta}")];
    let mut off = 0u64;
    let mut data = Vec::new();
    for e in entries {
        let end = off + e.data.len() as u64;
        let o = e.offsets.unwrap_or([off, end]);
        parts.push(format!(
            "{}:{{\"dtype\":{},\"shape\":{},\"data_offsets\":[{},{}]}}",
            serde_json::to_string(&e.name).unwrap(),
            serde_json::to_string(&e.dtype).unwrap(),
            serde_json::to_string(&e.shape).unwrap(),
            o[0],
            o[1]
        ));
        data.extend_from_slice(&e.data);
        off = end;
    }
    let mut header = format!("{{{}}}", parts.join(",")).into_bytes();
    while header.len() % 8 != 0 {
        header.push(b' ');
    }
    let mut file = (header.len() as u64).to_le_bytes().to_vec();
    file.extend_from_slice(&header);
    file.extend_from_slice(&data);
    std::fs::write(path, file).unwrap();
}

/// Edits the tensors of one shard and keeps the index's weight map in step, so that the
/// manifest check (not the index consistency check) sees the change.
fn edit_shard(dir: &Path, shard: &str, f: impl FnOnce(&mut Vec<Entry>)) {
    let path = dir.join(shard);
    let (meta, mut entries) = read_shard(&path);
    f(&mut entries);
    write_shard(&path, &meta, &entries);
    let ip = dir.join(INDEX);
    let mut index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&ip).unwrap()).unwrap();
    let wm = index["weight_map"].as_object_mut().unwrap();
    wm.retain(|_, v| v != shard);
    for e in &entries {
        wm.insert(e.name.clone(), shard.into());
    }
    std::fs::write(&ip, serde_json::to_string_pretty(&index).unwrap()).unwrap();
}

fn find<'a>(entries: &'a mut [Entry], name: &str) -> &'a mut Entry {
    entries.iter_mut().find(|e| e.name == name).unwrap()
}

/// Opens `dir`, which must be refused; returns the error.
fn refused(dir: &Path) -> CheckpointError {
    match Checkpoint::open(dir) {
        Ok(_) => panic!("a corrupted checkpoint was accepted"),
        Err(e) => e,
    }
}

fn edit_config(dir: &Path, f: impl FnOnce(&mut serde_json::Value)) {
    let p = dir.join("config.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

const Z: &str = "model.language_model.layers.1.linear_attn.in_proj_z.weight";

#[test]
fn unedited_copy_opens() {
    let d = copy_fixture();
    // The round trip through the helpers alone must not disturb anything.
    edit_shard(d.path(), SHARD1, |_| {});
    edit_shard(d.path(), SHARD2, |_| {});
    Checkpoint::open(d.path()).unwrap();
}

#[test]
fn renamed_tensor_is_missing_and_unused() {
    let d = copy_fixture();
    let new = "model.language_model.layers.1.linear_attn.in_proj_zz.weight";
    edit_shard(d.path(), SHARD1, |t| find(t, Z).name = new.into());
    let e = refused(d.path()).to_string();
    assert!(e.contains("1 missing, 0 mismatched, 1 unused"), "{e}");
    assert!(e.contains(&format!("missing:    {Z}")), "{e}");
    assert!(e.contains(&format!("unused:     {new}")), "{e}");
}

#[test]
fn dropped_tensor_is_missing() {
    let d = copy_fixture();
    edit_shard(d.path(), SHARD2, |t| {
        t.retain(|e| e.name != "lm_head.weight")
    });
    let e = refused(d.path()).to_string();
    assert!(e.contains("1 missing, 0 mismatched, 0 unused"), "{e}");
    assert!(e.contains("missing:    lm_head.weight"), "{e}");
}

#[test]
fn extra_tensor_is_unused() {
    let d = copy_fixture();
    // Expert 16 of a 16-expert config.
    let x = "model.language_model.layers.0.mlp.experts.16.gate_proj.weight";
    edit_shard(d.path(), SHARD1, |t| {
        let mut e = find(
            t,
            "model.language_model.layers.0.mlp.experts.15.gate_proj.weight",
        )
        .clone();
        e.name = x.into();
        t.push(e);
    });
    let e = refused(d.path()).to_string();
    assert!(e.contains("0 missing, 0 mismatched, 1 unused"), "{e}");
    assert!(e.contains(&format!("unused:     {x}")), "{e}");
}

#[test]
fn wrong_dtype_names_expected_and_found() {
    let d = copy_fixture();
    let w = "model.language_model.layers.2.mlp.experts.4.up_proj.weight";
    let o = "model.language_model.layers.3.self_attn.o_proj.weight";
    edit_shard(d.path(), SHARD1, |t| {
        find(t, w).dtype = "U8".into();
        find(t, o).dtype = "F16".into();
    });
    let e = refused(d.path()).to_string();
    assert!(e.contains("0 missing, 2 mismatched, 0 unused"), "{e}");
    assert!(
        e.contains(&format!(
            "mismatched: {w} (expected F8_E4M3 [256, 128], found U8 [256, 128])"
        )),
        "{e}"
    );
    assert!(
        e.contains(&format!(
            "mismatched: {o} (expected BF16 [128, 128], found F16 [128, 128])"
        )),
        "{e}"
    );
}

#[test]
fn wrong_shape_is_mismatched() {
    let d = copy_fixture();
    edit_shard(d.path(), SHARD1, |t| find(t, Z).shape = vec![128, 64]);
    let e = refused(d.path()).to_string();
    assert!(e.contains("0 missing, 1 mismatched, 0 unused"), "{e}");
    assert!(
        e.contains(&format!(
            "mismatched: {Z} (expected BF16 [64, 128], found BF16 [128, 64])"
        )),
        "{e}"
    );
}

#[test]
fn truncated_shard_names_offsets() {
    let d = copy_fixture();
    let p = d.path().join(SHARD2);
    let len = std::fs::metadata(&p).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
    f.set_len(len - 1000).unwrap();
    let e = refused(d.path());
    assert!(matches!(e, CheckpointError::Corrupt { .. }), "{e:?}");
    let e = e.to_string();
    assert!(e.contains(SHARD2), "{e}");
    assert!(e.contains("data offsets"), "{e}");
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn header_length_beyond_the_file() {
    let d = copy_fixture();
    let p = d.path().join(SHARD1);
    let mut bytes = std::fs::read(&p).unwrap();
    let len = bytes.len() as u64;
    bytes[..8].copy_from_slice(&len.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let e = refused(d.path()).to_string();
    assert!(e.contains(SHARD1), "{e}");
    assert!(
        e.contains(&format!(
            "header length {len} bytes runs past the end of the {len}-byte file"
        )),
        "{e}"
    );

    // A length beyond any sane header is refused before it is compared with the file.
    bytes[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&p, &bytes).unwrap();
    let e = refused(d.path()).to_string();
    assert!(e.contains("exceeds the limit"), "{e}");

    // Shorter than the length prefix itself.
    std::fs::write(&p, [1u8, 2, 3]).unwrap();
    let e = refused(d.path()).to_string();
    assert!(e.contains("shorter than the 8-byte header length"), "{e}");
}

#[test]
fn duplicate_names_in_a_header() {
    let d = copy_fixture();
    edit_shard(d.path(), SHARD1, |t| {
        let dup = find(t, Z).clone();
        t.push(dup);
    });
    let e = refused(d.path()).to_string();
    assert!(e.contains(SHARD1), "{e}");
    assert!(e.contains(&format!("duplicate tensor name \"{Z}\"")), "{e}");
}

#[test]
fn out_of_bounds_data_offset() {
    let d = copy_fixture();
    let data_len: u64 = {
        let (_, t) = read_shard(&d.path().join(SHARD2));
        t.iter().map(|e| e.data.len() as u64).sum()
    };
    edit_shard(d.path(), SHARD2, |t| {
        let e = find(t, "lm_head.weight");
        let n = e.data.len() as u64;
        e.offsets = Some([data_len - n / 2, data_len - n / 2 + n]);
    });
    let e = refused(d.path()).to_string();
    assert!(e.contains(SHARD2), "{e}");
    assert!(e.contains("tensor \"lm_head.weight\": data offsets"), "{e}");
    assert!(
        e.contains(&format!("outside the {data_len}-byte data section")),
        "{e}"
    );

    // Reversed offsets are refused the same way, not subtracted into a panic.
    let d = copy_fixture();
    edit_shard(d.path(), SHARD2, |t| {
        find(t, "lm_head.weight").offsets = Some([100, 50]);
    });
    let e = refused(d.path()).to_string();
    assert!(e.contains("data offsets [100, 50)"), "{e}");
}

#[test]
fn stored_size_disagreeing_with_shape() {
    let d = copy_fixture();
    edit_shard(d.path(), SHARD1, |t| find(t, Z).shape = vec![64, 64]);
    let e = refused(d.path()).to_string();
    assert!(
        e.contains("16384 bytes stored but dtype BF16 and shape [64, 64] need 8192"),
        "{e}"
    );
}

#[test]
fn index_and_shards_disagree() {
    let d = copy_fixture();
    let ip = d.path().join(INDEX);
    let orig = std::fs::read_to_string(&ip).unwrap();
    let mut index: serde_json::Value = serde_json::from_str(&orig).unwrap();
    index["weight_map"]["ghost.weight"] = SHARD1.into();
    std::fs::write(&ip, index.to_string()).unwrap();
    let e = refused(d.path()).to_string();
    assert!(e.contains("the index lists tensor \"ghost.weight\""), "{e}");

    let mut index: serde_json::Value = serde_json::from_str(&orig).unwrap();
    index["weight_map"].as_object_mut().unwrap().remove(Z);
    std::fs::write(&ip, index.to_string()).unwrap();
    let e = refused(d.path()).to_string();
    assert!(
        e.contains(&format!("tensor \"{Z}\" is not listed in the index")),
        "{e}"
    );

    let mut index: serde_json::Value = serde_json::from_str(&orig).unwrap();
    index["weight_map"][Z] = "../model.safetensors".into();
    std::fs::write(&ip, index.to_string()).unwrap();
    let e = refused(d.path()).to_string();
    assert!(e.contains("must be a plain file name"), "{e}");
}

#[test]
fn config_missing_a_field_names_it() {
    let d = copy_fixture();
    edit_config(d.path(), |v| {
        v["text_config"]
            .as_object_mut()
            .unwrap()
            .remove("num_experts");
    });
    let e = refused(d.path());
    let CheckpointError::Config { field, why } = &e else {
        panic!("expected a config error, found {e:?}")
    };
    assert_eq!(field, "text_config");
    assert!(why.contains("missing field `num_experts`"), "{e}");
    assert!(e.to_string().contains("num_experts"));

    let d = copy_fixture();
    edit_config(d.path(), |v| {
        v.as_object_mut().unwrap().remove("semantic_start_token_id");
    });
    let e = refused(d.path()).to_string();
    assert!(e.contains("missing field `semantic_start_token_id`"), "{e}");
}

#[test]
fn vq_backbone_codebooks_out_of_range() {
    let d = copy_fixture();
    edit_config(d.path(), |v| {
        v["audio_decoder_config"]["vq_backbone_codebooks"] = 12.into();
    });
    let e = refused(d.path());
    let CheckpointError::Config { field, why } = &e else {
        panic!("expected a config error, found {e:?}")
    };
    assert_eq!(field, "audio_decoder_config.vq_backbone_codebooks");
    assert!(
        why.contains("must be in 1..=9 for backbone_partial, found 12"),
        "{why}"
    );
}

#[test]
fn non_finite_scale_is_refused() {
    let s = "model.language_model.layers.1.mlp.experts.2.up_proj.weight_scale_inv";
    for (bad, at) in [(f32::NAN, 0usize), (f32::INFINITY, 1), (-1.0, 1)] {
        let d = copy_fixture();
        edit_shard(d.path(), SHARD1, |t| {
            find(t, s).data[at * 4..at * 4 + 4].copy_from_slice(&bad.to_le_bytes());
        });
        let e = refused(d.path());
        let CheckpointError::BadScale { name, index, value } = &e else {
            panic!("expected BadScale, found {e:?}")
        };
        assert_eq!((name.as_str(), *index), (s, at));
        assert_eq!(value.to_bits(), bad.to_bits());
        assert!(e.to_string().contains(s));
    }
}

#[test]
fn absurd_dimensions_are_refused_not_overflowed() {
    let d = copy_fixture();
    edit_config(d.path(), |v| {
        for (sec, heads, hd) in [
            ("text_config", "num_attention_heads", "head_dim"),
            ("audio_decoder_config", "n_head", "head_dim"),
        ] {
            v[sec][heads] = (1u64 << 30).into();
            v[sec][hd] = (1u64 << 40).into();
        }
    });
    let e = refused(d.path()).to_string();
    assert!(e.contains("text_config.num_attention_heads"), "{e}");
    assert!(e.contains("exceeds the supported maximum 1024"), "{e}");
}
