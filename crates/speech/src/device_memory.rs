//! Device memory in use, for receipts that set it against the memory plan (`dramatis bench`).
//!
//! A thin face over `backend_cuda::memwatch` so callers need no `cfg`: without the `cuda`
//! feature, or without a driver, there is no figure (`None`) rather than an error to handle.

/// Device-wide bytes in use on device 0 now (every process counts); `None` without the `cuda`
/// feature or a usable driver.
pub fn device_memory_used() -> Option<u64> {
    #[cfg(feature = "cuda")]
    {
        backend_cuda::memwatch::used_bytes().ok()
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// Device 0's free memory in bytes now (total less what every process, this one's context
/// included, holds): the device budget the memory plan detects at start-up, as `MemAvailable`
/// is the host's. `None` without the `cuda` feature or a usable driver.
pub fn device_free_bytes() -> Option<u64> {
    #[cfg(feature = "cuda")]
    {
        let total = backend_cuda::memwatch::device_facts().ok()?.total_bytes;
        let used = backend_cuda::memwatch::used_bytes().ok()?;
        Some(total.saturating_sub(used))
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// The device budget a CUDA plan is checked against: `--device-gib` where given, else the
/// device's free memory ([`device_free_bytes`]); none without either.
pub fn device_budget(flag: Option<admission::Bytes>) -> Option<admission::MemoryBudget> {
    admission::MemoryBudget::choose(flag, device_free_bytes().map(admission::Bytes))
}

/// The default pool's high-water mark of allocated bytes since [`reset_device_pool_high`], and
/// what it holds allocated now: with the weights resident and the plan's state reserved, their
/// difference is the state a run really used (`dramatis bench`). `None` without CUDA.
pub fn device_pool_used() -> Option<(u64, u64)> {
    #[cfg(feature = "cuda")]
    {
        Some((
            backend_cuda::memwatch::pool_used_high_bytes().ok()?,
            backend_cuda::memwatch::pool_used_bytes().ok()?,
        ))
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// Restarts the default pool's high-water mark from what is allocated now.
pub fn reset_device_pool_high() -> bool {
    #[cfg(feature = "cuda")]
    {
        backend_cuda::memwatch::reset_pool_used_high().is_ok()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Device 0 for receipts (name, compute capability, memory, CUDA driver version); `None`
/// without the `cuda` feature or a usable driver.
pub fn device_facts() -> Option<serde_json::Value> {
    #[cfg(feature = "cuda")]
    {
        backend_cuda::memwatch::device_facts().ok().map(|f| {
            serde_json::json!({
                "name": f.name,
                "compute_capability": format!("{}.{}", f.compute_capability.0, f.compute_capability.1),
                "memory_bytes": f.total_bytes,
                "cuda_driver": format!("{}.{}", f.driver_version / 1000, (f.driver_version % 1000) / 10),
            })
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// Device 0's measured device-to-device copy rate for receipts: `bytes_per_s` (bytes read plus
/// written, the median), the buffer size and every timed copy's seconds; an error that says why
/// not (no `cuda` feature, no usable driver, no room for two buffers of `bytes`).
pub fn device_copy_rate(bytes: usize, reps: usize) -> Result<serde_json::Value, String> {
    #[cfg(feature = "cuda")]
    {
        backend_cuda::memwatch::copy_rate(bytes, reps)
            .map(|c| {
                serde_json::json!({
                    "bytes_per_s": c.bytes_per_s,
                    "buffer_bytes": c.buffer_bytes,
                    "runs_s": c.runs_s,
                })
            })
            .map_err(|e| e.to_string())
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (bytes, reps);
        Err("this build has no CUDA backend".into())
    }
}

/// The highest device memory figure seen while a [`DevicePeakSampler`] ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DevicePeak {
    /// Device-wide bytes in use at the highest sample.
    pub used_bytes: u64,
    /// Samples taken; the peak is a lower bound (a spike between samples is missed).
    pub samples: u64,
    /// Milliseconds between samples.
    pub interval_ms: u64,
}

/// Polls device memory on its own thread until stopped; see `backend_cuda::memwatch`.
pub struct DevicePeakSampler {
    #[cfg(feature = "cuda")]
    inner: backend_cuda::memwatch::PeakSampler,
    /// Keeps the CPU-only build's sampler unconstructible outside `start`.
    #[cfg(not(feature = "cuda"))]
    _none: (),
}

impl DevicePeakSampler {
    /// Starts polling every few milliseconds; `None` without the `cuda` feature or a driver.
    pub fn start() -> Option<Self> {
        #[cfg(feature = "cuda")]
        {
            backend_cuda::memwatch::PeakSampler::start(backend_cuda::memwatch::DEFAULT_INTERVAL)
                .ok()
                .map(|inner| Self { inner })
        }
        #[cfg(not(feature = "cuda"))]
        {
            None
        }
    }

    /// Stops polling and returns the peak.
    pub fn stop(self) -> DevicePeak {
        #[cfg(feature = "cuda")]
        {
            let peak = self.inner.stop();
            let interval = backend_cuda::memwatch::DEFAULT_INTERVAL;
            DevicePeak {
                used_bytes: peak.used_bytes,
                samples: peak.samples,
                interval_ms: u64::try_from(interval.as_millis()).unwrap_or(u64::MAX),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            // `start` never returns a sampler in this build, so no caller reaches this.
            DevicePeak {
                used_bytes: 0,
                samples: 0,
                interval_ms: 0,
            }
        }
    }
}

#[cfg(all(test, feature = "cuda"))]
mod tests {
    use super::*;

    /// No driver: no figure and no sampler, and no panic from the driver loader. With one: a
    /// positive figure and a sampler that samples. (Without the `cuda` feature the functions
    /// are `None` by construction, so there is nothing to test.)
    #[test]
    fn figures_exist_exactly_when_a_driver_can_be_read() {
        if !backend_cuda::driver_present() {
            assert_eq!(device_memory_used(), None);
            assert!(DevicePeakSampler::start().is_none());
            return;
        }
        assert!(device_memory_used().is_some_and(|b| b > 0));
        let peak = DevicePeakSampler::start()
            .expect("a sampler with a driver present")
            .stop();
        assert!(peak.samples >= 1 && peak.used_bytes > 0, "{peak:?}");
    }
}
