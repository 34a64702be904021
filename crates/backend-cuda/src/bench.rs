//! Microbenchmarks of the bandwidth-bound kernels against the device-copy floor, as JSON.
//! Weights rotate over copies larger than L2 so that the figures are DRAM figures.

use cudarc::driver::sys::{CUevent_flags, CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::CudaSlice;
use serde_json::{json, Value};

use crate::error::Result;
use crate::kernels::{self as k, ExpertWeights};
use crate::rng::Rng;
use crate::runtime::{Gpu, Variant};

/// The device-to-device copy rate GPU.md measured on an H200 (bytes read + written).
pub use admission::geometry::H200_COPY_BYTES_PER_S as COPY_FLOOR_BYTES_PER_S;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    v[v.len() / 2]
}

/// Per-call seconds of `f` over `reps` timed rounds of `inner` calls each, after a warm-up.
/// The `inner` calls are captured once into a CUDA graph and each round replays it, so host
/// launch cost stays out of the figure (a kernel's device time in isolation).
fn time(
    gpu: &Gpu,
    reps: usize,
    inner: usize,
    mut f: impl FnMut(usize) -> Result<()>,
) -> Result<Vec<f64>> {
    for i in 0..inner {
        f(i)?;
    }
    gpu.stream.synchronize()?;
    gpu.stream
        .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
    let captured = (0..inner).try_for_each(&mut f);
    let graph = gpu
        .stream
        .end_capture(CUgraphInstantiate_flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)?;
    captured?;
    let graph = graph.ok_or(crate::error::CudaError::Shape {
        kernel: "bench",
        what: "empty graph capture".into(),
    })?;
    graph.launch()?;
    // one replay a round, each of `inner` calls
    let per_replay = event_seconds(gpu, reps, 1, |_| graph.launch().map_err(|e| e.to_string()))
        .map_err(|what| crate::error::CudaError::Shape {
            kernel: "bench",
            what,
        })?;
    Ok(per_replay.into_iter().map(|t| t / inner as f64).collect())
}

/// Per-call seconds of `f(i)` (i counting from 0 over every call) in `rounds` event-timed
/// rounds of `calls` launches each, issued as they come (host launch cost included, as the
/// engine pays it outside graphs); no warm-up, which the caller runs. For the examples'
/// microbenchmarks (`gemvbench`, `opbench`).
pub fn event_seconds<E: From<String>>(
    gpu: &Gpu,
    rounds: usize,
    calls: usize,
    mut f: impl FnMut(usize) -> std::result::Result<(), E>,
) -> std::result::Result<Vec<f64>, E> {
    let e = |x: cudarc::driver::DriverError| E::from(x.to_string());
    gpu.stream.synchronize().map_err(e)?;
    let mut out = Vec::with_capacity(rounds);
    for round in 0..rounds {
        let a = gpu
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(e)?;
        let b = gpu
            .ctx
            .new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(e)?;
        a.record(&gpu.stream).map_err(e)?;
        for i in 0..calls {
            f(round * calls + i)?;
        }
        b.record(&gpu.stream).map_err(e)?;
        b.synchronize().map_err(e)?;
        out.push(f64::from(a.elapsed_ms(&b).map_err(e)?) * 1e-3 / calls as f64);
    }
    Ok(out)
}

fn record(name: &str, shape: Value, bytes: f64, mut secs: Vec<f64>, copy_rate: f64) -> Value {
    let runs_us: Vec<f64> = secs.iter().map(|s| s * 1e6).collect();
    let med = median(&mut secs);
    let rate = bytes / med;
    println!(
        "BENCH {name:<34} {:>9.2} us  {:>7.1} GB/s  {:>5.1}% of 4.3 TB/s floor  {:>5.1}% of measured copy",
        med * 1e6,
        rate / 1e9,
        100.0 * rate / COPY_FLOOR_BYTES_PER_S,
        100.0 * rate / copy_rate
    );
    json!({
        "name": name, "shape": shape, "bytes_per_call": bytes, "median_us": med * 1e6, "runs_us": runs_us,
        "achieved_gb_s": rate / 1e9, "fraction_of_4_3_tb_s_floor": rate / COPY_FLOOR_BYTES_PER_S,
        "fraction_of_measured_copy": rate / copy_rate,
    })
}

/// Fills `dst` by repeating `src` (device to device).
fn tile<T: cudarc::driver::DeviceRepr>(
    gpu: &Gpu,
    src: &CudaSlice<T>,
    dst: &mut CudaSlice<T>,
) -> Result<()> {
    let (n, m) = (dst.len(), src.len());
    let mut at = 0;
    while at < n {
        let len = m.min(n - at);
        gpu.stream
            .memcpy_dtod(&src.slice(..len), &mut dst.slice_mut(at..at + len))?;
        at += len;
    }
    Ok(())
}

/// Runs every microbenchmark; returns the receipt's `results` and measured copy rate.
pub fn run(gpu: &Gpu, reps: usize) -> Result<(Vec<Value>, f64)> {
    let mut rng = Rng::new(Rng::fresh_seed());
    let mut results = Vec::new();

    // copy floor, measured here
    let n = 1usize << 28; // 1 GiB of f32
    let src = gpu.stream.clone_htod(&rng.normals_f32(1 << 22, 1.0))?;
    let mut a = gpu.stream.alloc_zeros::<f32>(n)?;
    tile(gpu, &src, &mut a)?;
    let mut b = gpu.stream.alloc_zeros::<f32>(n)?;
    let secs = time(gpu, reps, 4, |_| Ok(gpu.stream.memcpy_dtod(&a, &mut b)?))?;
    let copy_bytes = 2.0 * 4.0 * n as f64;
    let copy_rate = copy_bytes / median(&mut secs.clone());
    results.push(record(
        "device copy (read+write)",
        json!({"bytes": 4 * n}),
        copy_bytes,
        secs,
        copy_rate,
    ));
    drop((a, b));

    // BF16 GEMV, one row
    for (n_out, kk) in [(2048usize, 8192usize), (8192, 2048)] {
        let copies = 16;
        let wsrc = gpu.stream.clone_htod(&rng.normals_bf16(n_out * kk, 0.02))?;
        let mut w = gpu.stream.alloc_zeros::<u16>(copies * n_out * kk)?;
        tile(gpu, &wsrc, &mut w)?;
        let x = gpu.stream.clone_htod(&rng.normals_f32(kk, 1.0))?;
        let mut y = gpu.stream.alloc_zeros::<f32>(n_out)?;
        let ids: Vec<CudaSlice<u32>> = (0..copies)
            .map(|c| {
                gpu.stream
                    .clone_htod(&((c * n_out) as u32..((c + 1) * n_out) as u32).collect::<Vec<_>>())
            })
            .collect::<std::result::Result<_, _>>()?;
        let secs = time(gpu, reps, copies, |i| {
            k::gemv(
                gpu,
                Variant::Exact,
                &w,
                copies * n_out,
                &x,
                &mut y,
                Some(&ids[i]),
                n_out,
                kk,
                1,
            )
        })?;
        let bytes = (n_out * kk * 2 + kk * 4 + n_out * 8) as f64;
        results.push(record(
            &format!("gemv_bf16 {n_out}x{kk} (1 row)"),
            json!({"n_out": n_out, "k": kk, "rows": 1, "weight_copies_rotated": copies}),
            bytes,
            secs,
            copy_rate,
        ));
    }

    // FP8 experts: 8 of 256, H 2048, I 512, gate/up + down
    let (e, i, h, kk) = (256usize, 512usize, 2048usize, 8usize);
    let bsrc = gpu.stream.clone_htod(&rng.fp8_bytes(1 << 24))?;
    let mk = || -> Result<CudaSlice<u8>> {
        let mut d = gpu.stream.alloc_zeros::<u8>(e * i * h)?;
        tile(gpu, &bsrc, &mut d)?;
        Ok(d)
    };
    let (gate, upw, downw) = (mk()?, mk()?, mk()?);
    let smat = e * (i / 128) * (h / 128);
    let mut sc = || {
        gpu.stream.clone_htod(
            &(0..smat)
                .map(|_| (rng.range(0.5, 2.0) * 1e-3) as f32)
                .collect::<Vec<_>>(),
        )
    };
    let w = ExpertWeights {
        gate,
        up: upw,
        down: downw,
        gate_s: sc()?,
        up_s: sc()?,
        down_s: sc()?,
        e,
        i,
        h,
    };
    let sets = 32;
    let ids: Vec<CudaSlice<u32>> = (0..sets)
        .map(|_| {
            let mut v: Vec<u32> = Vec::new();
            while v.len() < kk {
                let x = rng.below(e) as u32;
                if !v.contains(&x) {
                    v.push(x);
                }
            }
            gpu.stream.clone_htod(&v)
        })
        .collect::<std::result::Result<_, _>>()?;
    let x = gpu.stream.clone_htod(&rng.normals_f32(h, 1.0))?;
    let wts = gpu.stream.clone_htod(&[0.125f32; 8])?;
    let mut hb = gpu.stream.alloc_zeros::<f32>(kk * i)?;
    let mut y = gpu.stream.alloc_zeros::<f32>(h)?;
    let secs = time(gpu, reps, sets, |s| {
        k::expert_gate_up(gpu, Variant::Exact, &w, &ids[s], &x, &mut hb, kk)?;
        k::expert_down(gpu, Variant::Exact, &w, &ids[s], &wts, &hb, &mut y, kk)
    })?;
    let bytes = (kk * 3 * i * h + kk * 3 * (i / 128) * (h / 128) * 4 + h * 8 + kk * i * 8) as f64;
    results.push(record(
        "fp8 experts 8 of 256 (gate/up + down)",
        json!({"experts": e, "selected": kk, "H": h, "I": i, "id_sets_rotated": sets}),
        bytes,
        secs,
        copy_rate,
    ));
    Ok((results, copy_rate))
}
