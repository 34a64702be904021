//! CUDA entry points of the binary; without the `cuda` feature they say so and fail.

use anyhow::Result;
use std::process::ExitCode;

/// What a command that needs the GPU says in a build without it.
#[cfg_attr(feature = "cuda", allow(dead_code))]
const NO_CUDA: &str =
    "this build has no CUDA backend: rebuild with `cargo build --release --features cuda`";

/// `$body` with `$be` bound to the CUDA backend (`cuda`) or the CPU one; a build without the
/// `cuda` feature fails the CUDA case with [`NO_CUDA`]. The cfg split in one place.
macro_rules! on_backend {
    ($cuda:expr, $be:ident => $body:expr) => {{
        if $cuda {
            #[cfg(feature = "cuda")]
            {
                let $be =
                    backend_cuda::CudaBackend::new().map_err(|e| anyhow::anyhow!("CUDA: {e}"))?;
                $body
            }
            #[cfg(not(feature = "cuda"))]
            {
                anyhow::bail!(NO_CUDA)
            }
        } else {
            let $be = backend_cpu::CpuBackend::new();
            $body
        }
    }};
}

#[cfg(feature = "cuda")]
pub fn kernel_contract(only: Option<&str>) -> Result<ExitCode> {
    let s = backend_cuda::contract::run(only).map_err(|e| anyhow::anyhow!("{e}"))?;
    Ok(if s.fail == 0 && s.missed == 0 && s.limit_problems == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

#[cfg(not(feature = "cuda"))]
pub fn kernel_contract(_only: Option<&str>) -> Result<ExitCode> {
    anyhow::bail!(NO_CUDA)
}

#[cfg(feature = "cuda")]
pub fn golden_cuda(dir: &std::path::Path) -> Result<speech::golden::GoldenReport, String> {
    let be = backend_cuda::CudaBackend::new().map_err(|e| format!("CUDA: {e}"))?;
    speech::golden::run_cuda(dir, be)
}

#[cfg(not(feature = "cuda"))]
pub fn golden_cuda(_dir: &std::path::Path) -> Result<speech::golden::GoldenReport, String> {
    Err(NO_CUDA.into())
}

/// `dramatis qualify-window`: see `speech::qualify`.
pub fn qualify_window(
    model: Option<std::path::PathBuf>,
    cuda: bool,
    context: usize,
    chunk: usize,
    compare_cpu: bool,
    out: Option<std::path::PathBuf>,
) -> Result<ExitCode> {
    let dir = match model {
        Some(d) => d,
        None => speech::builtin::ensure_builtin().map_err(|e| anyhow::anyhow!(e))?,
    };
    let ck = checkpoint::Checkpoint::open(&dir)?;
    let max = ck.config.text_config.max_position_embeddings;
    if context > max {
        anyhow::bail!("a window of {context} rows exceeds max_position_embeddings of {max} rows");
    }
    let run = on_backend!(cuda, be => speech::qualify::fill_window(&ck, be, context, chunk))
        .map_err(|e| anyhow::anyhow!(e))?;
    let mut receipt = serde_json::json!({
        "kind": "dramatis-window-qualification",
        "command": std::env::args().collect::<Vec<_>>().join(" "),
        "commit": env!("DRAMATIS_GIT"),
        "model": dir.display().to_string(),
        "run": {
            "backend": run.backend, "window_rows": run.window_rows, "prompt_rows": run.prompt_rows,
            "frames": run.frames, "rows_used": run.rows_used, "prefill_seconds": run.prefill_seconds,
            "frame_seconds": run.frame_seconds, "last_logits_finite": run.last_logits_finite, "frame": run.frame,
        },
    });
    let mut ok = run.last_logits_finite && run.rows_used + 1 == context;
    if compare_cpu && cuda {
        let cpu = speech::qualify::fill_window(&ck, backend_cpu::CpuBackend::new(), context, chunk)
            .map_err(|e| anyhow::anyhow!(e))?;
        let same_len = run.last_logits.len() == cpu.last_logits.len();
        let diff = run
            .last_logits
            .iter()
            .zip(&cpu.last_logits)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let scale = cpu.last_logits.iter().map(|v| v.abs()).fold(0f32, f32::max);
        // The fixture's tolerance for logits: atol 1e-3 + rtol 1e-3 of the largest logit.
        let within =
            same_len && diff.is_finite() && f64::from(diff) <= 1e-3 + 1e-3 * f64::from(scale);
        let same_frame = cpu.frame == run.frame;
        receipt["cpu_reference"] = serde_json::json!({
            "prefill_seconds": cpu.prefill_seconds, "frame": cpu.frame,
            "max_abs_logit_diff": diff, "max_abs_logit": scale, "within_tolerance": within,
            "same_frame": same_frame,
        });
        ok &= within && same_frame;
        ok &= cpu.last_logits_finite;
    }
    receipt["verdict"] = serde_json::json!(if ok { "filled" } else { "failed" });
    let text = serde_json::to_string_pretty(&receipt)?;
    if let Some(p) = out {
        std::fs::write(&p, &text)?;
    }
    println!("{text}");
    Ok(if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Prefill seconds of `runs` prompts of each length on one loaded model
/// (`qualify::prefill_runs`).
pub fn prefill_runs_on(
    ck: &checkpoint::Checkpoint,
    cuda: bool,
    lengths: &[usize],
    chunk: usize,
    runs: usize,
) -> Result<Vec<Vec<f64>>> {
    on_backend!(cuda, be => speech::qualify::prefill_runs(ck, be, lengths, chunk, runs))
        .map_err(|e| anyhow::anyhow!(e))
}
