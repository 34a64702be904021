//! server: the HTTP face of the engine (`dramatis serve`), on axum/tokio.
//!
//! What it owns: the routes of SPEC.md (OpenAI `POST /v1/audio/speech`, Fish `POST /v1/tts`,
//! `/v1/models`, `/v1/voices`, `/health`, `/metrics`, `/openapi.json`); request decoding and
//! validation at the edge ([`body`], [`requests`]); one [`ApiError`] mapping to status codes;
//! reply shaping (whole `wav`/`pcm`/`flac`, SSE, raw chunked audio) and cancellation on client
//! disconnect ([`reply`]); API keys; metrics; graceful shutdown.
//!
//! What it is not: it does no synthesis, admission arithmetic or scheduling. The engine
//! (`speech::engine`) validates what needs the model, admits, runs lanes and emits PCM events.

mod auth;
pub mod body;
pub mod error;
pub mod metrics;
mod openapi;
pub mod reply;
pub mod requests;
mod routes;

pub use error::ApiError;

use axum::middleware::from_fn_with_state;
use axum::routing::{delete, get, post};
use axum::Router;
use metrics::Metrics;
use speech::engine::Engine;
use std::future::{Future, IntoFuture};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;

/// How `serve` listens and whom it lets in.
#[derive(Clone)]
pub struct ServeOptions {
    pub host: String,
    pub port: u16,
    /// Bearer keys; empty = no authentication. `/health` is always open.
    pub api_keys: Vec<String>,
    /// After a shutdown signal, how long in-flight connections get to settle once the engine has
    /// cancelled their jobs.
    pub shutdown_grace: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            host: "127.0.0.1".into(),
            port: 8080,
            api_keys: Vec::new(),
            shutdown_grace: Duration::from_secs(10),
        }
    }
}

impl std::fmt::Debug for ServeOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeOptions")
            .field("host", &self.host)
            .field("port", &self.port)
            .field(
                "api_keys",
                &format_args!("[{} redacted]", self.api_keys.len()),
            )
            .field("shutdown_grace", &self.shutdown_grace)
            .finish()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("the HTTP server failed: {0}")]
    Serve(std::io::Error),
}

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub engine: Arc<Engine>,
    pub metrics: Arc<Metrics>,
    api_keys: Arc<[String]>,
    sample_rate: u32,
    started_unix: u64,
    openapi: Arc<String>,
}

/// The whole application, for `serve` and for tests.
pub fn router(engine: Arc<Engine>, opts: &ServeOptions) -> Router {
    let state = AppState {
        sample_rate: engine.facts().sample_rate,
        engine,
        metrics: Arc::new(Metrics::new()),
        api_keys: opts.api_keys.clone().into(),
        started_unix: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        openapi: Arc::new(openapi::document(env!("CARGO_PKG_VERSION"))),
    };
    let protected = Router::new()
        .route("/v1/audio/speech", post(routes::speech))
        .route("/v1/tts", post(routes::tts))
        .route("/v1/models", get(routes::models))
        .route("/v1/models/{id}", get(routes::model))
        .route(
            "/v1/voices",
            get(routes::list_voices)
                .post(routes::add_voice)
                .delete(routes::remove_voice_query),
        )
        .route("/v1/voices/{name}", delete(routes::remove_voice))
        .route("/metrics", get(routes::metrics))
        .route("/openapi.json", get(routes::openapi))
        .route_layer(from_fn_with_state(state.clone(), auth::require_key));
    let open = Router::new()
        .route("/health", get(routes::health))
        .route("/v1/health", get(routes::health));
    protected
        .merge(open)
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(from_fn_with_state(state.clone(), metrics::track))
        .with_state(state)
}

/// Listens on `host:port` until SIGTERM or SIGINT, then stops accepting, cancels in-flight jobs
/// through `engine.shutdown()`, lets their connections settle, and returns `Ok`.
pub async fn serve(engine: Arc<Engine>, opts: ServeOptions) -> Result<(), ServerError> {
    let addr = format!("{}:{}", opts.host, opts.port);
    let listener = TcpListener::bind((opts.host.as_str(), opts.port))
        .await
        .map_err(|source| ServerError::Bind { addr, source })?;
    serve_on(listener, engine, opts, shutdown_signal()).await
}

/// [`serve`] on a bound listener, stopping when `shutdown` resolves (tests pass their own).
pub async fn serve_on(
    listener: TcpListener,
    engine: Arc<Engine>,
    opts: ServeOptions,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServerError> {
    let local: Option<SocketAddr> = listener.local_addr().ok();
    tracing::info!(addr = ?local, keys = opts.api_keys.len(), "dramatis server listening");
    let app = router(Arc::clone(&engine), &opts);
    let (fired_tx, fired_rx) = tokio::sync::oneshot::channel::<()>();
    let signal = async move {
        shutdown.await;
        let _ = fired_tx.send(());
    };
    // Cancelling ends every open stream, so the graceful wait can finish.
    let cancelling = Arc::clone(&engine);
    let mut canceller = tokio::spawn(async move {
        if fired_rx.await.is_err() {
            return false;
        }
        tracing::info!("shutting down: no new connections; cancelling in-flight jobs");
        engine_shutdown(cancelling).await;
        true
    });
    let mut server = Box::pin(
        axum::serve(
            listener,
            app.into_make_service_with_connect_info::<SocketAddr>(),
        )
        .with_graceful_shutdown(signal)
        .into_future(),
    );
    let result = tokio::select! {
        r = &mut server => {
            // Ended on its own or after the signal: either way the engine must settle.
            if !canceller.await.unwrap_or(false) {
                engine_shutdown(engine).await;
            }
            r
        }
        _ = &mut canceller => {
            match tokio::time::timeout(opts.shutdown_grace, &mut server).await {
                Ok(r) => r,
                Err(_) => {
                    tracing::warn!(grace = ?opts.shutdown_grace, "connections still open after the grace period; exiting");
                    Ok(())
                }
            }
        }
    };
    result.map_err(ServerError::Serve)?;
    tracing::info!("dramatis server stopped");
    Ok(())
}

async fn engine_shutdown(engine: Arc<Engine>) {
    let _ = tokio::task::spawn_blocking(move || engine.shutdown()).await;
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for SIGINT: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}
