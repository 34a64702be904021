//! Prometheus metrics: requests by route and status, refusals by reason, frames, time to first
//! audio, capped segments, cancellations, and (read at scrape time) lanes and queue depth.

use crate::error::RefusalCode;
use crate::AppState;
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;
use prometheus::{
    Counter, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, Opts, Registry,
    TextEncoder,
};

pub struct Metrics {
    registry: Registry,
    requests: IntCounterVec,
    refusals: IntCounterVec,
    pub starts_deferred: IntCounter,
    pub prefills_joined: IntCounter,
    codec_calls: IntCounter,
    codec_frames: IntCounter,
    codec_busy: Counter,
    pub frames: IntCounter,
    pub audio_samples: IntCounter,
    pub capped_segments: IntCounter,
    pub jobs_completed: IntCounter,
    pub jobs_failed: IntCounter,
    pub jobs_cancelled: IntCounter,
    pub first_audio: Histogram,
    lanes_busy: IntGauge,
    lanes: IntGauge,
    queued: IntGauge,
    cache_hits: IntGauge,
    cache_misses: IntGauge,
    rounds: IntCounterVec,
    lane_sets: IntCounter,
}

fn counter(registry: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    registry
        .register(Box::new(c.clone()))
        .expect("unique metric");
    c
}

fn gauge(registry: &Registry, name: &str, help: &str) -> IntGauge {
    let g = IntGauge::new(name, help).expect("valid metric");
    registry
        .register(Box::new(g.clone()))
        .expect("unique metric");
    g
}

impl Metrics {
    pub fn new() -> Self {
        let registry = Registry::new();
        let requests = IntCounterVec::new(
            Opts::new(
                "dramatis_http_requests_total",
                "HTTP requests by route and status",
            ),
            &["route", "status"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(requests.clone()))
            .expect("unique metric");
        let refusals = IntCounterVec::new(
            Opts::new(
                "dramatis_refusals_total",
                "Requests refused or failed, by reason code",
            ),
            &["reason"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(refusals.clone()))
            .expect("unique metric");
        let first_audio = Histogram::with_opts(
            HistogramOpts::new(
                "dramatis_time_to_first_audio_seconds",
                "From request accepted to the first audio of a job",
            )
            .buckets(vec![
                0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
            ]),
        )
        .expect("valid metric");
        registry
            .register(Box::new(first_audio.clone()))
            .expect("unique metric");
        let rounds = IntCounterVec::new(
            Opts::new(
                "dramatis_frame_rounds_total",
                "Frame rounds by how they ran: host (draws on the host), replayed (a recorded \
                 graph), recorded, issued (launched one by one)",
            ),
            &["how"],
        )
        .expect("valid metric");
        registry
            .register(Box::new(rounds.clone()))
            .expect("unique metric");
        Self {
            rounds,
            lane_sets: counter(
                &registry,
                "dramatis_frame_round_lane_sets_total",
                "Lane sets a round kept on the backend was built for (each a new recording)",
            ),
            starts_deferred: counter(
                &registry,
                "dramatis_starts_deferred_total",
                "Times a waiting job was left for the next round by --starts-per-round",
            ),
            prefills_joined: counter(
                &registry,
                "dramatis_prefills_joined_total",
                "Lanes prefilled together with other lanes in one joined prefill",
            ),
            codec_calls: counter(
                &registry,
                "dramatis_codec_calls_total",
                "Streaming decoder calls of the codec thread (one job's waiting frames each)",
            ),
            codec_frames: counter(
                &registry,
                "dramatis_codec_frames_total",
                "Frames the codec thread decoded to audio",
            ),
            codec_busy: {
                let c = Counter::new(
                    "dramatis_codec_busy_seconds_total",
                    "Seconds the codec thread spent decoding (near the elapsed time: the codec paces the audio)",
                )
                .expect("valid metric");
                registry
                    .register(Box::new(c.clone()))
                    .expect("unique metric");
                c
            },
            frames: counter(
                &registry,
                "dramatis_frames_generated_total",
                "Frames generated, by every job (finished or not)",
            ),
            audio_samples: counter(
                &registry,
                "dramatis_audio_samples_total",
                "PCM samples sent by finished jobs",
            ),
            capped_segments: counter(
                &registry,
                "dramatis_capped_segments_total",
                "Segments that reached their frame cap without end of speech",
            ),
            jobs_completed: counter(
                &registry,
                "dramatis_jobs_completed_total",
                "Jobs that finished",
            ),
            jobs_failed: counter(
                &registry,
                "dramatis_jobs_failed_total",
                "Jobs that failed after admission",
            ),
            jobs_cancelled: counter(
                &registry,
                "dramatis_jobs_cancelled_total",
                "Jobs dropped before finishing (client gone)",
            ),
            lanes_busy: gauge(&registry, "dramatis_lanes_busy", "Lanes running a job"),
            lanes: gauge(&registry, "dramatis_lanes", "Lanes configured (--parallel)"),
            queued: gauge(
                &registry,
                "dramatis_queue_depth",
                "Jobs admitted and waiting for a lane",
            ),
            cache_hits: gauge(
                &registry,
                "dramatis_prompt_cache_hits",
                "Reference prefixes restored from the prefill cache",
            ),
            cache_misses: gauge(
                &registry,
                "dramatis_prompt_cache_misses",
                "Reference prefixes prefilled (not in the cache)",
            ),
            registry,
            requests,
            refusals,
            first_audio,
        }
    }

    pub fn refused(&self, reason: &str) {
        self.refusals.with_label_values(&[reason]).inc();
    }

    /// The text exposition, with the engine gauges read now.
    pub fn render(&self, state: &AppState) -> String {
        let stats = state.engine.stats();
        self.lanes_busy
            .set(i64::try_from(stats.lanes_busy).unwrap_or(i64::MAX));
        self.lanes
            .set(i64::try_from(stats.lanes).unwrap_or(i64::MAX));
        self.queued
            .set(i64::try_from(stats.queued).unwrap_or(i64::MAX));
        self.cache_hits
            .set(i64::try_from(stats.prompt_cache_hits).unwrap_or(i64::MAX));
        self.cache_misses
            .set(i64::try_from(stats.prompt_cache_misses).unwrap_or(i64::MAX));
        // The engine counts frames and rounds; the counters follow it.
        follow(&self.frames, stats.frames_total);
        follow(&self.starts_deferred, stats.starts_deferred);
        follow(&self.prefills_joined, stats.prefills_joined);
        follow(&self.codec_calls, stats.codec.calls);
        follow(&self.codec_frames, stats.codec.frames);
        let seen = self.codec_busy.get();
        if stats.codec.busy_seconds > seen {
            self.codec_busy.inc_by(stats.codec.busy_seconds - seen);
        }
        let r = stats.rounds;
        for (how, n) in [
            ("host", r.host),
            ("replayed", r.replayed),
            ("recorded", r.recorded),
            ("issued", r.issued),
        ] {
            follow(&self.rounds.with_label_values(&[how]), n);
        }
        follow(&self.lane_sets, r.set_changes);
        TextEncoder::new()
            .encode_to_string(&self.registry.gather())
            .unwrap_or_else(|e| format!("# encoding failed: {e}\n"))
    }
}

/// Moves `c` up to the engine's count `n` (a counter is monotonic: only ever forward).
fn follow(c: &IntCounter, n: u64) {
    let seen = c.get();
    if n > seen {
        c.inc_by(n - seen);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

/// Counts every response by route template and status, and every error by its code.
pub async fn track(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req
        .extensions()
        .get::<MatchedPath>()
        .map_or_else(|| "unmatched".to_string(), |p| p.as_str().to_string());
    let res = next.run(req).await;
    state
        .metrics
        .requests
        .with_label_values(&[route.as_str(), res.status().as_str()])
        .inc();
    if let Some(RefusalCode(code)) = res.extensions().get::<RefusalCode>() {
        state.metrics.refused(code);
    }
    res
}
