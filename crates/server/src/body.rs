//! Request bodies: JSON or msgpack (by `Content-Type`), read under the body limit, and every
//! decoding failure answered as a 400 with the offending field (never the framework's 422).

use crate::error::ApiError;
use crate::AppState;
use admission::InputBytes;
use axum::extract::{FromRequest, Request};
use axum::http::header;
use futures::StreamExt;
use serde::de::DeserializeOwned;

/// How a body was encoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Encoding {
    Json,
    Msgpack,
}

/// A request body decoded into `T`.
pub struct Payload<T>(pub T);

impl<T: DeserializeOwned> FromRequest<AppState> for Payload<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &AppState) -> Result<Self, ApiError> {
        let encoding = encoding_of(req.headers().get(header::CONTENT_TYPE));
        let bytes = read_limited(req, state).await?;
        decode(&bytes, encoding).map(Payload)
    }
}

fn encoding_of(content_type: Option<&header::HeaderValue>) -> Encoding {
    let ct = content_type
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_ascii_lowercase();
    let mime = ct.split(';').next().unwrap_or("").trim();
    match mime {
        "application/msgpack" | "application/x-msgpack" | "application/vnd.msgpack" => {
            Encoding::Msgpack
        }
        _ => Encoding::Json,
    }
}

/// Reads the whole body, refusing (413, with both figures) anything over the configured limit,
/// from `Content-Length` when given and while reading otherwise.
async fn read_limited(req: Request, state: &AppState) -> Result<Vec<u8>, ApiError> {
    let limits = state.engine.limits();
    let limit = limits.input_policy.max_body_bytes;
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let expects_continue = req
        .headers()
        .get(header::EXPECT)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"100-continue"));
    let cap = usize::try_from(limit.0).unwrap_or(usize::MAX);
    let mut stream = req.into_body().into_data_stream();
    if let Some(n) = declared {
        if let Err(e) = limits.check_body(InputBytes(n)) {
            if !expects_continue {
                drain(&mut stream, cap).await;
            }
            return Err(e.into());
        }
    }
    let mut out = Vec::with_capacity(declared.and_then(|n| usize::try_from(n).ok()).unwrap_or(0));
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::invalid(
                "body_read_failed",
                format!("reading the request body failed: {e}"),
            )
        })?;
        if out.len().saturating_add(chunk.len()) > cap {
            let seen = out.len().saturating_add(chunk.len());
            drain(&mut stream, cap).await;
            return Err(ApiError::limit(
                "body_too_large",
                format!(
                    "the request body is more than {seen} bytes; the limit is {} bytes",
                    limit.0
                ),
            ));
        }
        out.extend_from_slice(&chunk);
    }
    Ok(out)
}

/// Reads and discards what the client is still sending (bounded in bytes and time) before a 413,
/// so the refusal reaches it instead of a connection reset over unread data.
async fn drain(stream: &mut axum::body::BodyDataStream, limit: usize) {
    let bound = limit.saturating_mul(2);
    let _ = tokio::time::timeout(std::time::Duration::from_secs(2), async {
        let mut seen = 0usize;
        while let Some(Ok(chunk)) = stream.next().await {
            seen = seen.saturating_add(chunk.len());
            if seen > bound {
                break;
            }
        }
    })
    .await;
}

/// Decodes a body; errors carry a stable code (`invalid_json`, `invalid_msgpack`,
/// `missing_field`, `invalid_type`, `invalid_value`) and the field's path as `param`.
pub fn decode<T: DeserializeOwned>(bytes: &[u8], encoding: Encoding) -> Result<T, ApiError> {
    match encoding {
        Encoding::Json => {
            let mut de = serde_json::Deserializer::from_slice(bytes);
            let value = serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let path = e.path().to_string();
                let inner = e.into_inner();
                if inner.is_data() {
                    data_error(&path, &inner.to_string(), "JSON")
                } else if bytes.iter().all(u8::is_ascii_whitespace) {
                    ApiError::invalid(
                        "invalid_json",
                        "the request body is empty; a JSON object is required",
                    )
                } else {
                    ApiError::invalid(
                        "invalid_json",
                        format!("the body is not valid JSON: {inner}"),
                    )
                }
            })?;
            de.end().map_err(|e| {
                ApiError::invalid("invalid_json", format!("the body is not valid JSON: {e}"))
            })?;
            Ok(value)
        }
        Encoding::Msgpack => {
            let mut de = rmp_serde::Deserializer::new(bytes);
            serde_path_to_error::deserialize(&mut de).map_err(|e| {
                let path = e.path().to_string();
                match e.into_inner() {
                    rmp_serde::decode::Error::Syntax(msg) => data_error(&path, &msg, "msgpack"),
                    rmp_serde::decode::Error::TypeMismatch(marker) => data_error(
                        &path,
                        &format!("invalid type: msgpack marker {marker:?}"),
                        "msgpack",
                    ),
                    other => ApiError::invalid(
                        "invalid_msgpack",
                        format!("the body is not valid msgpack: {other}"),
                    ),
                }
            })
        }
    }
}

/// A well-formed body whose content does not fit the schema.
fn data_error(path: &str, message: &str, what: &str) -> ApiError {
    let at_root = path.is_empty() || path == ".";
    if let Some(rest) = message.strip_prefix("missing field `") {
        let field = rest.split('`').next().unwrap_or("");
        let param = if at_root {
            field.to_string()
        } else {
            format!("{path}.{field}")
        };
        return ApiError::invalid(
            "missing_field",
            format!("the required field `{param}` is missing"),
        )
        .with_param(param);
    }
    let code = if message.starts_with("invalid type") {
        "invalid_type"
    } else {
        "invalid_value"
    };
    // serde_json appends " at line L column C", which only repeats what `param` says.
    let message = message.split(" at line ").next().unwrap_or(message);
    if at_root {
        ApiError::invalid(
            code,
            format!("the {what} body does not fit the request schema: {message}"),
        )
    } else {
        ApiError::invalid(code, format!("field `{path}`: {message}")).with_param(path)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Deserialize, Debug)]
    #[allow(dead_code)]
    struct Inner {
        text: String,
    }

    #[derive(Deserialize, Debug)]
    #[allow(dead_code)]
    struct Outer {
        input: String,
        n: Option<u32>,
        refs: Option<Vec<Inner>>,
    }

    fn err(body: &str) -> ApiError {
        decode::<Outer>(body.as_bytes(), Encoding::Json).unwrap_err()
    }

    #[test]
    fn json_errors_are_400_with_codes() {
        let e = err("{");
        assert_eq!((e.status.as_u16(), e.code.as_ref()), (400, "invalid_json"));
        let e = err("");
        assert_eq!(e.code, "invalid_json");
        let e = err(r#"{"input": "a"} x"#);
        assert_eq!(e.code, "invalid_json");
        let e = err("{}");
        assert_eq!(e.code, "missing_field");
        assert_eq!(e.param.as_deref(), Some("input"));
        let e = err(r#"{"input": 3}"#);
        assert_eq!(e.code, "invalid_type");
        assert_eq!(e.param.as_deref(), Some("input"));
        let e = err(r#"{"input": "a", "n": -1}"#);
        assert_eq!(e.param.as_deref(), Some("n"));
        let e = err(r#"{"input": "a", "refs": [{}]}"#);
        assert_eq!(e.code, "missing_field");
        assert_eq!(e.param.as_deref(), Some("refs[0].text"));
        let e = err("[]");
        assert_eq!(e.status.as_u16(), 400);
        let e = err("\"text\"");
        assert_eq!(e.code, "invalid_type");
        assert!(decode::<Outer>(br#"{"input":"a","extra":1}"#, Encoding::Json).is_ok());
    }

    #[test]
    fn msgpack_bodies() {
        #[derive(serde::Serialize)]
        struct M<'a> {
            input: &'a str,
            n: u32,
        }
        let b = rmp_serde::to_vec_named(&M { input: "hi", n: 3 }).unwrap();
        let o: Outer = decode(&b, Encoding::Msgpack).unwrap();
        assert_eq!((o.input.as_str(), o.n), ("hi", Some(3)));
        let e = decode::<Outer>(&[0xc1], Encoding::Msgpack).unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        let b = rmp_serde::to_vec_named(&serde_json::json!({"n": 1})).unwrap();
        let e = decode::<Outer>(&b, Encoding::Msgpack).unwrap_err();
        assert_eq!(e.code, "missing_field");
    }

    #[test]
    fn content_types() {
        let v = header::HeaderValue::from_static("application/msgpack; charset=x");
        assert_eq!(encoding_of(Some(&v)), Encoding::Msgpack);
        assert_eq!(encoding_of(None), Encoding::Json);
    }
}
