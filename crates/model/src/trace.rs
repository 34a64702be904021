//! The router trace (`DRAMATIS_TRACE_ROUTES=PATH`): for every routed call, each row's top k + 1
//! experts by router logit and the gap between the k-th and the (k + 1)-th, one JSON line per
//! call in `PATH.<backend>`. Two backends that disagree on a routing part at a near-tie; their
//! traces, compared call by call (`scripts/compare-routes.py`), say where and by how much.

use std::io::Write;

/// An open trace: the file and the number of calls written.
pub(crate) struct RouteTrace {
    out: std::sync::Mutex<(std::io::BufWriter<std::fs::File>, u64)>,
}

impl RouteTrace {
    /// The trace `DRAMATIS_TRACE_ROUTES` asks for, in `PATH.<backend>`; none when unset (or
    /// when the file cannot be made: that is logged, the model runs on untraced).
    pub(crate) fn from_env(backend: &str) -> Option<Self> {
        let base = std::env::var_os("DRAMATIS_TRACE_ROUTES")?;
        Self::open(&base.to_string_lossy(), backend)
    }

    /// The trace in `BASE.<backend>`, or `BASE.<backend>.<n>` for the n-th model (n >= 2) of
    /// this process on that backend, so that a second model (bench's prefill section, a
    /// parity run's second backend of one kind) does not truncate the first one's trace.
    fn open(base: &str, backend: &str) -> Option<Self> {
        static OPENED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        let first = format!("{base}.{backend}");
        let path = {
            let mut opened = OPENED.lock().unwrap_or_else(|p| p.into_inner());
            let n = opened.iter().filter(|p| **p == first).count();
            opened.push(first.clone());
            if n == 0 {
                first
            } else {
                format!("{first}.{}", n + 1)
            }
        };
        let path = std::path::PathBuf::from(path);
        match std::fs::File::create(&path) {
            Ok(f) => Some(Self {
                out: std::sync::Mutex::new((std::io::BufWriter::new(f), 0)),
            }),
            Err(e) => {
                tracing::warn!("router trace {}: {e}", path.display());
                None
            }
        }
    }

    /// One routed call: `logits` holds `rows` rows of `e` router logits.
    pub(crate) fn record(&self, logits: &[f32], e: usize, k: usize, keep: Option<&[bool]>) {
        let mut g = self.out.lock().unwrap_or_else(|p| p.into_inner());
        let call = g.1;
        g.1 += 1;
        let line = route_line(call, logits, e, k, keep);
        // a full disk ends the trace's usefulness, not the run
        let _ = writeln!(g.0, "{line}").and_then(|()| g.0.flush());
    }
}

/// The JSON line of one call: `{"call":n,"k":k,"top":[[ids]..],"gap":[..]}`, ids by logit
/// (descending, NaN as -inf, ties to the lower index), gap = logit(k-th) - logit((k+1)-th)
/// (null where fewer than k + 1 experts are kept, or where the gap is not finite).
pub(crate) fn route_line(
    call: u64,
    logits: &[f32],
    e: usize,
    k: usize,
    keep: Option<&[bool]>,
) -> String {
    let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    let mut tops = Vec::new();
    let mut gaps = Vec::new();
    for row in logits.chunks(e.max(1)) {
        let mut ids: Vec<usize> = (0..row.len())
            .filter(|&i| keep.is_none_or(|m| m.get(i).copied().unwrap_or(false)))
            .collect();
        ids.sort_by(|&a, &b| key(row[b]).total_cmp(&key(row[a])).then(a.cmp(&b)));
        ids.truncate(k + 1);
        // a gap between infinities is not a number JSON can hold: null, like no gap
        let gap = (ids.len() > k && k > 0).then(|| key(row[ids[k - 1]]) - key(row[ids[k]]));
        gaps.push(match gap {
            Some(g) if g.is_finite() => format!("{g:e}"),
            _ => "null".to_string(),
        });
        tops.push(format!(
            "[{}]",
            ids.iter()
                .map(|i| i.to_string())
                .collect::<Vec<_>>()
                .join(",")
        ));
    }
    format!(
        "{{\"call\":{call},\"k\":{k},\"top\":[{}],\"gap\":[{}]}}",
        tops.join(","),
        gaps.join(",")
    )
}

#[cfg(test)]
mod tests {
    use super::route_line;

    /// A second trace of one backend in a process gets its own file; the first keeps its lines.
    #[test]
    fn a_second_model_does_not_truncate_the_first_trace() {
        let dir = std::env::temp_dir().join(format!("dramatis-trace-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let base = dir.join("rt").to_string_lossy().into_owned();
        let a = super::RouteTrace::open(&base, "cpu").unwrap();
        a.record(&[0.5, 1.0, -1.0], 3, 1, None);
        let b = super::RouteTrace::open(&base, "cpu").unwrap();
        b.record(&[2.0, 1.0, -1.0], 3, 1, None);
        let c = super::RouteTrace::open(&base, "cuda").unwrap();
        drop((a, b, c));
        let first = std::fs::read_to_string(format!("{base}.cpu")).unwrap();
        let second = std::fs::read_to_string(format!("{base}.cpu.2")).unwrap();
        assert_eq!(first.lines().count(), 1);
        assert!(first.contains("\"top\":[[1,0]]"), "{first}");
        assert_eq!(second.lines().count(), 1);
        assert!(second.contains("\"top\":[[0,1]]"), "{second}");
        assert!(std::path::Path::new(&format!("{base}.cuda")).exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn top_k_plus_one_with_ties_nan_and_the_keep_mask() {
        // row 0: 1 and 3 tie at the top (lower index first), NaN last; row 1 by logit
        let logits = [0.5, 2.0, f32::NAN, 2.0, 1.0, 0.0, 3.0, 9.0, 2.5, -1.0];
        let l = route_line(7, &logits, 5, 2, None);
        assert_eq!(
            l,
            "{\"call\":7,\"k\":2,\"top\":[[1,3,4],[2,1,3]],\"gap\":[1e0,5e-1]}"
        );
        // expert 2 pruned: row 1 routes around it
        let keep = [true, true, false, true, true];
        let l = route_line(0, &logits, 5, 2, Some(&keep));
        assert!(l.contains("\"top\":[[1,3,4],[1,3,0]]"), "{l}");
        assert!(l.contains("\"gap\":[1e0,2.5e0]"), "{l}");
        // fewer kept experts than k + 1: no gap
        let l = route_line(
            0,
            &logits[..5],
            5,
            4,
            Some(&[true, true, false, true, true]),
        );
        assert!(l.ends_with("\"gap\":[null]}"), "{l}");
        // k-th and (k + 1)-th both -inf (one NaN, one -inf): no finite gap, null (JSON has no inf)
        let l = route_line(0, &[3.0, f32::NAN, f32::NEG_INFINITY], 3, 2, None);
        assert!(l.ends_with("\"gap\":[null]}"), "{l}");
    }
}
