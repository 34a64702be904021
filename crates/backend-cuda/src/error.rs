//! Errors of the CUDA backend.

/// Everything that can go wrong between the host and the GPU.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    #[error("no CUDA driver library (libcuda.so.1) could be opened: this machine has no usable NVIDIA driver")]
    NoDriver,
    #[error("NVRTC (libnvrtc.so.13) could not be opened: install the CUDA 13 runtime libraries, or `pip install nvidia-cuda-nvrtc==13.0.88` and put its lib/ folder on LD_LIBRARY_PATH")]
    NoNvrtc,
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice { ordinal: usize, count: i32 },
    #[error("device {name} has compute capability {major}.{minor}; the kernels need 8.9 or newer (FP8 conversions)")]
    Arch {
        name: String,
        major: i32,
        minor: i32,
    },
    #[error("CUDA driver call failed: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("NVRTC failed to compile {source_name} with [{options}]:\n{log}")]
    Compile {
        source_name: &'static str,
        options: String,
        log: String,
    },
    #[error("{kernel}: {what}")]
    Shape { kernel: &'static str, what: String },
    #[error("size overflow computing {what}")]
    Overflow { what: &'static str },
    #[error("{kernel}: launch {what} is {value}, over the device limit {limit}")]
    Launch {
        kernel: &'static str,
        what: &'static str,
        value: u64,
        limit: u64,
    },
    #[error(transparent)]
    Backend(#[from] model::BackendError),
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, CudaError>;

/// Checked product of sizes, naming what is being computed in the error.
pub(crate) fn mul(what: &'static str, factors: &[usize]) -> Result<usize> {
    factors
        .iter()
        .try_fold(1usize, |acc, &f| acc.checked_mul(f))
        .ok_or(CudaError::Overflow { what })
}

/// usize to u32 for launch dimensions.
pub(crate) fn u32_of(what: &'static str, v: usize) -> Result<u32> {
    u32::try_from(v).map_err(|_| CudaError::Overflow { what })
}

/// usize to i32 for kernel int parameters.
pub(crate) fn i32_of(what: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| CudaError::Overflow { what })
}
