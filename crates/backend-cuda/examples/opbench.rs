//! `opbench [--out FILE.json]`: device time of the frame loop's heavy ops at Drama 3 shapes and
//! several row counts (BF16 linears, the FP8 routed experts of one layer, decode attention),
//! each against its weight-read floor. Inputs are random (never zeros); each figure is the median
//! of 7 rounds of 10 calls timed with stream events after a warm-up.

use backend_cuda::CudaBackend;
use model::{AttnDims, Backend, Expert, Rope, Rows};
use serde_json::json;

use backend_cuda::rng::Rng;

/// Median seconds per call of `f` (7 rounds of 10 calls, event-timed, after 3 warm-up calls).
fn time(be: &CudaBackend, mut f: impl FnMut() -> Result<(), String>) -> Result<f64, String> {
    for _ in 0..3 {
        f()?;
    }
    let mut v = backend_cuda::bench::event_seconds(be.gpu(), 7, 10, |_| f())?;
    v.sort_by(|x, y| x.total_cmp(y));
    Ok(v[3])
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().collect();
    let out = args
        .iter()
        .position(|a| a == "--out")
        .and_then(|i| args.get(i + 1));
    let be = CudaBackend::new().map_err(|e| e.to_string())?;
    let s = |e: model::BackendError| e.to_string();
    let mut rng = Rng::new(7);
    let mut rec = Vec::new();
    let read_rate = backend_cuda::bench::COPY_FLOOR_BYTES_PER_S;
    println!("| op | shape | rows | µs/call | weight GB/s | of floor |");
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    let mut row = |op: &str, shape: String, rows: usize, secs: f64, bytes: f64| {
        let floor = bytes / read_rate;
        println!(
            "| {op} | {shape} | {rows} | {:.1} | {:.0} | {:.0}% |",
            secs * 1e6,
            bytes / secs / 1e9,
            100.0 * floor / secs
        );
        rec.push(
            json!({"op": op, "shape": shape, "rows": rows, "us_per_call": secs * 1e6,
            "weight_bytes": bytes, "floor_us": floor * 1e6}),
        );
    };
    let row_counts = [1usize, 4, 8, 32, 100];
    for (n, k) in [
        (8192usize, 2048usize),
        (4096, 2048),
        (2048, 4096),
        (512, 2048),
        (2048, 512),
        (1024, 2048),
        (4097, 2048),
    ] {
        let w = be
            .weight_bf16(n, k, &rng.normals_bf16(n * k, 0.05))
            .map_err(s)?;
        for &r in &row_counts {
            let x = be.upload(&rng.normals_f32(r * k, 1.0), r, k).map_err(s)?;
            let t = time(&be, || be.linear(&x, &w, Rows::Exact).map(drop).map_err(s))?;
            row("linear bf16", format!("{n}x{k}"), r, t, (n * k * 2) as f64);
        }
    }
    // one MoE layer: 256 FP8 experts, I 512, H 2048, top-8 of random router logits
    let (e, i, h, topk) = (256usize, 512usize, 2048usize, 8usize);
    let mut experts = Vec::new();
    for _ in 0..e {
        let mut m = |r: usize, c: usize| {
            let sc: Vec<f32> = (0..r.div_ceil(128) * c.div_ceil(128))
                .map(|_| rng.range(1e-3, 2e-3) as f32)
                .collect();
            be.weight_fp8(r, c, &rng.fp8_bytes(r * c), &sc).map_err(s)
        };
        experts.push(Some(Expert {
            gate: m(i, h)?,
            up: m(i, h)?,
            down: m(h, i)?,
        }));
    }
    for &r in &row_counts {
        let logits = be.upload(&rng.normals_f32(r * e, 3.0), r, e).map_err(s)?;
        let route = be.route(&logits, topk, None).map_err(s)?;
        let host = be.route_host(&route).map_err(s)?;
        let distinct: std::collections::BTreeSet<u32> =
            host.experts.iter().flatten().copied().collect();
        let x = be.upload(&rng.normals_f32(r * h, 1.0), r, h).map_err(s)?;
        let t = time(&be, || {
            be.moe_experts(&x, &route, &experts, Rows::Exact)
                .map(drop)
                .map_err(s)
        })?;
        row(
            "moe_experts fp8",
            format!("E256 I512 H2048 top8, {} experts hit", distinct.len()),
            r,
            t,
            (distinct.len() * 3 * i * h) as f64,
        );
    }
    // decode attention, Drama 3 full-attention layer (16/2 heads x 256), f32 cache
    let d = AttnDims {
        q_heads: 16,
        kv_heads: 2,
        head_dim: 256,
        rot_dims: 64,
        theta: 1e7,
        rope: Rope::Neox,
    };
    for &(lanes, keys) in &[(1usize, 512usize), (1, 4096), (32, 512), (1, 32768)] {
        let mut kvs = Vec::new();
        for _ in 0..lanes {
            let mut kv = be.kv_new(keys + 128, 2, 256).map_err(s)?;
            let q = be
                .upload(&rng.normals_f32(keys * 16 * 256, 1.0), keys, 16 * 256)
                .map_err(s)?;
            let kk = be
                .upload(&rng.normals_f32(keys * 512, 1.0), keys, 512)
                .map_err(s)?;
            let vv = be
                .upload(&rng.normals_f32(keys * 512, 1.0), keys, 512)
                .map_err(s)?;
            be.attn_prefill(&q, &kk, &vv, &d, &mut kv).map_err(s)?;
            kvs.push(kv);
        }
        let q = be
            .upload(&rng.normals_f32(lanes * 16 * 256, 1.0), lanes, 16 * 256)
            .map_err(s)?;
        let kk = be
            .upload(&rng.normals_f32(lanes * 512, 1.0), lanes, 512)
            .map_err(s)?;
        let vv = be
            .upload(&rng.normals_f32(lanes * 512, 1.0), lanes, 512)
            .map_err(s)?;
        // each call appends a row: the 73 timed calls stay inside the 128 spare rows
        let t = time(&be, || {
            let mut refs: Vec<&mut backend_cuda::CudaKv> = kvs.iter_mut().collect();
            be.attn_step(&q, &kk, &vv, &d, &mut refs)
                .map(drop)
                .map_err(s)
        })?;
        row(
            "attn_step f32 kv",
            format!("16/2 x 256, {keys} keys"),
            lanes,
            t,
            (lanes * keys * 512 * 4 * 2) as f64,
        );
    }
    if let Some(p) = out {
        let v = json!({"kind": "dramatis-opbench", "device": be.gpu().info.name, "ops": rec});
        std::fs::write(
            p,
            serde_json::to_string_pretty(&v).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}
