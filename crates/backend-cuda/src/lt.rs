//! BF16 GEMMs through cuBLASLt for `Rows::Bulk` linears (`DRAMATIS_CUDA_GEMM_LT=1`): the
//! library's tensor-core kernels, which no hand-written tile here approaches.
//!
//! Activations are f32 and cuBLASLt multiplies like types, so each activation is split
//! `x = hi + lo` into two BF16 values (`hi = bf16(x)`, `lo = bf16(x − hi)`, gemm.cu
//! `split_bf16`): BF16 weights times BF16 values are exact products, and `y = W·hi`, then
//! `y = W·lo + y`, accumulate in f32. The split keeps about 16 bits of each activation (the
//! residual is at most 2^-16 of it, about 2^-18.5 RMS), where casting to BF16 would keep 8.
//!
//! Layout: `y [rows, n]` row-major is `yᵀ [n, rows]` column-major = `W · xᵀ`, with `W [n, k]`
//! row-major read as the column-major `[k, n]` transposed (op T) and `x [rows, k]` row-major as
//! the column-major `[k, rows]` (op N): the "TN" GEMM.

use cudarc::cublaslt::{result as lt, sys};

/// A cuBLASLt handle, the one matmul description every call shares (f32 compute and scale,
/// A transposed) and the search preference with its workspace limit.
pub(crate) struct Lt {
    handle: sys::cublasLtHandle_t,
    desc: sys::cublasLtMatmulDesc_t,
    pref: sys::cublasLtMatmulPreference_t,
    workspace: u64,
    workspace_bytes: usize,
}

// SAFETY: the handle and descriptors are only used under the backend's `lt` mutex, one call at a
// time, on the backend's stream.
unsafe impl Send for Lt {}

/// Whether the cuBLASLt library can be opened (never panics without it).
pub(crate) fn present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

fn err(what: &str, e: lt::CublasError) -> String {
    format!("cuBLASLt {what}: {e:?}")
}

/// A matrix layout, destroyed when dropped.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    fn new(ty: sys::cudaDataType, rows: usize, cols: usize, ld: usize) -> Result<Self, String> {
        lt::create_matrix_layout(ty, rows as u64, cols as u64, ld as i64)
            .map(Layout)
            .map_err(|e| err("matrix layout", e))
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by create_matrix_layout and destroyed once.
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

impl Lt {
    /// A handle and the shared description; `workspace` (device address, `workspace_bytes`
    /// long) stays owned by the caller for as long as this lives.
    pub(crate) fn new(workspace: u64, workspace_bytes: usize) -> Result<Self, String> {
        if !present() {
            return Err("the cuBLASLt library (libcublasLt) is not present".into());
        }
        let handle = lt::create_handle().map_err(|e| err("handle", e))?;
        let mut me = Lt {
            handle,
            desc: std::ptr::null_mut(),
            pref: std::ptr::null_mut(),
            workspace,
            workspace_bytes,
        };
        me.desc = lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )
        .map_err(|e| err("matmul description", e))?;
        // cublasOperation_t (an i32): CUBLAS_OP_T = 1
        let op_t: i32 = 1;
        // SAFETY: desc is live; the attribute takes one cublasOperation_t.
        unsafe {
            lt::set_matmul_desc_attribute(
                me.desc,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&op_t) as *const i32 as *const _,
                std::mem::size_of::<i32>(),
            )
        }
        .map_err(|e| err("transpose A", e))?;
        me.pref = lt::create_matmul_pref().map_err(|e| err("preference", e))?;
        // SAFETY: pref is live; the attribute takes one u64 (size_t).
        unsafe {
            lt::set_matmul_pref_attribute(
                me.pref,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&me.workspace_bytes) as *const usize as *const _,
                std::mem::size_of::<usize>(),
            )
        }
        .map_err(|e| err("workspace limit", e))?;
        Ok(me)
    }

    /// `y [rows, n] = (hi + lo) [rows, k] · W [n, k]ᵀ` on `stream`: `w` BF16, `hi` and `lo`
    /// BF16, `y` f32 (device addresses).
    ///
    /// # Safety
    /// The addresses must hold those shapes on the device of `stream` and stay live until the
    /// stream has run the two matmuls.
    #[allow(clippy::too_many_arguments)]
    pub(crate) unsafe fn gemm(
        &self,
        w: u64,
        hi: u64,
        lo: u64,
        y: u64,
        n: usize,
        k: usize,
        rows: usize,
        stream: cudarc::driver::sys::CUstream,
    ) -> Result<(), String> {
        let bf16 = sys::cudaDataType_t::CUDA_R_16BF;
        let a = Layout::new(bf16, k, n, k)?;
        let b = Layout::new(bf16, k, rows, k)?;
        let c = Layout::new(sys::cudaDataType_t::CUDA_R_32F, n, rows, n)?;
        let heur =
            lt::get_matmul_algo_heuristic(self.handle, self.desc, a.0, b.0, c.0, c.0, self.pref)
                .map_err(|e| err("algorithm search", e))?;
        if heur.workspaceSize > self.workspace_bytes {
            return Err(format!(
                "cuBLASLt picked an algorithm needing {} workspace bytes of {}",
                heur.workspaceSize, self.workspace_bytes
            ));
        }
        let one = 1.0f32;
        for (x, beta) in [(hi, 0.0f32), (lo, 1.0f32)] {
            lt::matmul(
                self.handle,
                self.desc,
                (&one) as *const f32 as *const _,
                (&beta) as *const f32 as *const _,
                w as *const _,
                a.0,
                x as *const _,
                b.0,
                y as *const _,
                c.0,
                y as *mut _,
                c.0,
                &heur.algo,
                self.workspace as *mut _,
                self.workspace_bytes,
                stream as sys::cudaStream_t,
            )
            .map_err(|e| err("matmul", e))?;
        }
        Ok(())
    }
}

impl Drop for Lt {
    fn drop(&mut self) {
        // SAFETY: each object was created by this struct and is destroyed once; null ones
        // (a construction that failed part way) are skipped.
        unsafe {
            if !self.pref.is_null() {
                let _ = lt::destroy_matmul_pref(self.pref);
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
            let _ = lt::destroy_handle(self.handle);
        }
    }
}
