//! `gemvbench [--out FILE.json] [--rows 1,8,32] [VARIANT ...]`: the BF16 decode linears with cold weights, as a
//! frame reads them. Each shape is uploaded in enough copies to pass 400 MB (far over the 50 MB
//! L2), and consecutive calls walk the copies, so every call reads its weight from HBM; `opbench`
//! repeats one weight and so measures L2 for the smaller ones. A variant is `old` (session 7's
//! `gemv_tc`: 512 keys per warp in 32-key steps) or `KC:V[:W]` (at least KC keys per warp, load
//! layout V = 1 or 2, W warps a block at every row count, 0 a warp per chunk; without W the
//! engine's setting). Figures are
//! the median of 5 rounds of 40 calls, event-timed after a warm-up; the floor is the weight bytes
//! over the 4.3 TB/s measured copy rate.

use backend_cuda::rng::Rng;
use backend_cuda::{CudaBackend, CudaOptions, Variant};
use model::{Backend, Rows};
use serde_json::json;

const CALLS: usize = 40;

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut out = None;
    let mut variants = Vec::new();
    let mut row_counts = vec![1usize, 8, 32];
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--out" {
            out = it.next().cloned();
        } else if a == "--rows" {
            let list = it.next().ok_or("--rows needs a list, e.g. 1,8,32")?;
            row_counts = list
                .split(',')
                .map(|r| {
                    r.trim()
                        .parse::<usize>()
                        .map_err(|e| format!("--rows {list}: {e}"))
                })
                .collect::<Result<_, _>>()?;
        } else {
            variants.push(a.clone());
        }
    }
    if variants.is_empty() {
        variants = ["old", "128:1", "128:2", "256:2"]
            .map(String::from)
            .to_vec();
    }
    let base = CudaBackend::new().map_err(|e| e.to_string())?;
    let gpu = base.gpu().clone();
    let s = |e: model::BackendError| e.to_string();
    let floor_rate = backend_cuda::bench::COPY_FLOOR_BYTES_PER_S;
    let mut rng = Rng::new(11);
    // (label, outputs of each weight of one launch, K): single linears and the frame's multi groups
    let shapes: Vec<(&str, Vec<usize>, usize)> = vec![
        ("gdn qkv+z+b+a", vec![8192, 4096, 32, 32], 2048),
        ("attn q+k+v", vec![8192, 512, 512], 2048),
        ("tower w1+w3", vec![6144, 6144], 2048),
        ("moe router+gate+up+sg", vec![256, 512, 512, 1], 2048),
        ("tower qkv", vec![9216], 2048),
        ("out proj", vec![2048], 4096),
        ("tower w2", vec![2048], 6144),
        ("shared down", vec![2048], 512),
        ("head", vec![4096], 2048),
    ];
    let mut rec = Vec::new();
    println!("| shape | K | rows | variant | µs/call | GB/s | of floor |");
    println!("| --- | ---: | ---: | --- | ---: | ---: | ---: |");
    for (label, outs, k) in &shapes {
        let bytes: usize = outs.iter().map(|n| n * k * 2).sum();
        let copies = (400_000_000usize).div_ceil(bytes).clamp(2, 64);
        let bits: Vec<Vec<u16>> = outs
            .iter()
            .map(|&n| rng.normals_bf16(n * k, 0.05))
            .collect();
        let mut sets = Vec::new();
        for _ in 0..copies {
            let ws = outs
                .iter()
                .zip(&bits)
                .map(|(&n, b)| base.weight_bf16(n, *k, b))
                .collect::<Result<Vec<_>, _>>()
                .map_err(s)?;
            sets.push(ws);
        }
        for &rows in &row_counts {
            let x = base
                .upload(&rng.normals_f32(rows * k, 1.0), rows, *k)
                .map_err(s)?;
            let mut reference: Option<Vec<f32>> = None;
            for v in &variants {
                // KC:V[:W], W warps a block at every row count (0: a warp per chunk)
                let parts: Vec<&str> = v.split(':').collect();
                let (kc, vv, ww) = match parts.as_slice() {
                    [a, b, rest @ ..] => (
                        a.parse().unwrap_or(128),
                        b.parse().unwrap_or(1),
                        rest.first().map(|w| w.parse().unwrap_or(0)),
                    ),
                    _ => (0, 1, None),
                };
                let env = CudaOptions::from_env();
                let opts = CudaOptions {
                    gemv_kc: kc,
                    gemv_v: vv,
                    gemv_warps: ww.unwrap_or(env.gemv_warps),
                    gemv_warps_many: ww.unwrap_or(env.gemv_warps_many),
                    ..env
                };
                let be = CudaBackend::with_gpu(gpu.clone(), Variant::Exact, opts);
                let xb = be
                    .upload(&be.download(&x).map_err(s)?, rows, *k)
                    .map_err(s)?;
                let call = |i: usize| -> Result<(), String> {
                    let refs: Vec<_> = sets[i % copies].iter().collect();
                    if refs.len() == 1 {
                        be.linear(&xb, refs[0], Rows::Exact).map(drop).map_err(s)?;
                    } else {
                        be.linear_many(&xb, &refs, Rows::Exact)
                            .map(drop)
                            .map_err(s)?;
                    }
                    Ok(())
                };
                for i in 0..3 {
                    call(i)?;
                }
                // a sanity check that the variant computes: its first weight's output against the
                // first variant's (different key splits differ in the last bits only)
                let y0 = be.linear(&xb, &sets[0][0], Rows::Exact).map_err(s)?;
                let y0 = be.download(&y0).map_err(s)?;
                let diff = match &reference {
                    None => {
                        reference = Some(y0.clone());
                        0.0
                    }
                    Some(r) => {
                        let num: f64 = r
                            .iter()
                            .zip(&y0)
                            .map(|(a, b)| f64::from(a - b).powi(2))
                            .sum();
                        let den: f64 = r.iter().map(|a| f64::from(*a).powi(2)).sum();
                        (num / den.max(1e-30)).sqrt()
                    }
                };
                // the warm-up above took calls 0..3
                let mut times =
                    backend_cuda::bench::event_seconds(&gpu, 5, CALLS, |i| call(i + 3))?;
                times.sort_by(f64::total_cmp);
                let t = times[2];
                let floor = bytes as f64 / floor_rate;
                println!(
                    "| {label} | {k} | {rows} | {v} | {:.2} | {:.0} | {:.0}% |",
                    t * 1e6,
                    bytes as f64 / t / 1e9,
                    100.0 * floor / t
                );
                if diff == 0.0 && v != &variants[0] {
                    println!("(bits equal to the first variant: {label} rows {rows} {v})");
                }
                if diff > 1e-5 {
                    println!("WARNING {label} rows {rows} variant {v}: rel L2 {diff:.2e} from the first variant");
                }
                rec.push(
                    json!({"shape": label, "outs": outs, "k": k, "rows": rows, "variant": v,
                    "us_per_call": t * 1e6, "weight_bytes": bytes, "floor_us": floor * 1e6,
                    "rel_l2_vs_first_variant": diff}),
                );
            }
        }
    }
    if let Some(p) = out {
        let doc = json!({"what": "BF16 decode linears, cold weights (copies over 400 MB)",
            "calls_per_round": CALLS, "rounds": 5, "statistic": "median",
            "commit": option_env!("DRAMATIS_COMMIT").unwrap_or("unknown"), "results": rec});
        std::fs::write(
            &p,
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}
