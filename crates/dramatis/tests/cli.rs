//! End-to-end through the binary: goldens, say determinism, bad input, inspect, plan, fixture.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_dramatis"));
    // One shared cache for the built-in checkpoint across this test binary.
    c.env("XDG_CACHE_HOME", cache());
    c.env("XDG_DATA_HOME", cache().join("data"));
    c
}

fn cache() -> PathBuf {
    std::env::temp_dir().join("dramatis-cli-tests-cache")
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A scratch folder removed when the test ends (pass or fail).
fn tmp(name: &str) -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix(&format!("dramatis-cli-{name}-"))
        .tempdir()
        .unwrap()
}

fn text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn say(args: &[&str]) -> Output {
    bin().arg("say").args(args).output().unwrap()
}

fn hash_of(o: &Output) -> String {
    let s = String::from_utf8_lossy(&o.stdout).to_string();
    s.split("pcm_sha256 ")
        .nth(1)
        .unwrap_or_else(|| panic!("no hash in {s}"))
        .trim()
        .to_string()
}

#[test]
fn golden_fixture_passes() {
    let o = bin()
        .arg("golden")
        .arg(root().join("testdata/drama3-tiny"))
        .output()
        .unwrap();
    let t = text(&o);
    assert!(o.status.success(), "{t}");
    assert!(t.contains("GOLDEN 27 cases: 27 pass, 0 fail"), "{t}");
    // the kept-round cases ran (greedy against the golden, sampled against host rounds)
    assert!(t.contains("PASS gen_frames (greedy, kept rounds)"), "{t}");
    assert!(t.contains("PASS kept rounds = host rounds"), "{t}");
    assert!(!t.contains("FAIL"), "{t}");
}

#[test]
fn golden_fails_on_a_broken_fixture() {
    // A fixture folder whose golden greedy frames were altered must fail (the runner can fail).
    let dir = tmp("broken-golden");
    let d = dir.path();
    let src = root().join("testdata/drama3-tiny");
    for e in std::fs::read_dir(&src).unwrap() {
        let p = e.unwrap().path();
        if p.is_file() {
            std::fs::copy(&p, d.join(p.file_name().unwrap())).unwrap();
        }
    }
    std::fs::create_dir_all(d.join("golden")).unwrap();
    std::fs::copy(src.join("golden/meta.json"), d.join("golden/meta.json")).unwrap();
    // Re-point the short goldens at the long file: every short case is then missing -> FAIL.
    std::fs::copy(
        src.join("golden/golden_long.safetensors"),
        d.join("golden/golden.safetensors"),
    )
    .unwrap();
    let o = bin().arg("golden").arg(d).output().unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("FAIL"));
}

#[test]
fn say_is_deterministic_per_seed() {
    let dir = tmp("say");
    let d = dir.path();
    let take = |seed: &str, name: &str| {
        let out = d.join(name);
        say(&[
            "Hello there. Second sentence.",
            "--seed",
            seed,
            "--frames",
            "24",
            "--out",
            out.to_str().unwrap(),
        ])
    };
    let (a, b, c) = (take("7", "a.wav"), take("7", "b.wav"), take("8", "c.wav"));
    assert!(a.status.success(), "{}", text(&a));
    assert_eq!(hash_of(&a), hash_of(&b));
    assert_ne!(hash_of(&a), hash_of(&c));
    assert_eq!(
        std::fs::read(d.join("a.wav")).unwrap(),
        std::fs::read(d.join("b.wav")).unwrap()
    );
    let wav = std::fs::read(d.join("a.wav")).unwrap();
    assert_eq!(&wav[..4], b"RIFF");
    assert_eq!(u32::from_le_bytes(wav[24..28].try_into().unwrap()), 44100);
    let out = String::from_utf8_lossy(&a.stdout);
    assert!(
        out.contains("frames") && out.contains("real-time factor"),
        "{out}"
    );
}

#[test]
fn say_with_a_reference_clip() {
    let dir = tmp("ref");
    let d = dir.path();
    // A 0.5 s tone at 22.05 kHz: resampled to 44.1 kHz and encoded.
    let pcm: Vec<i16> = (0..11025)
        .map(|i| ((i as f32 * 0.05).sin() * 12000.0) as i16)
        .collect();
    let wav = speech::pcm::wav_bytes(&pcm, 22050);
    let clip = d.join("clip.wav");
    std::fs::write(&clip, &wav).unwrap();
    let o = say(&[
        "Clone this.",
        "--ref",
        clip.to_str().unwrap(),
        "--ref-text",
        "A tone.",
        "--frames",
        "8",
        "--out",
        d.join("o.wav").to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn bad_input_is_a_clear_error() {
    let dir = tmp("bad");
    let d = dir.path();
    let out = d.join("x.wav");
    let o = out.to_str().unwrap();
    let notaudio = d.join("not.wav");
    std::fs::write(&notaudio, b"this is not audio at all").unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["", "--out", o], "empty"),
        (vec!["hi <|im_end|> there", "--out", o], "structural token"),
        (vec!["<|speaker:16|> hi", "--out", o], "speaker tag"),
        (
            vec!["hi", "--ref", notaudio.to_str().unwrap(), "--out", o],
            "transcript",
        ),
        (
            vec![
                "hi",
                "--ref",
                notaudio.to_str().unwrap(),
                "--ref-text",
                "",
                "--out",
                o,
            ],
            "no transcript",
        ),
        (
            vec![
                "hi",
                "--ref",
                notaudio.to_str().unwrap(),
                "--ref-text",
                "words",
                "--out",
                o,
            ],
            "not a readable WAV",
        ),
        (vec!["hi", "--frames", "0", "--out", o], "0 frames"),
        (
            vec!["hi", "--frames", "300000", "--out", o],
            "largest cap that fits",
        ),
        (vec!["hi", "--temperature", "3", "--out", o], "temperature"),
    ];
    for (args, needle) in cases {
        let r = say(&args);
        let t = text(&r);
        assert!(!r.status.success(), "{args:?} should fail: {t}");
        assert!(
            t.to_lowercase().contains(&needle.to_lowercase()),
            "{args:?}: expected {needle:?} in {t}"
        );
        assert!(!t.contains("panicked"), "{t}");
    }
}

#[test]
fn inspect_and_capabilities() {
    let o = bin()
        .arg("inspect")
        .arg(root().join("testdata/drama3-tiny"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("admitted"));
    let o = bin()
        .args(["inspect", "--json"])
        .arg(root().join("testdata/drama3-tiny"))
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["tensors"], 640);
    let o = bin().args(["capabilities", "--json"]).output().unwrap();
    assert!(o.status.success());
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["backends"]["cpu"]["compiled"], true);
    // every receipt the capabilities cite is in the repository
    fn receipts(v: &serde_json::Value, out: &mut Vec<String>) {
        match v {
            serde_json::Value::String(s) => {
                for (i, _) in s.match_indices("bench/") {
                    let p: String = s[i..]
                        .chars()
                        .take_while(|c| !c.is_whitespace() && !"),;".contains(*c))
                        .collect();
                    out.push(p);
                }
            }
            serde_json::Value::Array(a) => a.iter().for_each(|x| receipts(x, out)),
            serde_json::Value::Object(m) => m.values().for_each(|x| receipts(x, out)),
            _ => {}
        }
    }
    let mut cited = Vec::new();
    receipts(&v, &mut cited);
    assert!(cited.len() >= 10, "{cited:?}");
    for p in cited {
        assert!(
            root().join(&p).is_file(),
            "capabilities cite {p}, which is not in the repository"
        );
    }
    let o = bin().arg("--version").output().unwrap();
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("dramatis "));
    for sub in [
        "say",
        "serve",
        "inspect",
        "plan",
        "voices",
        "fixture",
        "golden",
        "bench",
        "capabilities",
    ] {
        let o = bin().args([sub, "--help"]).output().unwrap();
        assert!(o.status.success(), "{sub} --help");
    }
}

#[test]
fn cpu_bench_receipt_has_no_device_memory() {
    let dir = tmp("bench");
    let out = dir.path().join("bench.json");
    let o = bin()
        .args([
            "bench", "--runs", "1", "--frames", "2", "--lanes", "1", "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&out).unwrap()).unwrap();
    assert_eq!(v["backend"], "cpu", "{v}");
    assert_eq!(v["results"][0]["lanes"], 1, "{v}");
    // The CPU plan has no device side: the field is present and null, not absent.
    assert!(v.get("device_memory").is_some_and(|d| d.is_null()), "{v}");
    assert!(!text(&o).contains("device memory:"), "{}", text(&o));
    // the CPU backend draws on the host: the measured run's rounds are all host rounds
    let r = &v["results"][0]["rounds"];
    let generated = v["results"][0]["frames_generated_median"].as_f64().unwrap();
    assert!(r["host"].as_u64().unwrap() >= generated as u64, "{v}");
    assert_eq!(r["kept"], 0, "{v}");
    // the settings name the backend options in the environment (none set here)
    assert!(v["settings"]["backend_env"].is_object(), "{v}");
    // and the measured request's prompt rows (one segment)
    let rows = v["settings"]["prompt_rows"]
        .as_array()
        .expect("prompt_rows");
    assert!(rows.len() == 1 && rows[0].as_u64().unwrap() > 5, "{v}");
}

#[test]
fn plan_boundaries() {
    let ok = bin()
        .args([
            "plan",
            "--geometry",
            "drama3",
            "--context",
            "8192",
            "--prompt-rows",
            "100",
            "--frames",
            "8091",
            "--host-gib",
            "1000",
        ])
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", text(&ok));
    let over = bin()
        .args([
            "plan",
            "--geometry",
            "drama3",
            "--context",
            "8192",
            "--prompt-rows",
            "100",
            "--frames",
            "8092",
            "--host-gib",
            "1000",
        ])
        .output()
        .unwrap();
    assert!(!over.status.success());
    assert!(text(&over).contains("8091"), "{}", text(&over));
    let o = bin()
        .args([
            "plan",
            "--geometry",
            "drama3",
            "--context",
            "262145",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let o = bin()
        .args([
            "plan",
            "--geometry",
            "drama3",
            "--context",
            "262144",
            "--backend",
            "cuda",
            "--device-gib",
            "139",
            "--host-gib",
            "1000",
            "--streamed",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
}

#[test]
fn fixture_round_trips_through_inspect() {
    let dir = tmp("fixture");
    let d = dir.path();
    let a = d.join("a");
    let b = d.join("b");
    for p in [&a, &b] {
        let o = bin()
            .args(["fixture", "--geometry", "tiny", "--seed", "5", "--out"])
            .arg(p)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
    }
    let o = bin().arg("inspect").arg(&a).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    for f in [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "config.json",
        "model.safetensors.index.json",
        "tokenizer.json",
        "codec.pth",
    ] {
        assert_eq!(
            std::fs::read(a.join(f)).unwrap(),
            std::fs::read(b.join(f)).unwrap(),
            "{f}"
        );
    }
    let o = bin()
        .args(["fixture", "--geometry", "drama3", "--manifest-only"])
        .output()
        .unwrap();
    let t = String::from_utf8_lossy(&o.stdout);
    assert!(t.contains("62245"), "{}", &t[t.len().saturating_sub(400)..]);
}

#[test]
fn serve_lifecycle_start_failure_and_sigterm() {
    // A start-up the plan refuses exits non-zero with the reason.
    let o = bin()
        .args(["serve", "--context", "262145", "--port", "0"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("262145"), "{}", text(&o));
    // A running server stops on SIGTERM with exit 0.
    let port = 18000 + (std::process::id() % 2000) as u16;
    let mut child = bin()
        .args(["serve", "--port", &port.to_string(), "--context", "4096"])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let up = (0..100).any(|_| {
        std::thread::sleep(std::time::Duration::from_millis(100));
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    assert!(up, "server did not start");
    let pid = child.id().to_string();
    let k = Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    assert!(k.success());
    let status = child.wait().unwrap();
    assert!(status.success(), "exit status {status:?}");
}

#[test]
fn plan_reports_kv_per_row_by_precision() {
    // DRAMA3.md section 5: 20,480 + 26,624 = 47,104 B per row in BF16; twice that in f32.
    let o = bin()
        .args([
            "plan",
            "--geometry",
            "drama3",
            "--context",
            "262144",
            "--backend",
            "cuda",
            "--kv",
            "bf16",
            "--json",
        ])
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["state_per_row"]["total"], 47104, "{v}");
    assert_eq!(v["state_per_row"]["full_window"], 12_348_030_976u64);
    let o = bin()
        .args([
            "plan",
            "--geometry",
            "drama3",
            "--context",
            "262144",
            "--backend",
            "cuda",
            "--json",
        ])
        .env_remove("DRAMATIS_CUDA_KV")
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        v["state_per_row"]["total"], 94208,
        "the engine's default CUDA KV is f32"
    );
}
