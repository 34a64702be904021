//! Shared helpers: the vendored fixture and its golden tensors.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use codec::{Codec, Codes};
use safetensors::{Dtype, SafeTensors};

pub fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

pub fn codec() -> &'static Codec {
    static C: OnceLock<Codec> = OnceLock::new();
    C.get_or_init(|| Codec::load(&fixture(), None).expect("load tiny codec"))
}

pub struct Golden {
    bytes: Vec<u8>,
}

impl Golden {
    pub fn open(name: &str) -> Self {
        let bytes = std::fs::read(fixture().join("golden").join(name)).expect("golden file");
        Self { bytes }
    }
    fn st(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("safetensors")
    }
    pub fn codes(&self, key: &str) -> Codes {
        let st = self.st();
        let t = st.tensor(key).expect(key);
        assert_eq!(t.dtype(), Dtype::I64);
        let v: Vec<i64> = t
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect();
        Codes::from_i64(t.shape()[0], t.shape()[1], &v).unwrap()
    }
    pub fn f64s(&self, key: &str) -> Vec<f64> {
        let st = self.st();
        let t = st.tensor(key).expect(key);
        assert_eq!(t.dtype(), Dtype::F64);
        t.data()
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
    pub fn f32s(&self, key: &str) -> Vec<f32> {
        let st = self.st();
        let t = st.tensor(key).expect(key);
        assert_eq!(t.dtype(), Dtype::F32);
        t.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }
}

pub fn short() -> &'static Golden {
    static G: OnceLock<Golden> = OnceLock::new();
    G.get_or_init(|| Golden::open("golden.safetensors"))
}

pub fn long() -> &'static Golden {
    static G: OnceLock<Golden> = OnceLock::new();
    G.get_or_init(|| Golden::open("golden_long.safetensors"))
}
