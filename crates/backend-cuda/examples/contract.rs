//! `contract [--only PATTERN] [--bench OUT.json] [--no-contract] [--compile-only]`
//! Runs the kernel contract on device 0 (exit 1 unless all green), optionally the
//! microbenchmarks with a JSON receipt; `--compile-only` compiles every kernel variant with
//! NVRTC for compute_90a and needs no GPU.

use std::process::ExitCode;

use backend_cuda::runtime::{compile_cached, Source, Variant};
use backend_cuda::{bench, contract, Gpu};

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let val = |flag: &str| {
        args.iter()
            .position(|a| a == flag)
            .and_then(|i| args.get(i + 1))
            .cloned()
    };
    let has = |flag: &str| args.iter().any(|a| a == flag);
    if has("--compile-only") {
        for s in Source::ALL {
            for v in Variant::ALL {
                match compile_cached(s, v, "compute_90a") {
                    Ok((ptx, hit)) => println!(
                        "compiled {:<13} {:?}: {} bytes of PTX{}",
                        s.name(),
                        v,
                        ptx.len(),
                        if hit { " (cache)" } else { "" }
                    ),
                    Err(e) => {
                        eprintln!("{e}");
                        return ExitCode::FAILURE;
                    }
                }
            }
        }
        return ExitCode::SUCCESS;
    }
    let gpu = match Gpu::new(0) {
        Ok(g) => std::sync::Arc::new(g),
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::FAILURE;
        }
    };
    let mut ok = true;
    if !has("--no-contract") {
        let t0 = std::time::Instant::now();
        match contract::run_on(
            &gpu,
            val("--only").as_deref(),
            backend_cuda::rng::Rng::fresh_seed(),
        ) {
            Ok(s) => ok &= s.all_green(),
            Err(e) => {
                eprintln!("error: {e}");
                ok = false;
            }
        }
        let st = gpu.compile_stats.lock().map(|s| *s).unwrap_or((0, 0));
        println!(
            "contract took {:.1} s; kernel builds: {} compiled, {} from cache",
            t0.elapsed().as_secs_f64(),
            st.0,
            st.1
        );
    }
    if let Some(path) = val("--bench") {
        match bench::run(&gpu, 7) {
            Ok((results, copy)) => {
                let env = |k: &str| std::env::var(k).unwrap_or_else(|_| "unknown".into());
                let receipt = serde_json::json!({
                    "command": std::env::args().collect::<Vec<_>>().join(" "),
                    "gpu": gpu.info.name,
                    "driver": env("DRAMATIS_DRIVER"),
                    "cuda_driver_api_version": gpu.info.cuda_driver_version,
                    "commit": env("DRAMATIS_COMMIT"),
                    "date": env("DRAMATIS_DATE"),
                    "arch": gpu.arch,
                    "sm_count": gpu.info.sm_count,
                    "statistic": "median of 7 timed rounds (CUDA events around one CUDA-graph replay of many calls rotating over copies larger than L2); per-call time = round / calls",
                    "floor_copy_bytes_per_s_gpu_md": bench::COPY_FLOOR_BYTES_PER_S,
                    "copy_bytes_per_s_measured": copy,
                    "results": results,
                });
                if let Err(e) = std::fs::write(
                    &path,
                    serde_json::to_string_pretty(&receipt).unwrap_or_default(),
                ) {
                    eprintln!("error writing {path}: {e}");
                    ok = false;
                }
            }
            Err(e) => {
                eprintln!("bench error: {e}");
                ok = false;
            }
        }
    }
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
