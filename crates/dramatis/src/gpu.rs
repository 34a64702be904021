//! CUDA entry points of the binary; without the `cuda` feature they say so and fail.

use anyhow::Result;
use std::process::ExitCode;

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
    anyhow::bail!(
        "this build has no CUDA backend: rebuild with `cargo build --release --features cuda`"
    )
}

#[cfg(feature = "cuda")]
pub fn golden_cuda(dir: &std::path::Path) -> Result<speech::golden::GoldenReport, String> {
    let be = backend_cuda::CudaBackend::new().map_err(|e| format!("CUDA: {e}"))?;
    speech::golden::run_with(dir, be)
}

#[cfg(not(feature = "cuda"))]
pub fn golden_cuda(_dir: &std::path::Path) -> Result<speech::golden::GoldenReport, String> {
    Err(
        "this build has no CUDA backend: rebuild with `cargo build --release --features cuda`"
            .into(),
    )
}
