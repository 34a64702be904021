//! Running one admitted job and turning its events into a reply: a whole body (`wav`, `pcm`,
//! `flac`) with the frames/seed/hash headers, server-sent events, or raw chunked audio.
//!
//! The [`Job`] owns the engine's `JobHandle`: when the client goes away, hyper drops the handler
//! future or the body stream, the handle is dropped with it, and the engine stops that job at its
//! next frame.

use crate::error::ApiError;
use crate::metrics::Metrics;
use crate::requests::{AudioFormat, ReplyKind, Synthesis};
use crate::AppState;
use axum::body::Body;
use axum::http::{header, HeaderMap, HeaderName, HeaderValue};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use speech::api::{CapApplied, JobEvent, JobSummary};
use speech::engine::JobHandle;
use speech::pcm::{self, PcmHasher};
use std::sync::Arc;
use std::time::Instant;

/// An admitted job as the HTTP layer sees it; dropping it cancels the job.
struct Job {
    handle: JobHandle,
    metrics: Arc<Metrics>,
    accepted: Instant,
    audio_seen: bool,
    finished: bool,
}

impl Job {
    async fn next(&mut self) -> Option<JobEvent> {
        let event = self.handle.recv().await;
        match &event {
            Some(JobEvent::Audio(_)) if !self.audio_seen => {
                self.audio_seen = true;
                self.metrics
                    .first_audio
                    .observe(self.accepted.elapsed().as_secs_f64());
            }
            Some(JobEvent::Done(s)) => {
                self.finished = true;
                self.metrics.jobs_completed.inc();
                self.metrics.audio_samples.inc_by(s.samples);
                self.metrics
                    .capped_segments
                    .inc_by(u64::from(s.capped_segments));
            }
            Some(JobEvent::Failed(_)) | None if !self.finished => {
                self.finished = true;
                self.metrics.jobs_failed.inc();
            }
            _ => {}
        }
        event
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        if !self.finished {
            self.metrics.jobs_cancelled.inc();
        }
    }
}

/// What `Started` says, for the reply headers.
struct Start {
    seed: u64,
    cap: Option<(u64, CapApplied)>,
}

fn cap_name(cap: CapApplied) -> &'static str {
    match cap {
        CapApplied::Explicit => "explicit",
        CapApplied::Default => "default",
        CapApplied::DefaultShrunk => "default_shrunk",
    }
}

fn failed(message: String) -> ApiError {
    ApiError::server("synthesis_failed", format!("synthesis failed: {message}"))
}

fn aborted() -> ApiError {
    ApiError::server(
        "synthesis_aborted",
        "the job ended without a result (the server may be shutting down)",
    )
}

/// Admits the request (on a blocking thread: it may run the codec encoder) and sends the reply.
pub async fn synthesize(state: &AppState, synthesis: Synthesis) -> Result<Response, ApiError> {
    let accepted = Instant::now();
    let Synthesis {
        request,
        reply,
        ignored,
        attachment,
    } = synthesis;
    let engine = Arc::clone(&state.engine);
    let handle = tokio::task::spawn_blocking(move || engine.submit(request))
        .await
        .map_err(|e| ApiError::server("internal", format!("admission task failed: {e}")))??;
    let mut job = Job {
        handle,
        metrics: Arc::clone(&state.metrics),
        accepted,
        audio_seen: false,
        finished: false,
    };
    let rate = state.sample_rate;
    let mut headers = HeaderMap::new();
    put(&mut headers, "x-dramatis-sample-rate", rate);
    if !ignored.is_empty() {
        put(&mut headers, "x-dramatis-ignored", ignored.join(", "));
    }
    let format = match reply {
        ReplyKind::Whole(f) | ReplyKind::Raw(f) => Some(f),
        ReplyKind::Sse => None,
    };
    if let (true, Some(f)) = (attachment, format) {
        put(
            &mut headers,
            header::CONTENT_DISPOSITION.as_str(),
            format!("attachment; filename=audio.{}", f.extension()),
        );
    }
    match reply {
        ReplyKind::Whole(format) => whole(job, format, rate, headers).await,
        ReplyKind::Sse | ReplyKind::Raw(_) => {
            let (start, pending) = wait_started(&mut job).await?;
            put(&mut headers, "x-dramatis-seed", start.seed);
            if let Some((frames, cap)) = start.cap {
                put(&mut headers, "x-dramatis-frame-cap", frames);
                put(&mut headers, "x-dramatis-cap", cap_name(cap));
            }
            let (content_type, first) = match reply {
                ReplyKind::Raw(AudioFormat::Wav) => ("audio/wav", pcm::wav_header(rate, None)),
                ReplyKind::Raw(f) => (f.content_type(), Vec::new()),
                _ => ("text/event-stream", Vec::new()),
            };
            put(&mut headers, header::CONTENT_TYPE.as_str(), content_type);
            put(&mut headers, header::CACHE_CONTROL.as_str(), "no-cache");
            put(&mut headers, "x-accel-buffering", "no");
            let stream = StreamState {
                job,
                sse: reply == ReplyKind::Sse,
                hasher: PcmHasher::new(),
                pending,
                first: (!first.is_empty()).then_some(first),
                done: false,
            };
            let body = Body::from_stream(futures::stream::unfold(stream, StreamState::step));
            Ok((headers, body).into_response())
        }
    }
}

/// Waits for `Started` so stream headers can say which cap applied; a failure before any audio
/// is still an ordinary error response.
async fn wait_started(job: &mut Job) -> Result<(Start, Option<JobEvent>), ApiError> {
    match job.next().await {
        Some(JobEvent::Started {
            seed,
            frame_cap,
            cap,
            ..
        }) => Ok((
            Start {
                seed,
                cap: Some((frame_cap, cap)),
            },
            None,
        )),
        Some(JobEvent::Failed(m)) => Err(failed(m)),
        None => Err(aborted()),
        Some(other) => Ok((
            Start {
                seed: job.handle.seed(),
                cap: None,
            },
            Some(other),
        )),
    }
}

async fn whole(
    mut job: Job,
    format: AudioFormat,
    rate: u32,
    mut headers: HeaderMap,
) -> Result<Response, ApiError> {
    let mut samples: Vec<i16> = Vec::new();
    let mut hasher = PcmHasher::new();
    let summary = loop {
        match job.next().await {
            Some(JobEvent::Started { .. }) => {}
            Some(JobEvent::Audio(chunk)) => {
                let s = pcm::to_s16_vec(&chunk);
                hasher.update_s16(&s);
                samples.extend_from_slice(&s);
            }
            Some(JobEvent::Done(summary)) => break summary,
            Some(JobEvent::Failed(m)) => return Err(failed(m)),
            None => return Err(aborted()),
        }
    };
    drop(job);
    let hash = hasher.finish();
    check_hash(&hash, &summary);
    summary_headers(&mut headers, &summary, &hash);
    put(
        &mut headers,
        header::CONTENT_TYPE.as_str(),
        format.content_type(),
    );
    let body = match format {
        AudioFormat::Wav => pcm::wav_bytes(&samples, rate),
        AudioFormat::Pcm => pcm::s16_le_bytes(&samples),
        AudioFormat::Flac => tokio::task::spawn_blocking(move || flac_bytes(&samples, rate))
            .await
            .map_err(|e| ApiError::server("internal", format!("FLAC task failed: {e}")))??,
    };
    Ok((headers, body).into_response())
}

fn check_hash(ours: &str, summary: &JobSummary) {
    if ours != summary.pcm_sha256 {
        tracing::error!(
            ours,
            engine = summary.pcm_sha256,
            "PCM hash of the sent audio differs from the engine's"
        );
    }
}

fn summary_headers(headers: &mut HeaderMap, s: &JobSummary, hash: &str) {
    put(headers, "x-dramatis-frames", s.frames);
    put(headers, "x-dramatis-seed", s.seed);
    put(headers, "x-dramatis-pcm-sha256", hash);
    put(headers, "x-dramatis-frame-cap", s.frame_cap);
    put(headers, "x-dramatis-cap", cap_name(s.cap));
    put(headers, "x-dramatis-segments", s.segments);
    if s.capped_segments > 0 {
        put(headers, "x-dramatis-capped", s.capped_segments);
    }
}

fn put(headers: &mut HeaderMap, name: &str, value: impl ToString) {
    if let (Ok(n), Ok(v)) = (
        HeaderName::from_bytes(name.as_bytes()),
        HeaderValue::from_str(&value.to_string()),
    ) {
        headers.insert(n, v);
    }
}

/// 16-bit mono FLAC of the samples.
pub fn flac_bytes(samples: &[i16], rate: u32) -> Result<Vec<u8>, ApiError> {
    use flacenc::component::BitRepr;
    use flacenc::error::Verify;
    let err = |what: &str, e: &dyn std::fmt::Debug| {
        ApiError::server("flac_encode_failed", format!("FLAC {what}: {e:?}"))
    };
    let config = flacenc::config::Encoder::default()
        .into_verified()
        .map_err(|e| err("config", &e))?;
    let wide: Vec<i32> = samples.iter().map(|&s| i32::from(s)).collect();
    let rate = usize::try_from(rate).map_err(|e| err("rate", &e))?;
    let source = flacenc::source::MemSource::from_samples(&wide, 1, 16, rate);
    let stream = flacenc::encode_with_fixed_block_size(&config, source, config.block_size)
        .map_err(|e| err("encode", &e))?;
    let mut sink = flacenc::bitsink::ByteSink::new();
    stream.write(&mut sink).map_err(|e| err("write", &e))?;
    Ok(sink.as_slice().to_vec())
}

/// The body of a streamed reply, pulled by hyper; dropping it (client gone) drops the job.
struct StreamState {
    job: Job,
    sse: bool,
    hasher: PcmHasher,
    pending: Option<JobEvent>,
    first: Option<Vec<u8>>,
    done: bool,
}

type Chunk = Result<Vec<u8>, std::io::Error>;

impl StreamState {
    async fn step(mut self) -> Option<(Chunk, Self)> {
        if self.done {
            return None;
        }
        if let Some(first) = self.first.take() {
            return Some((Ok(first), self));
        }
        loop {
            let event = match self.pending.take() {
                Some(e) => Some(e),
                None => self.job.next().await,
            };
            match event {
                Some(JobEvent::Started { .. }) => {}
                Some(JobEvent::Audio(chunk)) if chunk.is_empty() => {}
                Some(JobEvent::Audio(chunk)) => {
                    let s = pcm::to_s16_vec(&chunk);
                    self.hasher.update_s16(&s);
                    let bytes = pcm::s16_le_bytes(&s);
                    let out = if self.sse { sse_delta(&bytes) } else { bytes };
                    return Some((Ok(out), self));
                }
                Some(JobEvent::Done(summary)) => {
                    self.done = true;
                    if !self.sse {
                        return None;
                    }
                    let hash = std::mem::take(&mut self.hasher).finish();
                    check_hash(&hash, &summary);
                    return Some((Ok(sse_done(&summary, &hash)), self));
                }
                Some(JobEvent::Failed(m)) => return Some(self.fail(failed(m))),
                None => return Some(self.fail(aborted())),
            }
        }
    }

    /// SSE streams end with an error event; raw audio aborts the connection so a truncated take
    /// never looks complete.
    fn fail(mut self, e: ApiError) -> (Chunk, Self) {
        self.done = true;
        self.job.metrics.refused(&e.code);
        if self.sse {
            let event = serde_json::json!({"type": "error", "error": e.body().error});
            (Ok(format!("data: {event}\n\n").into_bytes()), self)
        } else {
            (Err(std::io::Error::other(e.message)), self)
        }
    }
}

fn sse_delta(s16le: &[u8]) -> Vec<u8> {
    let audio = base64::engine::general_purpose::STANDARD.encode(s16le);
    format!("data: {{\"type\":\"speech.audio.delta\",\"audio\":\"{audio}\"}}\n\n").into_bytes()
}

fn sse_done(s: &JobSummary, hash: &str) -> Vec<u8> {
    let done = serde_json::json!({
        "type": "speech.audio.done",
        "frames": s.frames,
        "pcm_sha256": hash,
        "seed": s.seed,
        "samples": s.samples,
        "frame_cap": s.frame_cap,
        "cap": cap_name(s.cap),
        "segments": s.segments,
        "capped_segments": s.capped_segments,
    });
    format!("data: {done}\n\ndata: [DONE]\n\n").into_bytes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flac_starts_with_magic() {
        let s: Vec<i16> = (0..10_000).map(|i| ((i % 200) as i16 - 100) * 50).collect();
        let b = flac_bytes(&s, 44_100).unwrap();
        assert_eq!(&b[..4], b"fLaC");
        assert!(b.len() < s.len() * 2);
    }

    #[test]
    fn sse_event_shapes() {
        let d = String::from_utf8(sse_delta(&[1, 0, 255, 255])).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(d.strip_prefix("data: ").unwrap().trim()).unwrap();
        assert_eq!(v["type"], "speech.audio.delta");
        assert_eq!(v["audio"], "AQD//w==");
    }
}
