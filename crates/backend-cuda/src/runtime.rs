//! Opening the driver, compiling kernels with NVRTC (cached on disk), and the device handle.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use sha2::{Digest, Sha256};

use crate::error::{CudaError, Result};

const PRELUDE: &str = include_str!("../kernels/prelude.cu");

/// One CUDA C source file of the crate.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    Norm,
    Gemv,
    Moe,
    Gdn,
    Ops,
    Gemm,
    Round,
}

impl Source {
    pub const ALL: [Source; 7] = [
        Source::Norm,
        Source::Gemv,
        Source::Moe,
        Source::Gdn,
        Source::Ops,
        Source::Gemm,
        Source::Round,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Source::Norm => "norm.cu",
            Source::Gemv => "gemv.cu",
            Source::Moe => "moe.cu",
            Source::Gdn => "gdn.cu",
            Source::Ops => "ops.cu",
            Source::Gemm => "gemm.cu",
            Source::Round => "round.cu",
        }
    }

    /// The file as written (no prelude, no dependent-launch waits).
    pub fn body(self) -> &'static str {
        match self {
            Source::Norm => include_str!("../kernels/norm.cu"),
            Source::Gemv => include_str!("../kernels/gemv.cu"),
            Source::Moe => include_str!("../kernels/moe.cu"),
            Source::Gdn => include_str!("../kernels/gdn.cu"),
            Source::Ops => include_str!("../kernels/ops.cu"),
            Source::Gemm => include_str!("../kernels/gemm.cu"),
            Source::Round => include_str!("../kernels/round.cu"),
        }
    }

    /// The full translation unit: the shared prelude then the file, with `PDL_WAIT();` opening
    /// every kernel (empty unless the build defines DRAMATIS_PDL: `pdl_enabled`).
    pub fn text(self) -> String {
        format!("{PRELUDE}\n{}", with_pdl_waits(self.body()))
    }
}

/// `PDL_WAIT();` as the first statement of every `extern "C" __global__` function of `body`: the
/// first `{` after each such declaration opens its body. With programmatic dependent launch a
/// kernel may start before the one ahead of it has finished, and must wait before it touches
/// memory; putting the wait in mechanically means no kernel can miss it.
pub fn with_pdl_waits(body: &str) -> String {
    const KERNEL: &str = "extern \"C\" __global__";
    let mut out = String::with_capacity(body.len() + 16 * 128);
    let mut rest = body;
    while let Some(i) = rest.find(KERNEL) {
        let after = i + KERNEL.len();
        let Some(j) = rest[after..].find('{') else {
            break;
        };
        let open = after + j + 1;
        out.push_str(&rest[..open]);
        out.push_str(" PDL_WAIT();");
        rest = &rest[open..];
    }
    out.push_str(rest);
    out
}

/// Programmatic dependent launch (on by default on Hopper or newer; `DRAMATIS_CUDA_PDL=0` turns
/// it off): each backend launch lets the next kernel's blocks start while the one ahead drains,
/// and every kernel opens with `griddepcontrol.wait`. Read once per process, so the kernels'
/// builds and the launches agree. Session 9 on the H200: goldens 31/31 and one `say` hash with
/// it; one lane 107.7 -> 112.6 frames/s (NOTES.md).
pub fn pdl_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| pdl_from(std::env::var("DRAMATIS_CUDA_PDL").ok().as_deref()))
}

/// The dependent-launch setting from `DRAMATIS_CUDA_PDL`'s value: on unless it is `0`.
pub fn pdl_from(v: Option<&str>) -> bool {
    v.is_none_or(|v| v.trim() != "0")
}

/// Whether this process's builds for `arch` carry the dependent-launch wait, and so whether its
/// launches may be dependent: the one place both are decided.
pub fn pdl_for(arch: &str) -> bool {
    pdl_enabled() && arch_has_pdl(arch)
}

/// Whether an architecture (`compute_NN[a]`) has `griddepcontrol` (sm_90 and newer).
pub fn arch_has_pdl(arch: &str) -> bool {
    arch.trim_start_matches("compute_")
        .trim_end_matches(|c: char| c.is_ascii_alphabetic())
        .parse::<u32>()
        .is_ok_and(|n| n >= 90)
}

/// Which build of a source: the real kernels, a lower-precision twin that the contract's
/// precision-discriminating cases must reject, or deliberately wrong kernels (planted controls).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Variant {
    Exact,
    LowPrecision,
    Planted,
}

impl Variant {
    pub const ALL: [Variant; 3] = [Variant::Exact, Variant::LowPrecision, Variant::Planted];

    fn defines(self) -> &'static [&'static str] {
        match self {
            Variant::Exact => &[],
            Variant::LowPrecision => &["-DLOWP=1"],
            Variant::Planted => &["-DPLANT=1"],
        }
    }
}

/// True when the CUDA driver library can be opened (never panics).
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// True when NVRTC can be opened (never panics).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its candidate names.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// NVRTC's version; part of the cache key.
pub fn nvrtc_version() -> Result<(i32, i32)> {
    if !nvrtc_present() {
        return Err(CudaError::NoNvrtc);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC is present; the pointers are to live locals.
    let rc = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if rc != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::NoNvrtc);
    }
    Ok((major, minor))
}

/// The virtual architecture to compile for: `compute_90a` on Hopper (wgmma-capable), else plain.
pub fn arch_for(major: i32, minor: i32) -> String {
    if (major, minor) == (9, 0) {
        "compute_90a".to_string()
    } else {
        format!("compute_{major}{minor}")
    }
}

/// NVRTC options for one source variant in this process (`pdl_for`).
pub fn compile_options(arch: &str, variant: Variant) -> Vec<String> {
    compile_options_with(
        arch,
        variant,
        pdl_for(arch),
        occupancy(),
        tile_occupancy(),
        split_stages(),
    )
}

/// NVRTC options for one source variant, with or without the dependent-launch wait, for `occ`
/// blocks a multiprocessor of the streaming kernels (`occupancy`) and `tt_occ` of the many-row
/// GEMV tiles (`tile_occupancy`), and `ts_st` step buffers of the split GEMV tiles
/// (`split_stages`).
pub fn compile_options_with(
    arch: &str,
    variant: Variant,
    pdl: bool,
    occ: u32,
    tt_occ: u32,
    ts_st: u32,
) -> Vec<String> {
    let mut o = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "--fmad=true".to_string(),
    ];
    o.extend(variant.defines().iter().map(|s| s.to_string()));
    if pdl {
        o.push("-DDRAMATIS_PDL=1".to_string());
    }
    if occ != 1 {
        o.push(format!("-DOCC={occ}"));
    }
    if tt_occ != 2 {
        o.push(format!("-DTT_OCC={tt_occ}"));
    }
    if ts_st != 3 {
        o.push(format!("-DTS_ST={ts_st}"));
    }
    o
}

/// Shared-memory buffers of 64-key steps in `gemv_ts*` (gemv.cu `TS_ST`), from
/// `DRAMATIS_CUDA_TS_STAGES`: 2 (one step in flight, the build before session 26) when it is
/// `2`, else 3. The same operations in the same order either way, so the same bits. Read once
/// per process.
pub fn split_stages() -> u32 {
    static ST: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *ST.get_or_init(|| split_stages_from(std::env::var("DRAMATIS_CUDA_TS_STAGES").ok().as_deref()))
}

/// The `TS_ST` setting from `DRAMATIS_CUDA_TS_STAGES`'s value: 2 when it is `2`, else 3.
pub fn split_stages_from(v: Option<&str>) -> u32 {
    if v.is_some_and(|v| v.trim() == "2") {
        2
    } else {
        3
    }
}

/// Blocks a multiprocessor `gemv_tt` asks for (gemv.cu `TT_OCC`), from `DRAMATIS_CUDA_TT_OCC`:
/// 2 unless it is `0` (no bound, the build before session 16). Read once per process.
pub fn tile_occupancy() -> u32 {
    static OCC: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *OCC.get_or_init(|| tile_occupancy_from(std::env::var("DRAMATIS_CUDA_TT_OCC").ok().as_deref()))
}

/// The `TT_OCC` setting from `DRAMATIS_CUDA_TT_OCC`'s value: 0 when it is `0`, else 2.
pub fn tile_occupancy_from(v: Option<&str>) -> u32 {
    if v.is_some_and(|v| v.trim() == "0") {
        0
    } else {
        2
    }
}

/// Blocks a multiprocessor must hold for the streaming kernels (prelude.cu `OCC`), from
/// `DRAMATIS_CUDA_OCC` (0, 1 or 2; 1 when unset or out of range; 0 names no minimum, the
/// bounds before eedfd09). Read once per process.
pub fn occupancy() -> u32 {
    static OCC: std::sync::OnceLock<u32> = std::sync::OnceLock::new();
    *OCC.get_or_init(|| occupancy_from(std::env::var("DRAMATIS_CUDA_OCC").ok().as_deref()))
}

/// The `OCC` setting from `DRAMATIS_CUDA_OCC`'s value: 0, 1 or 2 (at 4 the expert kernels would
/// be held to 32 registers, and from 5 on the blocks asked for pass a multiprocessor's threads).
pub fn occupancy_from(v: Option<&str>) -> u32 {
    v.and_then(|v| v.trim().parse::<u32>().ok())
        .filter(|n| (0..=2).contains(n))
        .unwrap_or(1)
}

/// sha256 over source, options, architecture and NVRTC version, hex encoded.
pub fn cache_key(source: &str, options: &[String], arch: &str, nvrtc: (i32, i32)) -> String {
    let mut h = Sha256::new();
    h.update(source.as_bytes());
    for o in options {
        h.update([0u8]);
        h.update(o.as_bytes());
    }
    h.update([1u8]);
    h.update(arch.as_bytes());
    h.update(format!("nvrtc {}.{}", nvrtc.0, nvrtc.1).as_bytes());
    hex::encode(h.finalize())
}

/// `$XDG_CACHE_HOME/dramatis/kernels`, else `~/.cache/dramatis/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    let base = std::env::var_os("XDG_CACHE_HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("dramatis").join("kernels"))
}

/// Compiles one source variant to PTX, reading and filling the disk cache.
/// Returns the PTX and whether it came from the cache.
pub fn compile_cached(source: Source, variant: Variant, arch: &str) -> Result<(String, bool)> {
    let text = source.text();
    let options = compile_options(arch, variant);
    let key = cache_key(&text, &options, arch, nvrtc_version()?);
    let path = cache_dir().map(|d| d.join(format!("{key}.ptx")));
    if let Some(p) = &path {
        if let Ok(ptx) = std::fs::read_to_string(p) {
            return Ok((ptx, true));
        }
    }
    let opts = cudarc::nvrtc::CompileOptions {
        options: options.clone(),
        name: Some(source.name().to_string()),
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(&text, opts)
        .map_err(|e| CudaError::Compile {
            source_name: source.name(),
            options: options.join(" "),
            log: match e {
                cudarc::nvrtc::CompileError::CompileError { log, .. } => {
                    log.to_string_lossy().into_owned()
                }
                other => format!("{other:?}"),
            },
        })?
        .to_src();
    if let Some(p) = &path {
        // A cache that cannot be written only costs a recompile next time.
        let _ = write_atomic(p, &ptx);
    }
    Ok((ptx, false))
}

fn write_atomic(path: &std::path::Path, text: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(tmp, path)
}

/// Limits and identity of the device, read once.
#[derive(Clone, Debug)]
pub struct DeviceInfo {
    pub name: String,
    pub compute_capability: (i32, i32),
    pub sm_count: i32,
    pub max_grid: [u64; 3],
    pub max_block_threads: u64,
    pub max_smem_block: u64,
    pub max_smem_optin: u64,
    pub l2_bytes: i64,
    pub total_mem: usize,
    pub cuda_driver_version: i32,
}

impl DeviceInfo {
    /// Hopper (H200) limits, for launch records made without a device.
    pub fn h200_nominal() -> Self {
        DeviceInfo {
            name: "NVIDIA H200 (nominal limits)".into(),
            compute_capability: (9, 0),
            sm_count: 132,
            max_grid: [(1 << 31) - 1, 65535, 65535],
            max_block_threads: 1024,
            max_smem_block: 48 * 1024,
            max_smem_optin: 227 * 1024,
            l2_bytes: 60 * 1024 * 1024,
            total_mem: 143_771 * 1024 * 1024,
            cuda_driver_version: 13000,
        }
    }
}

/// One device, one stream, and the kernels compiled for it.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub info: DeviceInfo,
    pub arch: String,
    modules: Mutex<HashMap<(Source, Variant), Arc<CudaModule>>>,
    /// Keyed by the kernel's static name: a lookup per launch allocates nothing.
    funcs: Mutex<HashMap<(Source, Variant, &'static str), CudaFunction>>,
    /// Kernel builds compiled now versus read from the disk cache.
    pub compile_stats: Mutex<(usize, usize)>,
}

/// The scheduling priority of a [`Gpu`]'s stream. The model's frame rounds take the device's
/// greatest priority, so that when the codec's kernels (on their own stream, default priority)
/// wait for room at the same time, the block scheduler starts the round's blocks first.
/// `DRAMATIS_CUDA_STREAM_PRIORITY=0` gives the model's stream the default priority too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamPriority {
    /// The device's least priority (the driver's default).
    Default,
    /// The device's greatest priority (unless `DRAMATIS_CUDA_STREAM_PRIORITY=0`).
    Model,
}

/// Whether the model's stream takes the greatest priority: read once per process.
pub fn model_priority_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        std::env::var("DRAMATIS_CUDA_STREAM_PRIORITY").map_or(true, |v| v.trim() != "0")
    })
}

impl Gpu {
    /// Opens device `ordinal` with a stream of the default priority; a clear error, never a
    /// panic, without a driver or NVRTC.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_priority(ordinal, StreamPriority::Default)
    }

    /// Opens device `ordinal` with a stream of priority `p`.
    pub fn with_priority(ordinal: usize, p: StreamPriority) -> Result<Self> {
        use cudarc::driver::sys::CUdevice_attribute as A;
        if !driver_present() {
            return Err(CudaError::NoDriver);
        }
        if !nvrtc_present() {
            return Err(CudaError::NoNvrtc);
        }
        let count = CudaContext::device_count()?;
        if usize::try_from(count).map_or(true, |c| ordinal >= c) {
            return Err(CudaError::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let name = ctx.name()?;
        if (major, minor) < (8, 9) {
            return Err(CudaError::Arch { name, major, minor });
        }
        let attr = |a| -> Result<u64> { Ok(u64::try_from(ctx.attribute(a)?).unwrap_or(0)) };
        let mut drv = 0;
        // SAFETY: the driver is loaded (context created); the pointer is a live local.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut drv) };
        let info = DeviceInfo {
            name,
            compute_capability: (major, minor),
            sm_count: ctx.attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?,
            max_grid: [
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X)?,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y)?,
                attr(A::CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z)?,
            ],
            max_block_threads: attr(A::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            max_smem_block: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK)?,
            max_smem_optin: attr(A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?,
            l2_bytes: i64::from(ctx.attribute(A::CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE)?),
            total_mem: ctx.total_mem()?,
            cuda_driver_version: drv,
        };
        // SAFETY: all of this backend's work is ordered on the one stream below, so cudarc's
        // per-buffer event tracking (several driver calls per launch argument) is not needed.
        unsafe { ctx.disable_event_tracking() };
        // a created stream, not the legacy default one, so that frame rounds can be captured
        let stream = match p {
            StreamPriority::Model if model_priority_on() => {
                ctx.bind_to_thread()?;
                let (_least, greatest) = cudarc::driver::result::stream::get_priority_range()?;
                ctx.new_stream_with_priority(greatest)?
            }
            _ => ctx.new_stream()?,
        };
        Ok(Gpu {
            arch: arch_for(major, minor),
            ctx,
            stream,
            info,
            modules: Mutex::new(HashMap::new()),
            funcs: Mutex::new(HashMap::new()),
            compile_stats: Mutex::new((0, 0)),
        })
    }

    /// Compiles every (source, variant) pair not yet loaded, NVRTC runs side by side on their own
    /// threads (it needs no context), then loads the modules here. A fresh machine's first
    /// contract compiled 7 sources x 3 builds one after another, several minutes on the H200 host.
    /// Returns how many pairs were compiled or read from the disk cache.
    pub fn precompile(&self, sources: &[Source], variants: &[Variant]) -> Result<usize> {
        let todo: Vec<(Source, Variant)> = {
            let mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            sources
                .iter()
                .flat_map(|&s| variants.iter().map(move |&v| (s, v)))
                .filter(|k| !mods.contains_key(k))
                .collect()
        };
        let arch = self.arch.as_str();
        let built: Vec<Result<(String, bool)>> = std::thread::scope(|sc| {
            let handles: Vec<_> = todo
                .iter()
                .map(|&(s, v)| sc.spawn(move || compile_cached(s, v, arch)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CudaError::Io(std::io::Error::other(
                            "an NVRTC compile thread panicked",
                        )))
                    })
                })
                .collect()
        });
        let mut mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        for (key, r) in todo.iter().zip(built) {
            let (ptx, hit) = r?;
            mods.insert(*key, self.load_built(ptx, hit)?);
        }
        Ok(todo.len())
    }

    /// Loads a compiled source variant into the context, counting it as compiled or cached.
    fn load_built(&self, ptx: String, hit: bool) -> Result<Arc<cudarc::driver::CudaModule>> {
        {
            let mut st = self.compile_stats.lock().unwrap_or_else(|p| p.into_inner());
            if hit {
                st.1 += 1
            } else {
                st.0 += 1
            }
        }
        Ok(self.ctx.load_module(cudarc::nvrtc::Ptx::from_src(ptx))?)
    }

    /// The named kernel of a source variant, compiling (or reading the cache) on first use.
    pub fn func(
        &self,
        source: Source,
        variant: Variant,
        name: &'static str,
    ) -> Result<CudaFunction> {
        let key = (source, variant, name);
        if let Some(f) = self
            .funcs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(f.clone());
        }
        let mut mods = self.modules.lock().unwrap_or_else(|p| p.into_inner());
        let module = match mods.get(&(source, variant)) {
            Some(m) => m.clone(),
            None => {
                let (ptx, hit) = compile_cached(source, variant, &self.arch)?;
                let m = self.load_built(ptx, hit)?;
                mods.insert((source, variant), m.clone());
                m
            }
        };
        let f = module.load_function(name)?;
        self.funcs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(key, f.clone());
        Ok(f)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_key_depends_on_every_part() {
        let o = compile_options_with("compute_90a", Variant::Exact, false, 1, 2, 3);
        let base = cache_key("src", &o, "compute_90a", (13, 0));
        assert_eq!(base.len(), 64);
        assert_eq!(base, cache_key("src", &o, "compute_90a", (13, 0)));
        assert_ne!(base, cache_key("src2", &o, "compute_90a", (13, 0)));
        assert_ne!(base, cache_key("src", &o, "compute_89", (13, 0)));
        assert_ne!(base, cache_key("src", &o, "compute_90a", (13, 1)));
        let p = compile_options_with("compute_90a", Variant::Planted, false, 1, 2, 3);
        assert_ne!(base, cache_key("src", &p, "compute_90a", (13, 0)));
        // options are separated, so moving a byte across the boundary changes the key
        assert_ne!(
            cache_key("a", &["bc".into()], "x", (1, 0)),
            cache_key("ab", &["c".into()], "x", (1, 0))
        );
    }

    #[test]
    fn arch_and_variant_options() {
        assert_eq!(arch_for(9, 0), "compute_90a");
        assert_eq!(arch_for(8, 9), "compute_89");
        let opts = |v| compile_options_with("compute_90a", v, false, 1, 2, 3);
        assert!(opts(Variant::Planted).contains(&"-DPLANT=1".into()));
        assert!(opts(Variant::LowPrecision).contains(&"-DLOWP=1".into()));
        assert!(!opts(Variant::Exact).iter().any(|o| o.starts_with("-D")));
        assert!(
            compile_options_with("compute_90a", Variant::Exact, true, 1, 2, 3)
                .contains(&"-DDRAMATIS_PDL=1".into())
        );
        assert!(
            compile_options_with("compute_90a", Variant::Exact, false, 2, 2, 3)
                .contains(&"-DOCC=2".into())
        );
        assert!(
            compile_options_with("compute_90a", Variant::Exact, false, 1, 0, 3)
                .contains(&"-DTT_OCC=0".into())
        );
        assert!(
            compile_options_with("compute_90a", Variant::Exact, false, 1, 2, 2)
                .contains(&"-DTS_ST=2".into())
        );
        assert_eq!(tile_occupancy_from(None), 2);
        assert_eq!(tile_occupancy_from(Some(" 0 ")), 0);
        assert_eq!(tile_occupancy_from(Some("1")), 2);
        assert_eq!(split_stages_from(None), 3);
        assert_eq!(split_stages_from(Some(" 2 ")), 2);
        assert_eq!(split_stages_from(Some("4")), 3);
    }

    #[test]
    fn pdl_is_on_unless_set_to_zero() {
        assert!(pdl_from(None) && pdl_from(Some("1")) && pdl_from(Some("")));
        assert!(!pdl_from(Some("0")) && !pdl_from(Some(" 0 ")));
    }

    #[test]
    fn pdl_waits_open_every_kernel() {
        let body = "extern \"C\" __global__ void a(int x) { x++; }\n// note\n\
                    #define K(N) extern \"C\" __global__ void N(\\\n int y) { \\\n y++; }\n\
                    __device__ void helper() { }\n";
        let out = with_pdl_waits(body);
        assert_eq!(out.matches("PDL_WAIT();").count(), 2);
        assert!(out.contains("void a(int x) { PDL_WAIT(); x++; }"));
        assert!(out.contains("int y) { PDL_WAIT(); \\"));
        assert!(out.contains("void helper() { }"));
        for s in Source::ALL {
            let kernels = s.body().matches("extern \"C\" __global__").count();
            assert!(kernels > 0, "{}", s.name());
            assert_eq!(
                s.text().matches("PDL_WAIT();").count(),
                kernels,
                "{}",
                s.name()
            );
        }
        assert!(arch_has_pdl("compute_90a") && arch_has_pdl("compute_100"));
        assert!(!arch_has_pdl("compute_89") && !arch_has_pdl("bogus"));
    }

    /// Compiles every kernel variant when NVRTC can be opened (CI: pip-installed libnvrtc);
    /// otherwise says it was skipped. The exact builds compile with the dependent-launch wait
    /// (`DRAMATIS_PDL`) too.
    #[test]
    fn every_kernel_compiles_with_nvrtc() {
        if !nvrtc_present() {
            // scripts/test.sh sets this once it has NVRTC: then a missing library is a failure.
            assert!(
                std::env::var_os("DRAMATIS_REQUIRE_NVRTC").is_none(),
                "DRAMATIS_REQUIRE_NVRTC is set but libnvrtc.so.13 cannot be opened"
            );
            eprintln!("skipped: NVRTC not present (set LD_LIBRARY_PATH to a libnvrtc.so.13)");
            return;
        }
        // every build on its own thread, as Gpu::precompile does (NVRTC is thread-safe)
        std::thread::scope(|sc| {
            let runs: Vec<_> = Source::ALL
                .iter()
                .flat_map(|&s| {
                    Variant::ALL.iter().map(move |&v| (s, v, false)).chain([(
                        s,
                        Variant::Exact,
                        true,
                    )])
                })
                .map(|(s, v, pdl)| {
                    let h = sc.spawn(move || {
                        let opts = cudarc::nvrtc::CompileOptions {
                            // with and without the wait, whatever this process's setting
                            // (the build with it also takes the streaming kernels' OCC 2, the
                            // planted build OCC 0 and the tiles' TT_OCC 0 and two split-tile
                            // buffers, so every bound compiles)
                            options: compile_options_with(
                                "compute_90a",
                                v,
                                pdl,
                                match (pdl, v) {
                                    (true, _) => 2,
                                    (false, Variant::Planted) => 0,
                                    _ => 1,
                                },
                                if v == Variant::Planted { 0 } else { 2 },
                                if v == Variant::Planted { 2 } else { 3 },
                            ),
                            ..Default::default()
                        };
                        cudarc::nvrtc::compile_ptx_with_opts(s.text(), opts).map(|p| p.to_src())
                    });
                    (s, v, pdl, h)
                })
                .collect();
            for (s, v, pdl, h) in runs {
                let r = h.join().expect("an NVRTC compile thread panicked");
                assert!(r.is_ok(), "{} {:?} pdl {pdl}: {:?}", s.name(), v, r.err());
                let ptx = r.unwrap_or_default();
                // DRAMATIS_DUMP_PTX=DIR keeps each build's PTX there, to read what NVVM made
                if let Some(dir) = std::env::var_os("DRAMATIS_DUMP_PTX") {
                    let f = std::path::Path::new(&dir).join(format!(
                        "{}-{v:?}-pdl{}.ptx",
                        s.name(),
                        u8::from(pdl)
                    ));
                    std::fs::write(f, &ptx).expect("PTX written");
                }
                // the wait is in the PDL build's code and nowhere else
                assert_eq!(
                    ptx.contains("griddepcontrol.wait"),
                    pdl,
                    "{} {:?}",
                    s.name(),
                    v
                );
            }
        });
    }

    #[test]
    fn occupancy_setting_is_bounded() {
        assert_eq!(occupancy_from(None), 1);
        assert_eq!(occupancy_from(Some("2")), 2);
        assert_eq!(occupancy_from(Some(" 2 ")), 2);
        assert_eq!(occupancy_from(Some("4")), 1);
        assert_eq!(occupancy_from(Some("0")), 0);
        assert_eq!(occupancy_from(Some("9")), 1);
        assert_eq!(occupancy_from(Some("x")), 1);
    }

    #[test]
    fn gpu_new_errors_cleanly_without_driver() {
        if driver_present() {
            eprintln!("skipped: a CUDA driver is present");
            return;
        }
        assert!(matches!(Gpu::new(0), Err(CudaError::NoDriver)));
    }
}
