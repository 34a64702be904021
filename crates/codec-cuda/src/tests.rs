use std::path::PathBuf;

use super::*;

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

fn host() -> (Codec, HostDecoder) {
    let dir = fixture();
    let codec = Codec::load(&dir, None).expect("tiny codec");
    let sd = checkpoint::pth::read_pth(&pth_path(&dir)).expect("codec.pth");
    let dec = HostDecoder::from_state_dict(&sd, codec.config()).expect("host decoder");
    (codec, dec)
}

fn push_chunks(dec: &HostDecoder, codes: &Codes, chunk: usize) -> Vec<f32> {
    let mut st = dec.state().unwrap();
    let mut pcm = Vec::new();
    let mut f = 0;
    while f < codes.frames() {
        let end = (f + chunk).min(codes.frames());
        pcm.extend(dec.push(&mut st, &codes.slice(f, end)).unwrap());
        f = end;
    }
    pcm
}

/// The decoder's bookkeeping (weight layouts, histories, KV ring, RoPE positions) on the CPU
/// executor: matches the f64 golden within 1e-4 and the CPU codec closely.
#[test]
fn host_executor_matches_golden_and_cpu_codec() {
    let (codec, dec) = host();
    let goldens = fixture_goldens(&fixture()).expect("goldens");
    assert!(!goldens.is_empty());
    for (name, codes, want) in &goldens {
        let got = push_chunks(&dec, codes, codes.frames());
        assert_eq!(got.len(), codes.frames() * codec.frame_length());
        let g = codec::max_abs_diff(&got, want).unwrap();
        let cpu = codec.decode(codes).unwrap();
        let c = max_abs_diff32(&got, &cpu).unwrap();
        let cg = codec::max_abs_diff(&cpu, want).unwrap();
        eprintln!(
            "{name}: {} frames, vs golden {g:.3e}, vs CPU codec {c:.3e} (CPU vs golden {cg:.3e})",
            codes.frames()
        );
        assert!(g < 1e-4, "{name}: {g} vs golden");
        assert!(c < 1e-4, "{name}: {c} vs CPU codec");
    }
}

/// Streaming through the executor equals the whole decode bit for bit.
#[test]
fn host_executor_chunking_is_bit_exact() {
    let (_, dec) = host();
    let goldens = fixture_goldens(&fixture()).expect("goldens");
    let (_, codes, _) = goldens.last().unwrap();
    let codes = codes.slice(0, 40);
    let whole = push_chunks(&dec, &codes, codes.frames());
    for chunk in [1, 3, 16] {
        assert!(
            bit_identical(&whole, &push_chunks(&dec, &codes, chunk)),
            "chunk {chunk}"
        );
    }
}

#[test]
fn wrong_codebook_count_is_an_error() {
    let (_, dec) = host();
    let mut st = dec.state().unwrap();
    let codes = Codes::new(3, 1, vec![0, 0, 0]).unwrap();
    assert!(dec.push(&mut st, &codes).is_err());
    assert!(dec
        .push(&mut st, &Codes::new(10, 0, vec![]).unwrap())
        .unwrap()
        .is_empty());
}

#[test]
fn transpose_is_linear_to_operand() {
    // [out=2, in=3] → [in=3, out=2]
    let w = [1., 2., 3., 4., 5., 6.];
    assert_eq!(decoder::transpose(&w, 2, 3), vec![1., 4., 2., 5., 3., 6.]);
}

/// The kernels compile with NVRTC when it can be opened (CI: the pip wheel's libnvrtc).
#[test]
fn kernels_compile_with_nvrtc() {
    if !backend_cuda::nvrtc_present() {
        eprintln!("skipped: NVRTC not present (set LD_LIBRARY_PATH to a libnvrtc.so.13)");
        return;
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: backend_cuda::runtime::compile_options(
            "compute_90a",
            backend_cuda::Variant::Exact,
        ),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(cuda::SOURCE, opts)
        .unwrap_or_else(|e| panic!("codec.cu: {e:?}"))
        .to_src();
    for k in cuda::KERNELS {
        assert!(
            ptx.contains(&format!(".entry {k}(")),
            "{k} missing from the PTX"
        );
    }
}

/// On a machine with a GPU: the CUDA decoder against the CPU codec and chunking.
#[test]
fn gpu_decoder_when_present() {
    if !backend_cuda::driver_present() || !backend_cuda::nvrtc_present() {
        eprintln!("skipped: no CUDA driver/NVRTC here (examples/codec_gpu runs it on a GPU)");
        return;
    }
    let dir = fixture();
    let codec = Codec::load(&dir, None).unwrap();
    let dec = match CudaDecoder::load(&dir, &codec) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let goldens = fixture_goldens(&dir).unwrap();
    let (_, codes, want) = &goldens[0];
    let got = dec.decode(codes).unwrap();
    assert!(codec::max_abs_diff(&got, want).unwrap() < 1e-4);
}
