//! GPU codec check and benchmark (run on the GPU machine):
//! `codec_gpu [FIXTURE_DIR] [RECEIPT.json]`.
//!
//! 1. Tiny fixture: GPU decode vs the f64 goldens (`codec_decode`, `codec_long_decode`, within
//!    1e-4), vs the CPU codec, and whole vs chunked (1, 3, 16 frames) GPU decode bit for bit.
//!    GPU encode vs the encode goldens (`codec_encode`, `codec_long_encode`, codes exactly), vs
//!    the CPU codec, and one call vs pushes of 1, 3, 16 and 17 frames (codes equal).
//! 2. Real Drama 3 codec geometry (random weights, `codec::synth`): GPU vs CPU on 16 frames,
//!    bit identity of 1-frame streaming vs 16-frame pushes, and frames/s for 1-frame and
//!    16-frame pushes on the GPU and the CPU codec; the encoder's frames/s on both and how many
//!    of its codes agree (random weights may put rows near a tie, so that is reported, not
//!    required).
//!
//! Writes a JSON receipt (default `$OUT/cuda-codec.json`, else `cuda-codec.json`).

use std::path::{Path, PathBuf};
use std::time::Instant;

use codec::{Codec, CodecConfig, Codes};
use codec_cuda::{
    bit_identical, fixture_encode_goldens, fixture_goldens, max_abs_diff32, CudaDecoder,
    CudaEncoder,
};
use serde_json::{json, Value};

type R<T> = Result<T, Box<dyn std::error::Error>>;

fn gpu_chunked(dec: &CudaDecoder, codes: &Codes, chunk: usize) -> R<Vec<f32>> {
    let mut st = dec.state()?;
    let mut pcm = Vec::new();
    let mut f = 0;
    while f < codes.frames() {
        let end = (f + chunk).min(codes.frames());
        pcm.extend(st.push(&codes.slice(f, end))?);
        f = end;
    }
    Ok(pcm)
}

/// `pcm` (whole frames) pushed `chunk` frames at a time through a fresh GPU encoder state.
fn gpu_encode_chunked(enc: &CudaEncoder, pcm: &[f32], chunk: usize) -> R<Codes> {
    let fl = enc.frame_length();
    let mut st = enc.state()?;
    let mut frames: Vec<Vec<u32>> = Vec::new();
    for piece in pcm.chunks(chunk * fl) {
        let c = st.push(piece)?;
        frames
            .extend((0..c.frames()).map(|f| (0..c.num_codebooks()).map(|q| c.get(q, f)).collect()));
    }
    let nc = frames.first().map_or(0, Vec::len);
    Ok(Codes::from_frames(nc, &frames)?)
}

/// Codes that differ between two equally shaped code sets (all of them if the shapes differ).
fn codes_differing(a: &Codes, b: &Codes) -> usize {
    if (a.num_codebooks(), a.frames()) != (b.num_codebooks(), b.frames()) {
        return a.data().len().max(b.data().len());
    }
    a.data()
        .iter()
        .zip(b.data())
        .filter(|(x, y)| x != y)
        .count()
}

/// A deterministic test signal: two tones and a chirp, 0.8 peak.
fn test_signal(samples: usize, rate: f64) -> Vec<f32> {
    (0..samples)
        .map(|n| {
            let t = n as f64 / rate;
            let chirp = (2.0 * std::f64::consts::PI * (150.0 * t + 40.0 * t * t)).sin();
            let a = (2.0 * std::f64::consts::PI * 523.25 * t).sin();
            let b = (2.0 * std::f64::consts::PI * 97.0 * t).sin();
            (0.4 * chirp + 0.25 * a + 0.15 * b) as f32
        })
        .collect()
}

fn random_codes(cfg: &CodecConfig, frames: usize, seed: u64) -> R<Codes> {
    let mut s = seed;
    let mut next = || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 33) as u32
    };
    let nc = cfg.num_codebooks();
    let mut data = vec![0u32; nc * frames];
    for c in 0..nc {
        let n = if c == 0 {
            cfg.semantic_codebook_size
        } else {
            cfg.codebook_size
        } as u32;
        for f in 0..frames {
            data[c * frames + f] = next() % n;
        }
    }
    Ok(Codes::new(nc, frames, data)?)
}

/// Frames `f0..f1` of every stream's codes (`codes[b]` for `sts[b]`) in one decoder call: each
/// stream's PCM and the call's seconds.
fn push_together(
    dec: &CudaDecoder,
    sts: &mut [codec_cuda::CudaDecoderState],
    codes: &[Codes],
    f0: usize,
    f1: usize,
) -> R<(Vec<Vec<f32>>, f64)> {
    let pieces: Vec<Codes> = codes.iter().map(|c| c.slice(f0, f1)).collect();
    let refs: Vec<&Codes> = pieces.iter().collect();
    let mut st_refs: Vec<_> = sts.iter_mut().collect();
    let t = Instant::now();
    let out = dec.push_many(&mut st_refs, &refs)?;
    Ok((out, t.elapsed().as_secs_f64()))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn tiny(fixture: &Path, failures: &mut Vec<String>) -> R<Value> {
    let codec = Codec::load(fixture, None)?;
    let t0 = Instant::now();
    let dec = CudaDecoder::load(fixture, &codec)?;
    let load_s = t0.elapsed().as_secs_f64();
    let mut cases = Vec::new();
    let goldens = fixture_goldens(fixture)?;
    for (name, codes, want) in &goldens {
        let gpu = dec.decode(codes)?;
        let cpu = codec.decode(codes)?;
        let g = codec::max_abs_diff(&gpu, want).unwrap_or(f64::INFINITY);
        let c = codec::max_abs_diff(&cpu, want).unwrap_or(f64::INFINITY);
        let gc = max_abs_diff32(&gpu, &cpu).unwrap_or(f64::INFINITY);
        let mut chunks = serde_json::Map::new();
        for chunk in [1usize, 3, 16] {
            let same = bit_identical(&gpu, &gpu_chunked(&dec, codes, chunk)?);
            if !same {
                failures.push(format!("{name}: chunk {chunk} differs from whole decode"));
            }
            chunks.insert(chunk.to_string(), json!(same));
        }
        let pass = g.is_finite() && g <= 1e-4;
        if !pass {
            failures.push(format!("{name}: GPU vs golden {g:.3e} > 1e-4"));
        }
        println!(
            "{} {name:<20} frames {:>4}  GPU vs golden {g:.3e}  CPU vs golden {c:.3e}  GPU vs CPU {gc:.3e}  chunks 1/3/16 bit-identical {:?}",
            if pass { "PASS" } else { "FAIL" },
            codes.frames(),
            chunks.values().collect::<Vec<_>>()
        );
        cases.push(json!({
            "case": name, "frames": codes.frames(), "samples": gpu.len(),
            "gpu_vs_golden_max_abs": g, "cpu_vs_golden_max_abs": c, "gpu_vs_cpu_max_abs": gc,
            "tolerance": 1e-4, "pass": pass, "chunked_bit_identical": chunks,
        }));
    }
    // Several streams in one decoder step: three slices of the longest golden, pushed together
    // in pieces of 7 frames, equal their whole decodes bit for bit.
    let together = {
        let (_, long, _) = goldens
            .iter()
            .max_by_key(|(_, c, _)| c.frames())
            .ok_or("no decode goldens")?;
        let n = long.frames() / 3;
        let parts = [
            long.slice(0, n),
            long.slice(n, 2 * n),
            long.slice(2 * n, 3 * n),
        ];
        let mut sts = vec![dec.state()?, dec.state()?, dec.state()?];
        let mut got = vec![Vec::new(); 3];
        for f in (0..n).step_by(7) {
            let (out, _) = push_together(&dec, &mut sts, &parts, f, (f + 7).min(n))?;
            for (g, o) in got.iter_mut().zip(out) {
                g.extend(o);
            }
        }
        let mut same = true;
        for (g, p) in got.iter().zip(&parts) {
            same &= bit_identical(g, &dec.decode(p)?);
        }
        if !same {
            failures.push("three streams decoded together differ from each alone".into());
        }
        println!(
            "{} several streams: 3 x {n} frames together in 7-frame pieces == each alone bitwise: {same}",
            if same { "PASS" } else { "FAIL" }
        );
        same
    };
    let t0 = Instant::now();
    let enc = CudaEncoder::load_on(dec.gpu(), fixture, &codec)?;
    let enc_load_s = t0.elapsed().as_secs_f64();
    let fl = enc.frame_length();
    let mut encode_cases = Vec::new();
    for (name, pcm, want) in fixture_encode_goldens(fixture)? {
        let gpu = enc.encode(&pcm)?;
        let cpu = codec.encode(&pcm)?;
        let (g, c, gc) = (
            codes_differing(&gpu, &want),
            codes_differing(&cpu, &want),
            codes_differing(&gpu, &cpu),
        );
        let mut padded = pcm.clone();
        padded.resize(gpu.frames() * fl, 0.0);
        let mut chunks = serde_json::Map::new();
        for chunk in [1usize, 3, 16, 17] {
            let same = gpu_encode_chunked(&enc, &padded, chunk)? == gpu;
            if !same {
                failures.push(format!(
                    "{name}: encode pushes of {chunk} frames differ from one call"
                ));
            }
            chunks.insert(chunk.to_string(), json!(same));
        }
        let pass = g == 0;
        if !pass {
            failures.push(format!("{name}: {g} GPU codes differ from the golden"));
        }
        println!(
            "{} {name:<20} frames {:>4}  GPU vs golden {g} codes differ  CPU vs golden {c}  GPU vs CPU {gc}  pushes 1/3/16/17 equal {:?}",
            if pass { "PASS" } else { "FAIL" },
            gpu.frames(),
            chunks.values().collect::<Vec<_>>()
        );
        encode_cases.push(json!({
            "case": name, "samples": pcm.len(), "frames": gpu.frames(),
            "gpu_vs_golden_codes_differing": g, "cpu_vs_golden_codes_differing": c,
            "gpu_vs_cpu_codes_differing": gc, "pass": pass, "chunked_codes_equal": chunks,
        }));
    }
    Ok(json!({
        "fixture": fixture.display().to_string(), "gpu_load_s": load_s, "cases": cases,
        "streams_together_bit_identical": together,
        "gpu_encoder_load_s": enc_load_s, "encode_cases": encode_cases,
    }))
}

fn real(failures: &mut Vec<String>) -> R<Value> {
    let cfg = CodecConfig::default();
    let t0 = Instant::now();
    let tmp = tempfile::tempdir()?;
    {
        let sd = codec::synth::synthetic_state_dict(&cfg, 7);
        let bytes = checkpoint::pth_write::write_pth(&sd)?;
        std::fs::write(tmp.path().join("codec.pth"), bytes)?;
    }
    let synth_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let codec = Codec::load(tmp.path(), Some(cfg.clone()))?;
    let cpu_load_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let dec = CudaDecoder::load(tmp.path(), &codec)?;
    let gpu_load_s = t0.elapsed().as_secs_f64();
    println!("real geometry: synth+write {synth_s:.1}s, CPU load {cpu_load_s:.1}s, GPU load {gpu_load_s:.1}s");
    let fl = codec.frame_length();
    let codes = random_codes(&cfg, 64, 11)?;

    // GPU, 1-frame streaming pushes: 4 warm-up frames, then 48 timed.
    let mut st = dec.state()?;
    let mut stream = Vec::new();
    for f in 0..4 {
        stream.extend(st.push(&codes.slice(f, f + 1))?);
    }
    let mut t1 = Vec::new();
    for f in 4..52 {
        let t = Instant::now();
        stream.extend(st.push(&codes.slice(f, f + 1))?);
        t1.push(t.elapsed().as_secs_f64());
    }
    let gpu_fps_1 = 1.0 / median(t1.clone());
    let gpu_fps_1_mean = t1.len() as f64 / t1.iter().sum::<f64>();

    // GPU, 16-frame pushes: one warm-up, then the 4 pushes of 64 frames, 3 rounds.
    let _ = dec.decode(&codes.slice(0, 16))?;
    let mut t16 = Vec::new();
    let mut whole16 = Vec::new();
    for round in 0..3 {
        let mut st = dec.state()?;
        for f in (0..64).step_by(16) {
            let t = Instant::now();
            let pcm = st.push(&codes.slice(f, f + 16))?;
            t16.push(t.elapsed().as_secs_f64());
            if round == 0 {
                whole16.extend(pcm);
            }
        }
    }
    let gpu_fps_16 = 16.0 / median(t16.clone());
    let stream_same = bit_identical(&stream, &whole16[..52 * fl]);
    if !stream_same {
        failures.push("real geometry: 1-frame stream differs from 16-frame pushes".into());
    }

    // Several streams: CODEC_GPU_STREAMS (default 32) streams of 12-frame pushes (a 32-lane
    // run's decoder calls), one at a time and all in one call, 3 rounds of which the last two
    // are timed; each stream's PCM the same bit for bit either way.
    let ns = env_count("CODEC_GPU_STREAMS", 256, 32);
    let per = 12;
    let scodes: Vec<Codes> = (0..ns)
        .map(|b| random_codes(&cfg, 3 * per, 100 + b as u64))
        .collect::<R<_>>()?;
    let mut alone = vec![Vec::new(); ns];
    let mut t_alone = Vec::new();
    {
        let mut sts: Vec<_> = (0..ns).map(|_| dec.state()).collect::<Result<_, _>>()?;
        for round in 0..3 {
            let t = Instant::now();
            for (b, st) in sts.iter_mut().enumerate() {
                alone[b].extend(st.push(&scodes[b].slice(round * per, (round + 1) * per))?);
            }
            if round > 0 {
                t_alone.push(t.elapsed().as_secs_f64());
            }
        }
    }
    let mut together = vec![Vec::new(); ns];
    let mut t_together = Vec::new();
    {
        let mut sts: Vec<_> = (0..ns).map(|_| dec.state()).collect::<Result<_, _>>()?;
        for round in 0..3 {
            let (out, secs) =
                push_together(&dec, &mut sts, &scodes, round * per, (round + 1) * per)?;
            if round > 0 {
                t_together.push(secs);
            }
            for (g, o) in together.iter_mut().zip(out) {
                g.extend(o);
            }
        }
    }
    let streams_same = alone
        .iter()
        .zip(&together)
        .all(|(a, b)| bit_identical(a, b));
    if !streams_same {
        failures.push(format!(
            "real geometry: {ns} streams decoded together differ from each alone"
        ));
    }
    let fps_alone = (ns * per) as f64 / median(t_alone.clone());
    let fps_together = (ns * per) as f64 / median(t_together.clone());
    println!(
        "real geometry streams: {ns} x {per}-frame pushes, one at a time {fps_alone:.1} frames/s, together {fps_together:.1} frames/s ({:.2}x); together == alone bitwise: {streams_same}",
        fps_together / fps_alone
    );

    // The GEMMs on gemm_tc16 / gemm_tc64 against the cp.async tiles (wide for many rows,
    // gemm_tcs for up to 16): the same PCM bit for bit at every push size, each one's frames/s
    // (1-frame pushes of 24 frames, 16- and 32-frame pushes of 64) and the launches that took
    // the cp.async tiles (so a configuration that never reached them shows).
    let mut wide_ab = Vec::new();
    let mut base_pcm: Vec<Vec<f32>> = Vec::new();
    for (w, small) in [
        (None, false),
        (Some("gemm_tcw2"), false),
        (Some("gemm_tcw2"), true),
        (Some("gemm_tcw"), true),
    ] {
        dec.set_wide(w);
        dec.set_small(small);
        let mut row = serde_json::Map::new();
        row.insert("wide".into(), json!(w));
        row.insert("small".into(), json!(small));
        let launches0 = dec.launch_counts();
        let mut same_all = true;
        for (p_i, push) in [1usize, 16, 32].into_iter().enumerate() {
            let frames = if push == 1 { 24 } else { 64 };
            let mut times = Vec::new();
            let mut pcm = Vec::new();
            for round in 0..3 {
                let mut st = dec.state()?;
                for f in (0..frames).step_by(push) {
                    let t = Instant::now();
                    let p = st.push(&codes.slice(f, f + push))?;
                    times.push(t.elapsed().as_secs_f64());
                    if round == 0 {
                        pcm.extend(p);
                    }
                }
            }
            let fps = push as f64 / median(times);
            row.insert(format!("frames_per_s_push{push}"), json!(fps));
            match base_pcm.get(p_i) {
                Some(p0) => same_all &= bit_identical(p0, &pcm),
                None => base_pcm.push(pcm),
            }
        }
        let launches = dec.launch_counts();
        row.insert("wide_launches".into(), json!(launches.0 - launches0.0));
        row.insert("small_launches".into(), json!(launches.1 - launches0.1));
        row.insert("pcm_bitwise_as_gemm_tc16_64".into(), json!(same_all));
        // a configuration meant for the cp.async tiles must reach them
        let (dw, ds) = (launches.0 - launches0.0, launches.1 - launches0.1);
        if codec_cuda::cuda::decoder_tc() && ((w.is_some() && dw == 0) || (small && ds == 0)) {
            failures.push(format!(
                "real geometry: wide {w:?} small {small} never reached the cp.async tiles ({dw} wide, {ds} small launches)"
            ));
        }
        if !same_all {
            failures.push(format!(
                "real geometry: wide {w:?} small {small} PCM differs from gemm_tc16/64's"
            ));
        }
        println!(
            "real geometry GEMM tiles A/B: {}",
            Value::Object(row.clone())
        );
        wide_ab.push(Value::Object(row));
    }
    dec.set_wide(codec_cuda::cuda::wide_kernel());
    dec.set_small(codec_cuda::cuda::small_tiles());

    // CPU codec on the same machine.
    let mut cst = codec.decoder_state();
    let t = Instant::now();
    let cpu16a = cst.push(&codes.slice(0, 16))?;
    let cpu_first16_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let _ = cst.push(&codes.slice(16, 32))?;
    let cpu16_s = t.elapsed().as_secs_f64();
    let mut cst = codec.decoder_state();
    let _ = cst.push(&codes.slice(0, 1))?;
    let mut c1 = Vec::new();
    for f in 1..7 {
        let t = Instant::now();
        let _ = cst.push(&codes.slice(f, f + 1))?;
        c1.push(t.elapsed().as_secs_f64());
    }
    let cpu_fps_1 = 1.0 / median(c1);
    let cpu_fps_16 = 16.0 / cpu16_s.min(cpu_first16_s);
    let gc = max_abs_diff32(&whole16[..16 * fl], &cpu16a).unwrap_or(f64::INFINITY);
    let peak = cpu16a.iter().fold(0f32, |a, &b| a.max(b.abs()));
    println!(
        "real geometry: GPU vs CPU (16 frames) max abs {gc:.3e} (peak |pcm| {peak:.3}); 1-frame stream == 16-frame pushes: {stream_same}"
    );
    println!(
        "real geometry frames/s: GPU 1-frame {gpu_fps_1:.1} (mean {gpu_fps_1_mean:.1}), GPU 16-frame {gpu_fps_16:.1}; CPU 1-frame {cpu_fps_1:.2}, CPU 16-frame {cpu_fps_16:.2}"
    );
    if gc.is_nan() || gc > 1e-3 {
        failures.push(format!("real geometry: GPU vs CPU {gc:.3e} > 1e-3"));
    }

    // Encoder: 32 frames of a test signal, GPU (one warm-up call, then 3 timed) and CPU.
    let t0 = Instant::now();
    let enc = CudaEncoder::load_on(dec.gpu(), tmp.path(), &codec)?;
    let gpu_enc_load_s = t0.elapsed().as_secs_f64();
    let enc_frames = 32;
    let pcm = test_signal(enc_frames * fl, f64::from(codec.sample_rate()));
    let _ = enc.encode(&pcm[..16 * fl])?;
    let mut te = Vec::new();
    let mut gpu_codes = None;
    for _ in 0..3 {
        let t = Instant::now();
        let c = enc.encode(&pcm)?;
        te.push(t.elapsed().as_secs_f64());
        gpu_codes = Some(c);
    }
    let gpu_codes = gpu_codes.ok_or("no GPU encode ran")?;
    let gpu_enc_fps = enc_frames as f64 / median(te.clone());
    let t = Instant::now();
    let cpu_codes = codec.encode(&pcm)?;
    let cpu_enc_s = t.elapsed().as_secs_f64();
    let cpu_enc_fps = enc_frames as f64 / cpu_enc_s;
    let enc_differ = codes_differing(&gpu_codes, &cpu_codes);
    let enc_chunked_same = gpu_encode_chunked(&enc, &pcm, 1)? == gpu_codes;
    if !enc_chunked_same {
        failures.push("real geometry: 1-frame encode pushes differ from one call".into());
    }
    println!(
        "real geometry encoder: GPU {gpu_enc_fps:.1} frames/s, CPU {cpu_enc_fps:.2} frames/s; GPU vs CPU {enc_differ} of {} codes differ; 1-frame pushes == one call: {enc_chunked_same}",
        cpu_codes.data().len()
    );
    Ok(json!({
        "geometry": "Drama 3 codec (CodecConfig::default), random weights synth seed 7",
        "decoder_dim": cfg.decoder_dim, "frame_length": fl, "step_frames": codec_cuda::STEP_FRAMES,
        "synth_write_s": synth_s, "cpu_load_s": cpu_load_s, "gpu_load_s": gpu_load_s,
        "gpu_vs_cpu_max_abs_16_frames": gc, "pcm_peak_abs": peak,
        "stream_1_vs_push_16_bit_identical": stream_same,
        "gpu_frames_per_s_push1_median": gpu_fps_1, "gpu_frames_per_s_push1_mean": gpu_fps_1_mean,
        "gpu_push1_ms": t1.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
        "gpu_frames_per_s_push16_median": gpu_fps_16,
        "gpu_push16_ms": t16.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
        "cpu_frames_per_s_push1_median": cpu_fps_1, "cpu_frames_per_s_push16": cpu_fps_16,
        "cpu_push16_first_s": cpu_first16_s, "cpu_push16_second_s": cpu16_s,
        "speedup_push1": gpu_fps_1 / cpu_fps_1, "speedup_push16": gpu_fps_16 / cpu_fps_16,
        "gemm_tiles_ab": wide_ab,
        "streams": {
            "streams": ns, "frames_a_push": per, "bit_identical": streams_same,
            "frames_per_s_one_at_a_time": fps_alone, "frames_per_s_together": fps_together,
            "one_at_a_time_ms": t_alone.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
            "together_ms": t_together.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
        },
        "encoder": {
            "frames": enc_frames, "gpu_load_s": gpu_enc_load_s,
            "gpu_encode_ms": te.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
            "gpu_frames_per_s_median": gpu_enc_fps, "cpu_encode_s": cpu_enc_s,
            "cpu_frames_per_s": cpu_enc_fps, "speedup": gpu_enc_fps / cpu_enc_fps,
            "gpu_vs_cpu_codes_differing": enc_differ, "codes": cpu_codes.data().len(),
            "push1_codes_equal_one_call": enc_chunked_same,
        },
    }))
}

/// A count from environment variable `name`: 1 to `most`, else `default`.
fn env_count(name: &str, most: usize, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|n| (1..=most).contains(n))
        .unwrap_or(default)
}

/// `CODEC_GPU_PROFILE=1`: only a warm-up push and one timed push of `CODEC_GPU_PROFILE_FRAMES`
/// frames (default 16) for each of `CODEC_GPU_PROFILE_STREAMS` streams (default 1) together, at
/// real geometry (for a profiler: the launches of the second push are one decoder call).
fn profile_only() -> R<()> {
    let n = env_count("CODEC_GPU_PROFILE_FRAMES", 64, 16);
    let cfg = CodecConfig::default();
    let tmp = tempfile::tempdir()?;
    let sd = codec::synth::synthetic_state_dict(&cfg, 7);
    std::fs::write(
        tmp.path().join("codec.pth"),
        checkpoint::pth_write::write_pth(&sd)?,
    )?;
    let codec = Codec::load(tmp.path(), Some(cfg.clone()))?;
    let dec = CudaDecoder::load(tmp.path(), &codec)?;
    let ns = env_count("CODEC_GPU_PROFILE_STREAMS", 256, 1);
    let codes: Vec<Codes> = (0..ns)
        .map(|b| random_codes(&cfg, 2 * n, 11 + b as u64))
        .collect::<R<_>>()?;
    let mut sts: Vec<_> = (0..ns).map(|_| dec.state()).collect::<Result<_, _>>()?;
    let mut ms = 0.0;
    for half in 0..2 {
        ms = push_together(&dec, &mut sts, &codes, half * n, (half + 1) * n)?.1 * 1e3;
    }
    println!("profile: one push of {ns} x {n} frames {ms:.2} ms");
    Ok(())
}

fn main() -> R<()> {
    if std::env::var("CODEC_GPU_PROFILE").is_ok_and(|v| v == "1") {
        return profile_only();
    }
    let args: Vec<String> = std::env::args().collect();
    let fixture = PathBuf::from(args.get(1).map_or("testdata/drama3-tiny", |s| s.as_str()));
    let receipt = args.get(2).map(PathBuf::from).unwrap_or_else(|| {
        std::env::var_os("OUT")
            .map(PathBuf::from)
            .unwrap_or_default()
            .join("cuda-codec.json")
    });
    let mut failures = Vec::new();
    let gpu = backend_cuda::Gpu::new(0)?;
    let device = json!({
        "name": gpu.info.name, "compute_capability": gpu.info.compute_capability,
        "sm_count": gpu.info.sm_count, "cuda_driver_version": gpu.info.cuda_driver_version,
        "cpu_threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
    });
    // the tensor-core GEMM against FP64 on fresh random inputs, its twin, and its bits
    let gpu = std::sync::Arc::new(gpu);
    let split = codec_cuda::check::tf32_split(gpu.clone())?;
    println!(
        "{} tf32 split: {} values, finite ones differing from cvt.rna {:08x?}, non-finite ones not NaN {:08x?}",
        if split.pass() { "PASS" } else { "FAIL" },
        split.values,
        split.finite_differ,
        split.nonfinite_lost
    );
    if !split.pass() {
        failures.push(format!("tf32 split check: {split:?}"));
    }
    let tc = codec_cuda::check::tc_gemm(gpu)?;
    println!(
        "{} gemm_tc: exact worst {:.3e} (tolerance {:.0e}), low-precision twin {:.3e} / on gemm_tcs {:.3e} ({}), rows bitwise {}, segment modes bitwise {}, cp.async tiles = gemm_tc16/64 bitwise {} ({} wide, {} of them one-segment, {} of those 96 columns, {} frame-rate, {} small launches, dispatch as expected {}); shapes {:?}",
        if tc.pass() { "PASS" } else { "FAIL" },
        tc.exact_worst,
        codec_cuda::check::TOLERANCE,
        tc.twin_worst,
        tc.twin_small_worst,
        if tc.twin_worst.min(tc.twin_small_worst) > codec_cuda::check::TOLERANCE {
            "red as planted"
        } else {
            "MISSED"
        },
        tc.rows_bitwise,
        tc.modes_bitwise,
        tc.wide_bitwise,
        tc.wide_launches,
        tc.seg1_launches,
        tc.wide96_launches,
        tc.frame_launches,
        tc.small_launches,
        tc.dispatch_as_expected,
        tc.shapes
    );
    if !tc.pass() {
        failures.push(format!("gemm_tc check: {tc:?}"));
    }
    let tc_field = json!({
        "exact_worst": tc.exact_worst, "twin_worst": tc.twin_worst,
        "twin_small_worst": tc.twin_small_worst,
        "tolerance": codec_cuda::check::TOLERANCE, "rows_bitwise": tc.rows_bitwise,
        "modes_bitwise": tc.modes_bitwise, "wide_bitwise": tc.wide_bitwise,
        "wide_launches": tc.wide_launches, "seg1_launches": tc.seg1_launches,
        "wide96_launches": tc.wide96_launches,
        "frame_launches": tc.frame_launches,
        "small_launches": tc.small_launches, "dispatch_as_expected": tc.dispatch_as_expected,
        "wide_kernel": codec_cuda::cuda::wide_kernel(),
        "seg1_kernel": codec_cuda::cuda::seg1_kernel(),
        "frame_rows": codec_cuda::cuda::frame_rows(),
        "wide96": codec_cuda::cuda::wide96(),
        "small_tiles": codec_cuda::cuda::small_tiles(), "shapes": tc.shapes, "pass": tc.pass(),
    });
    let tiny = tiny(&fixture, &mut failures)?;
    let real = real(&mut failures)?;
    let doc = json!({
        "kind": "cuda-codec",
        "date": std::env::var("RECEIPT_DATE").unwrap_or_default(),
        "commit": std::env::var("RECEIPT_COMMIT").unwrap_or_default(),
        "device": device, "decoder_tc": codec_cuda::cuda::decoder_tc(), "gemm_tc_check": tc_field,
        "tf32_split_check": {
            "values": split.values, "finite_differ": split.finite_differ,
            "nonfinite_lost": split.nonfinite_lost, "pass": split.pass(),
        },
        "tiny": tiny, "real": real,
        "failures": failures, "pass": failures.is_empty(),
    });
    std::fs::write(&receipt, serde_json::to_string_pretty(&doc)?)?;
    println!("receipt: {}", receipt.display());
    if failures.is_empty() {
        println!("ALL PASS");
        Ok(())
    } else {
        for f in &failures {
            println!("FAIL {f}");
        }
        std::process::exit(1)
    }
}
