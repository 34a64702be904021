//! Device memory in use, read from the driver, so receipts can set what a run really held against
//! the memory plan (`dramatis bench`).
//!
//! Every figure is device-wide (`cuMemGetInfo`: total - free on ordinal 0): it counts every
//! process and context on the GPU, so callers subtract a baseline taken before they allocate.
//! Without a driver every call is an error ([`CudaError::NoDriver`]), never a panic.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use cudarc::driver::CudaContext;

use crate::error::{CudaError, Result};
use crate::runtime::driver_present;

/// The device the engine runs on: the backend and the GPU codec both open ordinal 0.
const ORDINAL: usize = 0;

/// How often [`PeakSampler`] polls: far shorter than a weight upload or a decode round, and a
/// `cuMemGetInfo` call costs microseconds, so polling does not slow the run it measures.
pub const DEFAULT_INTERVAL: Duration = Duration::from_millis(5);

/// Device 0's primary context, retained once for the life of the process. The engine shares the
/// primary context, so every sample carries the same context overhead, and polling never pays for
/// creating (hundreds of ms) and releasing one.
fn context() -> Result<Arc<CudaContext>> {
    static CTX: OnceLock<Arc<CudaContext>> = OnceLock::new();
    if let Some(ctx) = CTX.get() {
        return Ok(Arc::clone(ctx));
    }
    // cudarc's loader panics on a missing library; check first.
    if !driver_present() {
        return Err(CudaError::NoDriver);
    }
    let count = CudaContext::device_count()?;
    if count < 1 {
        return Err(CudaError::NoDevice {
            ordinal: ORDINAL,
            count,
        });
    }
    let ctx = CudaContext::new(ORDINAL)?;
    Ok(Arc::clone(CTX.get_or_init(|| ctx)))
}

/// Bytes in use on device 0 now (total - free), by every process on it.
pub fn used_bytes() -> Result<u64> {
    let (free, total) = context()?.mem_get_info()?;
    let used = total.checked_sub(free).ok_or(CudaError::Overflow {
        what: "device memory in use (total bytes - free bytes)",
    })?;
    u64::try_from(used).map_err(|_| CudaError::Overflow {
        what: "device memory in use (bytes)",
    })
}

/// Device 0 as receipts name it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceFacts {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub total_bytes: u64,
    /// `cuDriverGetVersion`: 1000 x major + 10 x minor (13000 is CUDA 13.0).
    pub driver_version: i32,
}

/// Name, compute capability, memory and driver version of device 0.
pub fn device_facts() -> Result<DeviceFacts> {
    let ctx = context()?;
    let mut drv = 0;
    // SAFETY: the driver is loaded (the context exists); the pointer is a live local.
    unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut drv) };
    Ok(DeviceFacts {
        name: ctx.name()?,
        compute_capability: ctx.compute_capability()?,
        total_bytes: u64::try_from(ctx.total_mem()?).unwrap_or(u64::MAX),
        driver_version: drv,
    })
}

/// Device 0's device-to-device copy rate: the figure a weight-read floor divides by (GPU.md
/// measured the H200's; on any other device the bench measures it with this).
#[derive(Clone, Debug, PartialEq)]
pub struct CopyRate {
    /// Bytes read plus bytes written per second, the median of the timed copies.
    pub bytes_per_s: f64,
    /// Bytes of each of the two buffers (one copy reads one and writes the other).
    pub buffer_bytes: usize,
    /// Seconds of each timed copy.
    pub runs_s: Vec<f64>,
}

/// Two plain device allocations (`cuMemAlloc`, not the stream-ordered pool), freed on drop, so
/// a memory baseline taken after [`copy_rate`] does not hold them.
struct Plain(Vec<cudarc::driver::sys::CUdeviceptr>);

impl Drop for Plain {
    fn drop(&mut self) {
        for &p in &self.0 {
            // SAFETY: each pointer came from `malloc_sync` in this context and is freed once;
            // a failure to free leaves nothing to do here.
            let _ = unsafe { cudarc::driver::result::free_sync(p) };
        }
    }
}

/// Measures device 0's copy rate: one untimed copy between two buffers of `bytes`, then `reps`
/// copies each timed with events; the rate counts the bytes read and the bytes written (GPU.md's
/// convention). The buffers are freed before it returns.
pub fn copy_rate(bytes: usize, reps: usize) -> Result<CopyRate> {
    use cudarc::driver::result;
    let ctx = context()?;
    ctx.bind_to_thread()?;
    let stream = ctx.new_stream()?;
    let mut bufs = Plain(Vec::with_capacity(2));
    for _ in 0..2 {
        // SAFETY: the context is bound to this thread; the pointer is owned by `bufs`.
        bufs.0.push(unsafe { result::malloc_sync(bytes) }?);
    }
    let (src, dst) = (bufs.0[0], bufs.0[1]);
    let copy = || {
        // SAFETY: both buffers hold `bytes` bytes and live until `bufs` drops, after the
        // stream is synchronised below.
        unsafe { result::memcpy_dtod_async(dst, src, bytes, stream.cu_stream()) }
    };
    // SAFETY: as above; the source's bytes only need to be defined, not meaningful.
    unsafe { result::memset_d8_async(src, 0x5a, bytes, stream.cu_stream()) }?;
    copy()?;
    // timed events (cudarc's default disables timing)
    let timed = || ctx.new_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT));
    let mut runs_s = Vec::with_capacity(reps);
    for _ in 0..reps.max(1) {
        let (a, b) = (timed()?, timed()?);
        a.record(&stream)?;
        copy()?;
        b.record(&stream)?;
        b.synchronize()?;
        runs_s.push(f64::from(a.elapsed_ms(&b)?) * 1e-3);
    }
    stream.synchronize()?;
    drop(bufs);
    let mut sorted = runs_s.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    Ok(CopyRate {
        bytes_per_s: 2.0 * bytes as f64 / median,
        buffer_bytes: bytes,
        runs_s,
    })
}

/// The highest device memory figure a [`PeakSampler`] saw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peak {
    /// Device-wide bytes in use at the highest sample.
    pub used_bytes: u64,
    /// Samples taken (the first one included); a peak of few samples may have missed a spike.
    pub samples: u64,
}

/// Polls [`used_bytes`] on its own thread until stopped and keeps the maximum. Allocations that
/// live shorter than the interval can be missed: the peak is a lower bound.
pub struct PeakSampler {
    stop: Arc<AtomicBool>,
    peak: Arc<AtomicU64>,
    samples: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

impl PeakSampler {
    /// Takes the first sample before returning, so a missing driver is an error here rather than
    /// a silent zero at the end.
    pub fn start(interval: Duration) -> Result<Self> {
        let first = used_bytes()?;
        let stop = Arc::new(AtomicBool::new(false));
        let peak = Arc::new(AtomicU64::new(first));
        let samples = Arc::new(AtomicU64::new(1));
        let thread = std::thread::Builder::new().name("memwatch".into()).spawn({
            let (stop, peak, samples) = (stop.clone(), peak.clone(), samples.clone());
            move || poll(interval, &stop, &peak, &samples)
        })?;
        Ok(Self {
            stop,
            peak,
            samples,
            thread: Some(thread),
        })
    }

    /// Stops polling (after one last sample) and returns the peak.
    pub fn stop(mut self) -> Peak {
        self.join();
        Peak {
            used_bytes: self.peak.load(Ordering::Acquire),
            samples: self.samples.load(Ordering::Acquire),
        }
    }

    fn join(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            // The poll loop cannot panic; a join error would only lose samples, not the peak.
            let _ = t.join();
        }
    }
}

impl Drop for PeakSampler {
    fn drop(&mut self) {
        self.join();
    }
}

fn poll(interval: Duration, stop: &AtomicBool, peak: &AtomicU64, samples: &AtomicU64) {
    loop {
        let last = stop.load(Ordering::Acquire);
        // A failed sample (a transient driver error) is skipped: the peak stays a lower bound.
        if let Ok(used) = used_bytes() {
            peak.fetch_max(used, Ordering::AcqRel);
            samples.fetch_add(1, Ordering::AcqRel);
        }
        if last {
            return;
        }
        std::thread::sleep(interval);
    }
}

/// Device 0's default memory pool (the stream-ordered allocator every allocation of the engine,
/// the GPU codec included, is served from), its context current on this thread.
fn default_pool() -> Result<cudarc::driver::sys::CUmemoryPool> {
    pool_of(&*context()?)
}

/// The default memory pool of `ctx`'s device, `ctx` made current on this thread.
fn pool_of(ctx: &CudaContext) -> Result<cudarc::driver::sys::CUmemoryPool> {
    use cudarc::driver::sys;
    ctx.bind_to_thread()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    // SAFETY: the context is current; `pool` is a live local that receives the handle.
    unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()) }.result()?;
    Ok(pool)
}

/// Raises the release threshold of `ctx`'s device's default pool to the maximum, so memory
/// freed to it stays there for the next allocation (and a start-up reservation stays held)
/// instead of going back to the driver at each synchronisation.
pub fn keep_freed_memory(ctx: &CudaContext) -> Result<()> {
    use cudarc::driver::sys;
    let pool = pool_of(ctx)?;
    let mut threshold: u64 = u64::MAX;
    // SAFETY: the pool handle is live; the attribute value is a live u64.
    unsafe {
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
    }
    .result()?;
    Ok(())
}

/// One u64 attribute of the default pool.
fn pool_attr(attr: cudarc::driver::sys::CUmemPool_attribute) -> Result<u64> {
    let pool = default_pool()?;
    let mut v: u64 = 0;
    // SAFETY: the pool handle is live; the three attributes read here are u64 values.
    unsafe { cudarc::driver::sys::cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) }
        .result()?;
    Ok(v)
}

/// What the default pool holds from the driver, in use or kept for reuse (bytes).
pub fn pool_reserved_bytes() -> Result<u64> {
    pool_attr(cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)
}

/// What of the default pool is allocated now (bytes).
pub fn pool_used_bytes() -> Result<u64> {
    pool_attr(cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)
}

/// The most of the default pool allocated at once since [`reset_pool_used_high`] (bytes).
pub fn pool_used_high_bytes() -> Result<u64> {
    pool_attr(cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH)
}

/// Restarts the pool's high-water mark from what is allocated now.
pub fn reset_pool_used_high() -> Result<()> {
    let pool = default_pool()?;
    let mut zero: u64 = 0;
    // SAFETY: as pool_attr; the driver accepts only zero for this attribute (a reset).
    unsafe {
        cudarc::driver::sys::cuMemPoolSetAttribute(
            pool,
            cudarc::driver::sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            (&mut zero as *mut u64).cast(),
        )
    }
    .result()?;
    Ok(())
}

/// Gives the default pool's unused memory back to the driver (a failed start-up, or an engine
/// that stopped, leaves nothing held for other processes).
pub fn trim_pool() -> Result<()> {
    let pool = default_pool()?;
    // SAFETY: the pool handle is live; trimming releases only memory no allocation holds.
    unsafe { cudarc::driver::sys::cuMemPoolTrimTo(pool, 0) }.result()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver both entry points refuse with NoDriver (no panic from cudarc's loader);
    /// with one, the figures are real and the sampler keeps polling until stopped.
    #[test]
    fn used_bytes_and_sampler_error_cleanly_without_a_driver() {
        if !driver_present() {
            assert!(matches!(used_bytes(), Err(CudaError::NoDriver)));
            assert!(matches!(
                PeakSampler::start(DEFAULT_INTERVAL),
                Err(CudaError::NoDriver)
            ));
            return;
        }
        let before = used_bytes().expect("device memory with a driver present");
        assert!(before > 0, "a live context holds device memory");
        let sampler = PeakSampler::start(DEFAULT_INTERVAL).expect("sampler with a driver");
        std::thread::sleep(DEFAULT_INTERVAL * 4);
        let peak = sampler.stop();
        assert!(peak.samples >= 2, "{} samples", peak.samples);
        assert!(peak.used_bytes > 0);
    }
}
