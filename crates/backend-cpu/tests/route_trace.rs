//! The router trace (`DRAMATIS_TRACE_ROUTES`): one line per routed call, the prompt's rows in
//! the prefill's calls, and frames unchanged by tracing (rounds then go through the host).
//! Its own test binary: the variable is process-wide.

use backend_cpu::CpuBackend;
use checkpoint::{Checkpoint, Store};
use model::{LaneStep, Model, Row, SamplingParams};
use std::path::{Path, PathBuf};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
}

fn frames(m: &Model<CpuBackend>, rows: &[Row], n: u64) -> Vec<model::FrameOut> {
    let mut lane = m.new_lane(rows.len() + n as usize + 1).unwrap();
    m.prefill(&mut lane, rows).unwrap();
    let params = SamplingParams {
        temperature: 1.0,
        top_k: 30,
        top_p: 0.9,
        ras: true,
    };
    (0..n)
        .map(|step| {
            let s = LaneStep {
                params,
                seed: 5,
                step,
            };
            m.step_frames(&mut [&mut lane], &[s], None, None).unwrap()[0]
        })
        .collect()
}

#[test]
fn every_routed_call_is_traced_and_frames_do_not_change() {
    let store = Store::open_file(&fixture().join("golden/golden.safetensors")).unwrap();
    let v = store.get("prompt_rows").unwrap().to_i64();
    let rows: Vec<Row> = v.chunks_exact(11).map(|c| c.try_into().unwrap()).collect();
    let ck = Checkpoint::open(&fixture()).unwrap();
    let plain = frames(&Model::load(&ck, CpuBackend::new()).unwrap(), &rows, 3);

    let dir = std::env::temp_dir().join(format!("dramatis-route-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("routes");
    std::env::set_var("DRAMATIS_TRACE_ROUTES", &base);
    let m = Model::load(&ck, CpuBackend::new()).unwrap();
    let traced = frames(&m, &rows, 3);
    std::env::remove_var("DRAMATIS_TRACE_ROUTES");
    assert_eq!(traced, plain);
    drop(m);
    let text = std::fs::read_to_string(dir.join("routes.cpu")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    let layers = ck.config.text_config.num_hidden_layers;
    // the prefill's calls, then one per layer per frame
    assert_eq!(lines.len(), layers * 4, "{} lines", lines.len());
    let first: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(first["call"], 0);
    let k = ck.config.text_config.num_experts_per_tok;
    assert_eq!(first["k"], k);
    let top = first["top"].as_array().unwrap();
    assert_eq!(top.len(), rows.len());
    assert!(top.iter().all(|t| t.as_array().unwrap().len() == k + 1));
    assert!(first["gap"]
        .as_array()
        .unwrap()
        .iter()
        .all(|g| g.as_f64().unwrap() >= 0.0));
    // each row's k + 1 experts are distinct ids of the layer's table, and its gaps are real
    // logit differences (random weights: not all ties)
    let e = ck.config.text_config.num_experts;
    for t in top {
        let mut ids: Vec<u64> = t
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert!(ids.iter().all(|&i| (i as usize) < e), "{ids:?}");
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), k + 1);
    }
    assert!(first["gap"]
        .as_array()
        .unwrap()
        .iter()
        .any(|g| g.as_f64().unwrap() > 0.0));
    let last: serde_json::Value = serde_json::from_str(lines[lines.len() - 1]).unwrap();
    assert_eq!(last["top"].as_array().unwrap().len(), 1);
    std::fs::remove_dir_all(&dir).ok();
}
