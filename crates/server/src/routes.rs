//! The handlers: each decodes its body at the edge, validates, and hands over to the engine.

use crate::body::Payload;
use crate::error::{ApiError, ErrorBody};
use crate::reply;
use crate::requests::{SpeechRequest, TtsRequest, VoiceCreateRequest};
use crate::AppState;
use axum::extract::{Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use std::sync::Arc;

const AUDIO_REPLY: &str = "Audio: a whole `wav`/`pcm`/`flac` body with `X-Dramatis-Frames`, \
    `X-Dramatis-Seed` and `X-Dramatis-Pcm-Sha256`, or a stream";

/// OpenAI-compatible speech.
#[utoipa::path(
    post,
    path = "/v1/audio/speech",
    request_body(content = SpeechRequest, content_type = "application/json"),
    responses(
        (status = 200, description = AUDIO_REPLY, content(
            ("audio/wav"), ("audio/pcm"), ("audio/flac"), ("text/event-stream")
        )),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 413, description = "Over a stated limit", body = ErrorBody),
        (status = 503, description = "Every lane and the queue are full (Retry-After)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn speech(
    State(state): State<AppState>,
    Payload(req): Payload<SpeechRequest>,
) -> Result<Response, ApiError> {
    reply::synthesize(&state, req.validate()?).await
}

/// Fish-compatible speech (`ServeTTSRequest`), JSON or msgpack.
#[utoipa::path(
    post,
    path = "/v1/tts",
    request_body(content(
        (TtsRequest = "application/json"),
        (TtsRequest = "application/msgpack")
    )),
    responses(
        (status = 200, description = AUDIO_REPLY, content(("audio/wav"), ("audio/pcm"), ("audio/flac"))),
        (status = 400, description = "Invalid request", body = ErrorBody),
        (status = 401, description = "Missing or wrong API key", body = ErrorBody),
        (status = 413, description = "Over a stated limit", body = ErrorBody),
        (status = 503, description = "Every lane and the queue are full (Retry-After)", body = ErrorBody),
    ),
    security(("bearer" = []))
)]
pub async fn tts(
    State(state): State<AppState>,
    Payload(req): Payload<TtsRequest>,
) -> Result<Response, ApiError> {
    reply::synthesize(&state, req.validate()?).await
}

fn model_object(state: &AppState) -> Value {
    json!({
        "id": state.engine.model_id(),
        "object": "model",
        "created": state.started_unix,
        "owned_by": "dramatis",
        "speech": state.engine.facts(),
    })
}

/// The loaded model and its speech facts (OpenAI list shape).
#[utoipa::path(get, path = "/v1/models",
    responses((status = 200, description = "`{object: list, data: [model with speech facts]}`")),
    security(("bearer" = [])))]
pub async fn models(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&state)]}))
}

#[utoipa::path(get, path = "/v1/models/{id}",
    params(("id" = String, Path, description = "Model id")),
    responses((status = 200, description = "The model"), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn model(
    State(state): State<AppState>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    if id != state.engine.model_id() {
        return Err(
            ApiError::not_found("model_not_found", format!("no model {id:?} is loaded"))
                .with_param("id"),
        );
    }
    Ok(Json(model_object(&state)))
}

/// The voice catalog.
#[utoipa::path(get, path = "/v1/voices",
    responses((status = 200, description = "`{object: list, data: [voice]}`")),
    security(("bearer" = [])))]
pub async fn list_voices(State(state): State<AppState>) -> Json<Value> {
    Json(json!({"object": "list", "data": state.engine.voices().list()}))
}

/// Adds a voice: the clip is encoded once by the codec encoder and stored with its transcript.
#[utoipa::path(post, path = "/v1/voices",
    request_body(content = VoiceCreateRequest, content_type = "application/json"),
    responses((status = 201, description = "The stored voice"), (status = 400, body = ErrorBody), (status = 413, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn add_voice(
    State(state): State<AppState>,
    Payload(req): Payload<VoiceCreateRequest>,
) -> Result<Response, ApiError> {
    let engine = Arc::clone(&state.engine);
    let info =
        tokio::task::spawn_blocking(move || engine.add_voice(&req.name, &req.audio.0, &req.text))
            .await
            .map_err(|e| ApiError::server("internal", format!("voice task failed: {e}")))??;
    Ok((StatusCode::CREATED, Json(info)).into_response())
}

#[derive(Deserialize)]
pub struct VoiceQuery {
    name: Option<String>,
}

/// Removes a voice named by `?name=`.
#[utoipa::path(delete, path = "/v1/voices",
    params(("name" = String, Query, description = "The voice to remove")),
    responses((status = 200, description = "`{name, deleted: true}`"), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn remove_voice_query(
    State(state): State<AppState>,
    Query(q): Query<VoiceQuery>,
) -> Result<Json<Value>, ApiError> {
    let name = q.name.ok_or_else(|| {
        ApiError::invalid(
            "missing_field",
            "name the voice to remove: DELETE /v1/voices/{name} or ?name=",
        )
        .with_param("name")
    })?;
    remove(&state, name).await
}

/// Removes a voice.
#[utoipa::path(delete, path = "/v1/voices/{name}",
    params(("name" = String, Path, description = "The voice to remove")),
    responses((status = 200, description = "`{name, deleted: true}`"), (status = 404, body = ErrorBody)),
    security(("bearer" = [])))]
pub async fn remove_voice(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Json<Value>, ApiError> {
    remove(&state, name).await
}

async fn remove(state: &AppState, name: String) -> Result<Json<Value>, ApiError> {
    let engine = Arc::clone(&state.engine);
    let n = name.clone();
    let removed = tokio::task::spawn_blocking(move || engine.voices().remove(&n))
        .await
        .map_err(|e| ApiError::server("internal", format!("voice task failed: {e}")))??;
    if !removed {
        return Err(
            ApiError::not_found("voice_not_found", format!("no voice named {name:?}"))
                .with_param("name"),
        );
    }
    Ok(Json(
        json!({"name": name, "object": "voice", "deleted": true}),
    ))
}

/// Liveness; open even with API keys.
#[utoipa::path(get, path = "/health", responses((status = 200, description = "`{status: ok, ...}`")))]
pub async fn health(State(state): State<AppState>) -> Json<Value> {
    let stats = state.engine.stats();
    Json(json!({
        "status": "ok",
        "lanes": stats.lanes,
        "lanes_busy": stats.lanes_busy,
        "queued": stats.queued,
    }))
}

/// Prometheus text exposition.
#[utoipa::path(get, path = "/metrics",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain")),
    security(("bearer" = [])))]
pub async fn metrics(State(state): State<AppState>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        state.metrics.render(&state),
    )
        .into_response()
}

/// This document.
#[utoipa::path(get, path = "/openapi.json",
    responses((status = 200, description = "OpenAPI 3.1 document")),
    security(("bearer" = [])))]
pub async fn openapi(State(state): State<AppState>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        state.openapi.as_ref().clone(),
    )
        .into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::not_found("not_found", "no such route")
}

pub async fn method_not_allowed() -> ApiError {
    let mut e = ApiError::invalid(
        "method_not_allowed",
        "this route does not accept that method",
    );
    e.status = StatusCode::METHOD_NOT_ALLOWED;
    e
}
