//! `dramatis capabilities`: what this build can do, and what was qualified (with receipts).

use serde_json::{json, Value};

pub fn capabilities() -> Value {
    let limits = admission::Limits::default();
    json!({
        "name": "dramatis",
        "version": env!("CARGO_PKG_VERSION"),
        "commit": env!("DRAMATIS_GIT"),
        "backends": {
            "cpu": {"compiled": true, "activations": "f32", "kv": "f32"},
            "cuda": {"compiled": cfg!(feature = "cuda"), "engine": cfg!(feature = "cuda"), "kv": "f32 (DRAMATIS_CUDA_KV=bf16 opt-in)",
                     "evidence": ["bench/cuda-contract-2026-11-29-session4.log", "bench/cuda-drama3-parity-tc-2026-11-29.json",
                                  "bench/cuda-drama3-lanes-tc-2026-11-29.json", "bench/cuda-drama3-ttfa-cached-tc-2026-11-29.json",
                                  "bench/cuda-golden-tiny-tc-2026-11-29.log", "bench/cuda-nvfp4-tiny-parity-2026-11-29.json"],
                     "decode": "BF16 linears on tensor cores (TF32, activations split hi + lo; DRAMATIS_CUDA_TC=0 for the FMA GEMV); split-key decode attention",
                     "prefill": "tiled causal attention (flash-style); tiled GEMM and experts grouped by expert from 512 rows",
                     "codec": "GPU streaming decoder (bench/cuda-codec-2026-11-29.json)",
                     "not_yet": ["CUDA graphs per frame round", "sampling on the GPU", "tensor-core GEMMs from 512 rows (the tiled prefill GEMM is FMA)", "codec encoder on the GPU"]},
            "metal": {"compiled": false, "note": "planned"}
        },
        "checkpoint": {
            "model_type": "fish_omni",
            "prompt_template": "reference-bracket-v1",
            "expert_formats_loaded": {"cpu": ["fp8-block128", "nvfp4-pruned"], "cuda": ["fp8-block128", "nvfp4-pruned"]},
            "dense": ["BF16", "F32 (small tensors)"],
            "codec": "codec.pth (PyTorch zip, weight-norm parametrisations folded at load)"
        },
        "http": {
            "routes": ["POST /v1/audio/speech", "POST /v1/tts", "GET /v1/models", "GET/POST/DELETE /v1/voices",
                       "GET /health", "GET /metrics", "GET /openapi.json"],
            "formats": ["wav", "pcm", "flac"],
            "streaming": ["sse", "audio"]
        },
        "limits": limits,
        "window": {
            "admitted_by_contract": "P + F + 1 <= C <= max_position_embeddings (262144 for Drama 3)",
            "qualified": [
                {"backend": "cpu", "checkpoint": "drama3-tiny golden fixture", "rows": 115, "evidence": "dramatis golden testdata/drama3-tiny"},
                {"backend": "cpu", "checkpoint": "builtin tiny", "rows": 8192, "evidence": "bench/window-cpu-tiny-8192.json"},
                {"backend": "cpu", "checkpoint": "builtin tiny", "rows": 32768, "evidence": "bench/window-cpu-tiny-32768.json"},
                {"backend": "cuda", "checkpoint": "builtin tiny", "rows": 8192, "evidence": "bench/window-cuda-tiny-8192.json"},
                {"backend": "cuda", "checkpoint": "builtin tiny", "rows": 65536, "evidence": "bench/window-cuda-tiny-65536.json"},
                {"backend": "cuda", "checkpoint": "builtin tiny", "rows": 131072, "evidence": "bench/window-cuda-tiny-131072.json"},
                {"backend": "cuda", "checkpoint": "builtin tiny", "rows": 262144, "evidence": "bench/window-cuda-tiny-262144.json"}
            ],
            "not_qualified": [{"backend": "cuda", "checkpoint": "Drama 3 geometry", "rows": 262144,
                               "note": "admitted; the longest Drama 3 prefill measured is 32768 rows (bench/cuda-drama3-lanes-prefill-2026-11-29-final.json)"},
                              {"backend": "cpu", "rows": [131072, 262144], "note": "admitted; CPU attention prefill is O(C^2) without tiling"}]
        },
        "features": {
            "classifier_free_guidance": {"backends": ["cpu", "cuda (same generic frame round; tests run on the CPU)"], "evidence": "crates/speech/tests/cfg.rs"},
            "reference_prefill_cache": {"evidence": "crates/speech/tests/prompt_cache.rs"},
            "voice_cloning": {"codec_encoder": "cpu"},
            "deterministic_replay": "counter-based Philox4x32-10 keyed by (seed, stream, step)"
        },
        "flags": ["--cfg-gamma", "--cfg-batched", "--cfg-force-guided", "--cfg-allow-request-gamma",
                  "--context", "--parallel", "--queue", "--prompt-cache-gib", "--max-unread-audio-seconds", "--max-pause-seconds", "--api-key",
                  "--device-gib", "--host-gib"]
    })
}

pub fn render(c: &Value) -> String {
    serde_json::to_string_pretty(c).unwrap_or_default() + "\n"
}
