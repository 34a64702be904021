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
                     "evidence": ["bench/cuda-contract-2026-11-30-s8.log", "bench/cuda-contract-partial-2-2026-11-30-s8.log",
                                  "bench/cuda-golden-tiny-final-2026-11-30-s8.log", "bench/cuda-call4-summary-2026-11-30-s8.txt",
                                  "bench/cuda-drama3-2026-11-30-s8-final.json", "bench/cuda-drama3-parity-2026-11-30-s8.json",
                                  "bench/cuda-gemvbench-2026-11-30-s8.md", "bench/cuda-nvfp4-tiny-parity-2026-11-29.json"],
                     "decode": "BF16 linears on tensor cores (TF32, activations split hi + lo; 256 keys per warp, gemv_tc2; DRAMATIS_CUDA_GEMV_KC=0 for session 7's 512 keys per warp, DRAMATIS_CUDA_TC=0 for the FMA GEMV); norms, gates and elementwise products fused into neighbouring kernels with the same bits; split-key decode attention with head groups split over blocks (DRAMATIS_CUDA_HEAD_SPLIT=0 to turn off)",
                     "frame_round": "kept on the device, guided (CFG) rounds too: draws on the GPU with the CPU's counters and arithmetic, one download per round, recorded once per lane set as a CUDA graph and replayed; finished lanes stay as ghost slots so the rest keep replaying (DRAMATIS_CUDA_ROUNDS=host, DRAMATIS_CUDA_GRAPH=0 to compare)",
                     "prefill": "tiled causal attention (flash-style); the Gated DeltaNet in 64-row chunks for a lane's call of 512 rows or more (DRAMATIS_CUDA_GDN_CHUNK_MIN), else the per-row recurrence; prompts of joining lanes prefilled together with each lane's solo bits; tiled FMA GEMM and FP8 experts grouped by expert from 512 rows (DRAMATIS_CUDA_GEMM_LT=1: cuBLASLt BF16 for the dense part, off: it fails 6 of 31 goldens when forced onto short prompts)",
                     "codec": "GPU streaming decoder and reference encoder",
                     "memory": "the plan's device state (KV pool, lane state, scratch, codec state, caches) is reserved at start-up",
                     "not_yet": ["tensor-core GEMMs for the routed FP8 experts at every row count (batch-invariant)", "a one-lane frame in far fewer kernels (about 760 after session 8's fusions)"]},
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
            "classifier_free_guidance": {"backends": ["cpu", "cuda (guided rounds kept on the device; checked against host-drawn guided rounds through the CPU backend's round ops, not yet on a device)"],
                                         "evidence": ["crates/speech/tests/cfg.rs", "dramatis golden testdata/drama3-tiny: kept rounds = host rounds (guided, sampled)"]},
            "reference_prefill_cache": {"evidence": "crates/speech/tests/prompt_cache.rs"},
            "voice_cloning": {"codec_encoder": {"cpu": "golden codes exact (dramatis golden testdata/drama3-tiny)",
                                               "cuda": "GPU encoder: its host executor gives the CPU's and the golden codes (cargo test -p codec-cuda); not yet run on a device"}},
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
