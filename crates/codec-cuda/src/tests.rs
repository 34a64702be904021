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

/// Streams share the decoder's one step scratch: two streams pushed in turns, at every step
/// size, each equal their own whole decode bit for bit.
#[test]
fn streams_share_the_step_scratch() {
    let (_, dec) = host();
    let goldens = fixture_goldens(&fixture()).expect("goldens");
    let (_, long, _) = goldens.last().unwrap();
    let (a, b) = (long.slice(0, 37), long.slice(3, 40));
    let whole_a = push_chunks(&dec, &a, a.frames());
    let whole_b = push_chunks(&dec, &b, b.frames());
    assert!(!bit_identical(&whole_a, &whole_b), "two different streams");
    // steps past STEP_FRAMES (one 21-frame push as one step); and a state made for 5-frame
    // steps, then pushed after the decoder's step is raised, keeps to what its KV ring holds
    for (made, step) in [
        (1, 1),
        (5, 5),
        (STEP_FRAMES, STEP_FRAMES),
        (24, 24),
        (5, MAX_STEP_FRAMES),
    ] {
        dec.set_step_frames(made);
        let (mut sa, mut sb) = (dec.state().unwrap(), dec.state().unwrap());
        dec.set_step_frames(step);
        let (mut pa, mut pb) = (Vec::new(), Vec::new());
        for (f0, f1) in [(0, 2), (2, 9), (9, 30), (30, 37)] {
            pa.extend(dec.push(&mut sa, &a.slice(f0, f1)).unwrap());
            pb.extend(dec.push(&mut sb, &b.slice(f0, f1)).unwrap());
        }
        assert!(bit_identical(&pa, &whole_a), "stream a, step {step}");
        assert!(bit_identical(&pb, &whole_b), "stream b, step {step}");
    }
}

/// Several streams decoded in one pass through the layers equal each decoded alone, bit for
/// bit: streams of different lengths pushed together in uneven pieces, one of them made for
/// smaller steps (its KV ring's room), one joining late, at a step that splits some pieces.
/// The step scratch only grows: after calls of two shapes that each need more than the other
/// in some buffer, it holds both, and a call of either shape again does not remake it.
#[test]
fn step_scratch_grows_to_every_shape() {
    let (_, dec) = host();
    let goldens = fixture_goldens(&fixture()).expect("goldens");
    let (_, long, _) = goldens.last().unwrap();
    dec.set_step_frames(9);
    let mut sts: Vec<_> = (0..6).map(|_| dec.state().unwrap()).collect();
    // a scratch is never made smaller than one stream's step, so the shapes must each
    // outgrow the other beyond it
    let own = dec.core.weights.scratch_sizes(9, 1);
    let wide = dec.core.weights.scratch_sizes(10, 2); // two streams of 5 frames
    let many = dec.core.weights.scratch_sizes(6, 6); // six streams of one frame
    assert!(
        !wide.max(own).holds(many) && !many.max(own).holds(wide),
        "the shapes must each outgrow the other: {wide:?} {many:?}"
    );
    let sizes = || dec.core.scratch.borrow().as_ref().map(|s| s.sizes);
    let mut f0 = 0;
    let mut call = |n: usize, t: usize| {
        let part = long.slice(f0, f0 + t);
        f0 += t;
        let mut refs: Vec<_> = sts.iter_mut().take(n).collect();
        dec.push_many(&mut refs, &vec![&part; n]).unwrap();
    };
    call(2, 5);
    call(6, 1);
    let both = sizes().expect("a scratch");
    assert!(both.holds(wide) && both.holds(many), "{both:?}");
    call(2, 5);
    call(6, 1);
    assert_eq!(sizes(), Some(both), "not remade");
}

#[test]
fn several_streams_in_one_step() {
    let (_, dec) = host();
    let goldens = fixture_goldens(&fixture()).expect("goldens");
    let (_, long, _) = goldens.last().unwrap();
    let codes = [long.slice(0, 29), long.slice(3, 40), long.slice(11, 24)];
    let whole: Vec<Vec<f32>> = codes
        .iter()
        .map(|c| push_chunks(&dec, c, c.frames()))
        .collect();
    dec.set_step_frames(4);
    let mut small = dec.state().unwrap();
    dec.set_step_frames(9);
    let (mut a, mut c) = (dec.state().unwrap(), dec.state().unwrap());
    let mut got = vec![Vec::new(); 3];
    // a and the small-ring b together, then c joins; b ends first, then c
    for (f0, f1) in [(0, 2), (2, 13)] {
        let out = dec
            .push_many(
                &mut [&mut a, &mut small],
                &[&codes[0].slice(f0, f1), &codes[1].slice(f0, f1)],
            )
            .unwrap();
        got[0].extend(&out[0]);
        got[1].extend(&out[1]);
    }
    let out = dec
        .push_many(
            &mut [&mut c, &mut small, &mut a],
            &[
                &codes[2].slice(0, 13),
                &codes[1].slice(13, 37),
                &codes[0].slice(13, 29),
            ],
        )
        .unwrap();
    got[2].extend(&out[0]);
    got[1].extend(&out[1]);
    got[0].extend(&out[2]);
    // streams with no frames left give no samples
    let rest = dec
        .push_many(
            &mut [&mut small, &mut c],
            &[&codes[1].slice(37, 37), &codes[2].slice(13, 13)],
        )
        .unwrap();
    assert!(rest.iter().all(|p| p.is_empty()));
    for (b, w) in whole.iter().enumerate() {
        assert_eq!(got[b].len(), w.len(), "stream {b}: samples");
        assert!(bit_identical(&got[b], w), "stream {b}");
    }
    // a state pushed for another stream count than given codes is an error
    assert!(dec.push_many(&mut [&mut a], &[]).is_err());
}

/// The memory plan's decoder workspace (`Codec::decoder_workspace_bytes`, a lane's frames
/// times the lanes) holds what the engine's decoder calls need beyond weights and states (the
/// step scratch and the most split-K partial sums): one stream's steps of up to 64 frames, and
/// calls over every lane of 8 frames a lane (the engine's calls over several jobs).
#[test]
fn plan_holds_the_step_scratch() {
    let (codec, dec) = host();
    assert_plan_holds(&codec, &dec, &[1, 16, 32, MAX_STEP_FRAMES]);
}

/// The plan's decoder workspace holds the step scratch: one stream's step of each of `frames`,
/// and calls over 1-64 lanes of 8 frames a lane.
fn assert_plan_holds(codec: &Codec, dec: &HostDecoder, frames: &[usize]) {
    for &frames in frames {
        let scratch = dec.scratch_bytes(frames, 1);
        let plan = codec.decoder_workspace_bytes(frames);
        eprintln!("{frames} frames: scratch {scratch} B, plan {plan} B");
        assert!(
            scratch <= plan,
            "{frames} frames: scratch {scratch} B, plan {plan} B"
        );
    }
    for lanes in [1, 2, 8, 32, 64] {
        let scratch = dec.scratch_bytes(8 * lanes, lanes);
        let plan = lanes * codec.decoder_workspace_bytes(8);
        eprintln!("{lanes} lanes: scratch {scratch} B, plan {plan} B");
        assert!(
            scratch <= plan,
            "{lanes} lanes: scratch {scratch} B, plan {plan} B"
        );
    }
}

/// A call over several streams checks every stream's codes before decoding any: one stream's
/// wrong codebook count is an error naming it, and no stream has moved (the same call without
/// it then decodes each as if the bad call had not happened).
#[test]
fn several_streams_bad_codes_are_an_error() {
    let (_, dec) = host();
    let goldens = fixture_goldens(&fixture()).expect("goldens");
    let (_, long, _) = goldens.last().unwrap();
    let (a, b) = (long.slice(0, 6), long.slice(6, 12));
    let want = [push_chunks(&dec, &a, 6), push_chunks(&dec, &b, 6)];
    let (mut sa, mut sb) = (dec.state().unwrap(), dec.state().unwrap());
    let bad = Codes::new(3, 1, vec![0, 0, 0]).unwrap();
    let err = dec
        .push_many(&mut [&mut sa, &mut sb], &[&a, &bad])
        .unwrap_err();
    assert!(err.to_string().contains("3 codebooks"), "{err}");
    let out = dec.push_many(&mut [&mut sa, &mut sb], &[&a, &b]).unwrap();
    assert!(bit_identical(&out[0], &want[0]) && bit_identical(&out[1], &want[1]));
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

fn host_encoder() -> (Codec, HostEncoder) {
    let dir = fixture();
    let codec = Codec::load(&dir, None).expect("tiny codec");
    let sd = checkpoint::pth::read_pth(&pth_path(&dir)).expect("codec.pth");
    let enc = HostEncoder::from_state_dict(&sd, codec.config()).expect("host encoder");
    (codec, enc)
}

/// Pushes `pcm` (whole frames) `chunk` frames at a time through a fresh state.
fn encode_chunks(enc: &HostEncoder, pcm: &[f32], chunk: usize) -> Codes {
    let fl = enc.frame_length();
    let mut st = enc.state().unwrap();
    let mut frames: Vec<Vec<u32>> = Vec::new();
    for piece in pcm.chunks(chunk * fl) {
        let c = enc.push(&mut st, piece).unwrap();
        assert_eq!(c.frames(), piece.len() / fl);
        frames.extend((0..c.frames()).map(|f| {
            (0..c.num_codebooks())
                .map(|q| c.get(q, f))
                .collect::<Vec<_>>()
        }));
    }
    assert_eq!(st.frames(), (pcm.len() / fl) as u64);
    Codes::from_frames(frames.first().map_or(0, Vec::len), &frames).unwrap()
}

/// The encoder's bookkeeping (weight layouts, strided-conv histories, both transformers' KV
/// rings past their windows, the VQ search) on the CPU executor: the CPU codec's codes and the
/// goldens exactly, short and long (173 frames: past the 128-frame pre_module window and the
/// encoder transformer's 512 rows).
#[test]
fn host_encoder_matches_cpu_codec_and_goldens() {
    let (codec, enc) = host_encoder();
    let goldens = fixture_encode_goldens(&fixture()).expect("encode goldens");
    assert!(!goldens.is_empty());
    for (name, pcm, want) in &goldens {
        let got = enc.encode(pcm).unwrap();
        let cpu = codec.encode(pcm).unwrap();
        let diff = |a: &Codes, b: &Codes| {
            a.data()
                .iter()
                .zip(b.data())
                .filter(|(x, y)| x != y)
                .count()
        };
        eprintln!(
            "{name}: {} samples → {} frames; vs golden {} codes differ, vs CPU codec {}",
            pcm.len(),
            got.frames(),
            diff(&got, want),
            diff(&got, &cpu)
        );
        assert_eq!(cpu, *want, "{name}: CPU codec vs golden");
        assert_eq!(got, *want, "{name}: host executor vs golden");
    }
}

/// Pushing whole frames in any split gives the codes of one call (pushes under, at and over
/// STEP_FRAMES, so steps and pushes straddle each other).
#[test]
fn host_encoder_chunking_gives_the_same_codes() {
    let (_, enc) = host_encoder();
    let goldens = fixture_encode_goldens(&fixture()).expect("encode goldens");
    let (_, pcm, _) = goldens.last().unwrap();
    let fl = enc.frame_length();
    let pcm = &pcm[..37 * fl];
    let whole = enc.encode(pcm).unwrap();
    assert_eq!(whole.frames(), 37);
    for chunk in [1, 3, STEP_FRAMES, STEP_FRAMES + 1] {
        assert_eq!(encode_chunks(&enc, pcm, chunk), whole, "chunk {chunk}");
    }
}

/// A clip that is not a whole number of frames is right-padded with zeros, as on the CPU.
#[test]
fn host_encoder_pads_the_last_frame() {
    let (codec, enc) = host_encoder();
    let goldens = fixture_encode_goldens(&fixture()).expect("encode goldens");
    let (_, pcm, _) = &goldens[0];
    let fl = enc.frame_length();
    let cut = &pcm[..3 * fl + 5];
    let got = enc.encode(cut).unwrap();
    assert_eq!(got.frames(), 4);
    assert_eq!(got, codec.encode(cut).unwrap());
    let mut padded = cut.to_vec();
    padded.resize(4 * fl, 0.0);
    assert_eq!(encode_chunks(&enc, &padded, 1), got);
}

#[test]
fn encoder_bad_input_is_an_error() {
    let (codec, enc) = host_encoder();
    let fl = enc.frame_length();
    let msg = |e: CudaCodecError| e.to_string();
    assert_eq!(
        msg(enc.encode(&[]).unwrap_err()),
        codec.encode(&[]).unwrap_err().to_string()
    );
    let mut pcm = vec![0.1f32; fl + 7];
    pcm[fl + 3] = f32::NAN;
    assert_eq!(
        msg(enc.encode(&pcm).unwrap_err()),
        codec.encode(&pcm).unwrap_err().to_string()
    );
    pcm[fl + 3] = f32::INFINITY;
    assert!(enc.encode(&pcm).is_err());

    let mut st = enc.state().unwrap();
    let e = msg(enc.push(&mut st, &vec![0.0; fl + 1]).unwrap_err());
    assert!(e.contains(&format!("{fl}-sample frames")), "{e}");
    assert_eq!(st.frames(), 0);
    let empty = enc.push(&mut st, &[]).unwrap();
    assert_eq!((empty.num_codebooks(), empty.frames()), (10, 0));
    assert_eq!(enc.push(&mut st, &vec![0.0; fl]).unwrap().frames(), 1);
    let mut bad = vec![0.0f32; fl];
    bad[9] = f32::NEG_INFINITY;
    let e = msg(enc.push(&mut st, &bad).unwrap_err());
    assert!(
        e.contains(&format!("sample {} is not finite", fl + 9)),
        "{e}"
    );
}

/// The VQ search: ties (equal rows) go to the lower index, NaN rows to code 0, zero rows use
/// the 1e-12 norm clamp, and the straight-through row is the raw codebook row's value.
#[test]
fn vq_nearest_ties_and_edges() {
    let cb = 2;
    let book = [3.0f32, 4.0, 0.0, 1.0, 6.0, 8.0, -1.0, 0.0];
    let n = book.len() / cb;
    let (book_n, cn2) = codec::normalised_codebook(&book, cb);
    let ze = [0.6f32, 0.8, f32::NAN, 1.0, 0.0, 0.0, -2.0, 0.1];
    let t = ze.len() / cb;
    let e = HostExec::new();
    let p = |v: &[f32]| {
        let b = e.alloc(v.len()).unwrap();
        let p = exec::P { buf: b, off: 0 };
        e.write(p, v).unwrap();
        p
    };
    let (zp, bnp, cnp, bp) = (p(&ze), p(&book_n), p(&cn2), p(&book));
    let (codes, st) = (p(&vec![0.0; t]), p(&vec![0.0; t * cb]));
    e.vq_nearest(zp, bnp, cnp, bp, codes, st, t, n, cb).unwrap();
    // Rows 0 and 2 of the codebook point the same way: row 0 wins. NaN: code 0. Zero input
    // (norm clamped): the distance is cn2[j] alone, so the first smallest cn2.
    let zero = cn2
        .iter()
        .enumerate()
        .fold(
            (f32::INFINITY, 0),
            |b, (j, &d)| if d < b.0 { (d, j) } else { b },
        )
        .1;
    assert_eq!(e.read(codes, t).unwrap(), vec![0.0, 0.0, zero as f32, 3.0]);
    let st = e.read(st, t * cb).unwrap();
    assert_eq!(&st[..2], &[0.6 + (3.0 - 0.6), 0.8 + (4.0 - 0.8)]);
    assert_eq!(&st[6..], &[-2.0 + (-1.0 - -2.0), 0.1 + (0.0 - 0.1)]);
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
    // the exact build and the tensor-core GEMM's lower-precision twin, which must drop the small
    // terms' MMAs (else the GPU check's red twin would be the exact kernel)
    let mut mmas = Vec::new();
    for variant in [
        backend_cuda::Variant::Exact,
        backend_cuda::Variant::LowPrecision,
    ] {
        let opts = cudarc::nvrtc::CompileOptions {
            options: backend_cuda::runtime::compile_options("compute_90a", variant),
            ..Default::default()
        };
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(cuda::SOURCE, opts)
            .unwrap_or_else(|e| panic!("codec.cu ({variant:?}): {e:?}"))
            .to_src();
        for k in cuda::KERNELS {
            assert!(
                ptx.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX ({variant:?})"
            );
        }
        mmas.push(ptx.matches("mma.sync.aligned.m16n8k8").count());
    }
    // 3xTF32: three MMAs a step where the twin has one
    assert!(
        mmas[1] > 0 && mmas[0] == 3 * mmas[1],
        "MMAs in the exact and lower-precision builds: {mmas:?}"
    );
}

/// On a machine with a GPU: the tensor-core GEMM against FP64, its twin caught, its bits
/// independent of the row count and the segment mode, the cp.async tiles' bits equal to
/// `gemm_tc16` / `gemm_tc64`'s and each shape dispatched as its operands allow (`check::tc_gemm`;
/// without a GPU this test skips, and `examples/codec_gpu` runs the same check on the device).
#[test]
fn gpu_tc_gemm_when_present() {
    if !backend_cuda::driver_present() || !backend_cuda::nvrtc_present() {
        eprintln!("skipped: no CUDA driver/NVRTC here (examples/codec_gpu runs it on a GPU)");
        return;
    }
    let gpu = match Gpu::new(0) {
        Ok(g) => std::sync::Arc::new(g),
        Err(e) => {
            eprintln!("skipped: {e}");
            return;
        }
    };
    let c = check::tc_gemm(gpu.clone()).unwrap();
    assert!(c.pass(), "{c:?}");
    let s = check::tf32_split(gpu).unwrap();
    assert!(s.pass(), "{s:?}");
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
        // no usable device (a driver without a GPU): skip; a kernel that does not compile or
        // weights that do not load are failures
        Err(CudaCodecError::Cuda(e)) => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let goldens = fixture_goldens(&dir).unwrap();
    let (_, codes, want) = &goldens[0];
    let got = dec.decode(codes).unwrap();
    assert!(codec::max_abs_diff(&got, want).unwrap() < 1e-4);
}

/// On a machine with a GPU: the CUDA encoder against the encode goldens, and chunked pushes.
#[test]
fn gpu_encoder_when_present() {
    if !backend_cuda::driver_present() || !backend_cuda::nvrtc_present() {
        eprintln!("skipped: no CUDA driver/NVRTC here (examples/codec_gpu runs it on a GPU)");
        return;
    }
    let dir = fixture();
    let codec = Codec::load(&dir, None).unwrap();
    let enc = match CudaEncoder::load(&dir, &codec) {
        Ok(e) => e,
        // no usable device (a driver without a GPU): skip; a kernel that does not compile or
        // weights that do not load are failures
        Err(CudaCodecError::Cuda(e)) => {
            eprintln!("skipped: {e}");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    for (name, pcm, want) in fixture_encode_goldens(&dir).unwrap() {
        assert_eq!(enc.encode(&pcm).unwrap(), want, "{name}");
    }
    let (_, pcm, want) = &fixture_encode_goldens(&dir).unwrap()[0];
    let fl = enc.frame_length();
    let mut padded = pcm.clone();
    padded.resize(want.frames() * fl, 0.0);
    let mut st = enc.state().unwrap();
    let mut frames = Vec::new();
    for piece in padded.chunks(3 * fl) {
        let c = st.push(piece).unwrap();
        frames.extend((0..c.frames()).map(|f| (0..10).map(|q| c.get(q, f)).collect::<Vec<_>>()));
    }
    assert_eq!(Codes::from_frames(10, &frames).unwrap(), *want);
}

/// On/off settings (`DRAMATIS_CODEC_TCW96`): on unless `0`.
#[test]
fn on_unless_zero_setting() {
    assert!(cuda::on_unless_zero(None));
    assert!(cuda::on_unless_zero(Some("1")));
    assert!(!cuda::on_unless_zero(Some("0 ")));
}

/// 96-column tiles only where they pad less than 64-column ones.
#[test]
fn tiles_of_96_columns() {
    assert!(cuda::pads_less_at_96(96));
    assert!(cuda::pads_less_at_96(90));
    assert!(!cuda::pads_less_at_96(192));
    assert!(!cuda::pads_less_at_96(64));
    assert!(!cuda::pads_less_at_96(768));
}

/// `DRAMATIS_CODEC_FR`: `gemm_fr` and `gemm_fr4` up to 64 rows unless `16` (or `1`) or `0`.
#[test]
fn frame_rows_setting() {
    assert_eq!(cuda::frame_from(None), 64);
    assert_eq!(cuda::frame_from(Some("64")), 64);
    assert_eq!(cuda::frame_from(Some("1")), 16);
    assert_eq!(cuda::frame_from(Some("16 ")), 16);
    assert_eq!(cuda::frame_from(Some(" 0")), 0);
}

/// `DRAMATIS_CODEC_TCW_SEG1`: the four-warp 128-thread one-segment kernel by default and on
/// `4` (launched with 128 threads), three blocks of eight warps on `3`, two on `2`, none on `0`.
#[test]
fn seg1_kernel_setting() {
    assert_eq!(cuda::seg1_from(None), Some("gemm_tcw4s"));
    assert_eq!(cuda::seg1_from(Some(" 2")), Some("gemm_tcw2s"));
    assert_eq!(cuda::seg1_from(Some("3")), Some("gemm_tcw3s"));
    assert_eq!(cuda::seg1_from(Some("4")), Some("gemm_tcw4s"));
    assert_eq!(cuda::seg1_from(Some("0")), None);
    assert_eq!(cuda::seg1_threads("gemm_tcw4s"), 128);
    assert_eq!(cuda::seg1_threads("gemm_tcw3s"), 256);
    assert_eq!(cuda::seg1_threads("gemm_tcw2s"), 256);
}

/// `DRAMATIS_CODEC_TCW`: the two-block wide tiles by default, the one-block build on `1`, none
/// on `0`.
#[test]
fn wide_kernel_setting() {
    assert_eq!(cuda::wide_from(None), Some("gemm_tcw2"));
    assert_eq!(cuda::wide_from(Some("1")), Some("gemm_tcw"));
    assert_eq!(cuda::wide_from(Some(" 2 ")), Some("gemm_tcw2"));
    assert_eq!(cuda::wide_from(Some("0")), None);
    // every name the GEMM dispatch can pick is a kernel the decoder loads
    for k in [cuda::wide_from(None), cuda::wide_from(Some("1"))] {
        let k = k.expect("a wide kernel");
        assert!(cuda::KERNELS.contains(&k), "{k} is not a loaded kernel");
    }
    for k in [
        "gemm_tcs",
        "gemm_tc16",
        "gemm_tc64",
        "gemm_small",
        "gemm_big",
    ] {
        assert!(cuda::KERNELS.contains(&k), "{k} is not a loaded kernel");
    }
}

/// `DRAMATIS_CODEC_TCS`: `gemm_tcs` only when asked for (`1`).
#[test]
fn small_tiles_setting() {
    assert!(!cuda::small_from(None));
    assert!(!cuda::small_from(Some("0")));
    assert!(cuda::small_from(Some(" 1 ")));
}

/// The same at Drama 3 geometry, for the engine's calls (at least 8 frames a lane), on
/// synthetic weights: heavy (Drama 3-size codec weights on the host), so run by hand.
#[test]
#[ignore = "loads Drama 3-size codec weights on the host"]
fn plan_holds_the_step_scratch_drama3() {
    let cfg = codec::CodecConfig::default();
    let sd = codec::synth::synthetic_state_dict(&cfg, 7);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("codec.pth"),
        checkpoint::pth_write::write_pth(&sd).unwrap(),
    )
    .unwrap();
    let codec = Codec::load(dir.path(), Some(cfg.clone())).unwrap();
    let sd = checkpoint::pth::read_pth(&dir.path().join("codec.pth")).unwrap();
    let dec = HostDecoder::from_state_dict(&sd, codec.config()).unwrap();
    assert_plan_holds(&codec, &dec, &[8, 16, 32, MAX_STEP_FRAMES]);
}
