//! The CUDA backend of dramatis: CUDA C kernels kept in `kernels/`, compiled by NVRTC at first
//! use for the device's architecture and cached on disk; typed launch wrappers; FP64 CPU
//! references; the kernel contract that checks every kernel against them; and a device-memory
//! sampler ([`memwatch`]) for receipts that set measured memory against the plan.
//!
//! It is not the model: the Drama 3 math lives in `model`, over a `Backend` trait that this
//! crate implements. Every CUDA library is opened at run time (cudarc dynamic loading), so the
//! crate builds and its CPU-side tests run on machines without CUDA.

pub mod backend;
pub mod bench;
pub mod contract;
pub mod error;
pub mod kernels;
mod lt;
pub mod memwatch;
pub mod reference;
pub mod rng;
pub mod runtime;

pub use backend::{
    CudaBackend, CudaBuf, CudaGdn, CudaKv, CudaOptions, CudaRoute, CudaVector, CudaWeight,
};
pub use error::{CudaError, Result};
pub use runtime::{driver_present, nvrtc_present, DeviceInfo, Gpu, Source, Variant};
