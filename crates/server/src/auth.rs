//! Bearer API keys (`--api-key`, repeatable): every route but `/health` needs one when any is set.

use crate::error::ApiError;
use crate::AppState;
use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

pub async fn require_key(
    State(state): State<AppState>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    if state.api_keys.is_empty() {
        return Ok(next.run(req).await);
    }
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(bearer_token);
    match presented {
        None => Err(ApiError::auth(
            "missing_api_key",
            "this server needs an API key: send `Authorization: Bearer <key>`",
        )),
        Some(key)
            if state
                .api_keys
                .iter()
                .any(|k| same(k.as_bytes(), key.as_bytes())) =>
        {
            Ok(next.run(req).await)
        }
        Some(_) => Err(ApiError::auth(
            "invalid_api_key",
            "the API key is not valid",
        )),
    }
}

fn bearer_token(v: &str) -> Option<&str> {
    let (scheme, token) = v.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| token.trim())
        .filter(|t| !t.is_empty())
}

/// Compares without an early exit on the first differing byte.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens() {
        assert_eq!(bearer_token("Bearer abc"), Some("abc"));
        assert_eq!(bearer_token("bearer  abc "), Some("abc"));
        assert_eq!(bearer_token("Basic abc"), None);
        assert_eq!(bearer_token("Bearer "), None);
        assert!(same(b"k1", b"k1"));
        assert!(!same(b"k1", b"k2"));
        assert!(!same(b"k1", b"k12"));
    }
}
