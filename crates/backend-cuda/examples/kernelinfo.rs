//! `kernelinfo [--out FILE.json] [NAME-SUBSTRING ...]`: what the compiler made of each kernel of
//! every source (the real build) for this device: registers a thread, local memory a thread
//! (spills), static shared memory, the most threads a block, and how many blocks of 128, 256,
//! 512 and 1024 threads fit on one multiprocessor. NVRTC gives no `-Xptxas -v`; the driver's
//! function attributes are the same figures.

use backend_cuda::runtime::{Gpu, Source, Variant};
use cudarc::driver::sys::CUfunction_attribute_enum as A;
use serde_json::json;

/// The names of the `extern "C" __global__` functions of a source text.
fn kernel_names(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(i) = rest.find("extern \"C\" __global__") {
        rest = &rest[i + 22..];
        // past `__launch_bounds__(...)`, whose parenthesis is not the parameter list's
        let mut from = 0;
        if let Some(lb) = rest.find("__launch_bounds__(") {
            if rest[..lb].find('(').is_none() {
                from = rest[lb..].find(')').map_or(0, |c| lb + c + 1);
            }
        }
        if let Some(paren) = rest[from..].find('(').map(|p| from + p) {
            let head = &rest[from..paren];
            if let Some(name) = head.split_whitespace().last() {
                // a macro body's `name##G##_v##V` is not a kernel name
                if name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
                    out.push(name.to_string());
                }
            }
        }
    }
    out
}

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut out = None;
    let mut filters = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--out" {
            out = it.next().cloned();
        } else {
            filters.push(a.clone());
        }
    }
    let gpu = Gpu::new(0).map_err(|e| e.to_string())?;
    gpu.precompile(&Source::ALL, &[Variant::Exact])
        .map_err(|e| e.to_string())?;
    let mut rec = Vec::new();
    println!("| source | kernel | regs | local B | static smem B | max threads | blocks/SM at 128 / 256 / 512 / 1024 |");
    println!("| --- | --- | ---: | ---: | ---: | ---: | --- |");
    for src in Source::ALL {
        // macro-made kernels (gemv_tc2_*) are named in the text only after expansion: list the
        // names the backend launches too
        let mut names = kernel_names(&src.text());
        if src == Source::Gemv {
            for g in [1, 4] {
                for v in [1, 2] {
                    for k in [
                        "gemv_tc2",
                        "gemv_tc2_multi",
                        "gemv_tc2_silu",
                        "gemv_tc2_sigm",
                    ] {
                        names.push(format!("{k}_g{g}_v{v}"));
                    }
                }
            }
        }
        for name in names {
            if !filters.is_empty() && !filters.iter().any(|f| name.contains(f.as_str())) {
                continue;
            }
            let name: &'static str = Box::leak(name.into_boxed_str());
            let Ok(f) = gpu.func(src, Variant::Exact, name) else {
                continue;
            };
            let at = |a| f.get_attribute(a).unwrap_or(-1);
            let (regs, local, smem, maxt) = (
                at(A::CU_FUNC_ATTRIBUTE_NUM_REGS),
                at(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES),
                at(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES),
                at(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK),
            );
            let occ: Vec<i64> = [128u32, 256, 512, 1024]
                .iter()
                .map(|&b| {
                    if b as i32 > maxt {
                        0
                    } else {
                        f.occupancy_max_active_blocks_per_multiprocessor(b, 0, None)
                            .map_or(-1, i64::from)
                    }
                })
                .collect();
            println!(
                "| {} | {name} | {regs} | {local} | {smem} | {maxt} | {} |",
                src.name(),
                occ.iter()
                    .map(|o| o.to_string())
                    .collect::<Vec<_>>()
                    .join(" / ")
            );
            rec.push(json!({"source": src.name(), "kernel": name, "regs": regs,
                "local_bytes": local, "static_smem_bytes": smem, "max_threads": maxt,
                "blocks_per_sm_at_128_256_512_1024": occ}));
        }
    }
    if let Some(p) = out {
        let doc = json!({"gpu": gpu.info.name, "arch": gpu.arch, "kernels": rec});
        std::fs::write(
            &p,
            serde_json::to_string_pretty(&doc).map_err(|e| e.to_string())?,
        )
        .map_err(|e| e.to_string())?;
    }
    Ok(())
}
