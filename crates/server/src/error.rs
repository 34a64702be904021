//! The one error type of the HTTP layer and its mapping to status codes and the OpenAI-style body
//! `{"error": {"message", "type", "param", "code"}}`.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use speech::api::{RequestError, RequestErrorKind};
use std::borrow::Cow;
use utoipa::ToSchema;

/// The `type` of an error body; each maps to one status (404 is an `invalid_request_error`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorType {
    InvalidRequest,
    LimitExceeded,
    Authentication,
    Overloaded,
    Server,
}

impl ErrorType {
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::InvalidRequest => "invalid_request_error",
            Self::LimitExceeded => "limit_exceeded",
            Self::Authentication => "authentication_error",
            Self::Overloaded => "overloaded",
            Self::Server => "server_error",
        }
    }

    const fn status(self) -> StatusCode {
        match self {
            Self::InvalidRequest => StatusCode::BAD_REQUEST,
            Self::LimitExceeded => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Authentication => StatusCode::UNAUTHORIZED,
            Self::Overloaded => StatusCode::SERVICE_UNAVAILABLE,
            Self::Server => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// A refusal or failure, answered before (or instead of) any audio.
#[derive(Clone, Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: ErrorType,
    /// Stable snake_case name; also the `reason` label of the refusal metric.
    pub code: Cow<'static, str>,
    pub param: Option<String>,
    pub message: String,
}

/// The wire shape of an error (for the OpenAPI document).
#[derive(Serialize, ToSchema)]
pub struct ErrorBody {
    pub error: ErrorDetail,
}

#[derive(Serialize, ToSchema)]
pub struct ErrorDetail {
    pub message: String,
    /// `invalid_request_error`, `limit_exceeded`, `authentication_error`, `overloaded` or `server_error`.
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: String,
}

/// Set on every error response so the metrics layer can count refusals by reason.
#[derive(Clone, Debug)]
pub struct RefusalCode(pub Cow<'static, str>);

impl ApiError {
    fn new(
        kind: ErrorType,
        code: impl Into<Cow<'static, str>>,
        message: impl Into<String>,
    ) -> Self {
        Self {
            status: kind.status(),
            kind,
            code: code.into(),
            param: None,
            message: message.into(),
        }
    }

    pub fn invalid(code: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(ErrorType::InvalidRequest, code, message)
    }

    pub fn limit(code: impl Into<Cow<'static, str>>, message: impl Into<String>) -> Self {
        Self::new(ErrorType::LimitExceeded, code, message)
    }

    pub fn auth(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorType::Authentication, code, message)
    }

    pub fn server(code: &'static str, message: impl Into<String>) -> Self {
        Self::new(ErrorType::Server, code, message)
    }

    pub fn not_found(code: &'static str, message: impl Into<String>) -> Self {
        let mut e = Self::invalid(code, message);
        e.status = StatusCode::NOT_FOUND;
        e
    }

    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }

    pub fn body(&self) -> ErrorBody {
        ErrorBody {
            error: ErrorDetail {
                message: self.message.clone(),
                kind: self.kind.as_str().into(),
                param: self.param.clone(),
                code: self.code.to_string(),
            },
        }
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} ({}): {}",
            self.status.as_u16(),
            self.code,
            self.message
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut res = (self.status, axum::Json(self.body())).into_response();
        let headers = res.headers_mut();
        match self.kind {
            ErrorType::Overloaded => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
            }
            ErrorType::Authentication => {
                headers.insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
            }
            _ => {}
        }
        res.extensions_mut().insert(RefusalCode(self.code));
        res
    }
}

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        let kind = match e.kind {
            RequestErrorKind::Invalid => ErrorType::InvalidRequest,
            RequestErrorKind::Limit => ErrorType::LimitExceeded,
            RequestErrorKind::Overloaded => ErrorType::Overloaded,
            RequestErrorKind::Server => ErrorType::Server,
        };
        Self {
            status: kind.status(),
            kind,
            code: e.code.into(),
            param: e.param,
            message: e.message,
        }
    }
}

impl From<admission::LimitError> for ApiError {
    fn from(e: admission::LimitError) -> Self {
        let kind = match e.kind() {
            admission::RefusalKind::InvalidRequest => ErrorType::InvalidRequest,
            admission::RefusalKind::LimitExceeded => ErrorType::LimitExceeded,
            admission::RefusalKind::Overloaded => ErrorType::Overloaded,
        };
        Self::new(kind, e.code(), e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_and_headers() {
        let r = ApiError::new(ErrorType::Overloaded, "overloaded", "busy").into_response();
        assert_eq!(r.status(), 503);
        assert_eq!(r.headers()[header::RETRY_AFTER], "1");
        let r = ApiError::auth("missing_api_key", "no key").into_response();
        assert_eq!(r.status(), 401);
        assert_eq!(ApiError::limit("x", "y").status, 413);
        assert_eq!(ApiError::not_found("x", "y").status, 404);
        assert_eq!(
            ApiError::not_found("x", "y").kind.as_str(),
            "invalid_request_error"
        );
    }

    #[test]
    fn engine_refusals_keep_code_and_param() {
        let e: ApiError = RequestError::limit("window_exceeded", Some("input"), "too long").into();
        assert_eq!(e.status, 413);
        assert_eq!(e.code, "window_exceeded");
        assert_eq!(e.param.as_deref(), Some("input"));
        let v = serde_json::to_value(e.body()).unwrap();
        assert_eq!(v["error"]["type"], "limit_exceeded");
        assert_eq!(v["error"]["message"], "too long");
    }
}
