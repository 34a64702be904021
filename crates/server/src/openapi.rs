//! `GET /openapi.json`, generated from the request types and the handlers' annotations.

use crate::error::{ErrorBody, ErrorDetail};
use crate::requests::{
    FishFormat, FishReference, ResponseFormat, SpeechReference, SpeechRequest, SplitMode,
    StreamFormat, TtsRequest, VoiceCreateRequest,
};
use crate::routes;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "dramatis",
        description = "Drama 3 text-to-speech: OpenAI- and Fish-compatible speech over HTTP"
    ),
    paths(
        routes::speech,
        routes::tts,
        routes::models,
        routes::model,
        routes::list_voices,
        routes::add_voice,
        routes::remove_voice_query,
        routes::remove_voice,
        routes::health,
        routes::metrics,
        routes::openapi,
    ),
    components(schemas(
        SpeechRequest,
        SpeechReference,
        ResponseFormat,
        StreamFormat,
        SplitMode,
        TtsRequest,
        FishReference,
        FishFormat,
        VoiceCreateRequest,
        ErrorBody,
        ErrorDetail,
    )),
    modifiers(&Bearer)
)]
struct ApiDoc;

struct Bearer;

impl Modify for Bearer {
    fn modify(&self, doc: &mut utoipa::openapi::OpenApi) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The document as JSON text.
pub fn document(version: &str) -> String {
    let mut doc = ApiDoc::openapi();
    doc.info.version = version.to_string();
    doc.to_pretty_json()
        .unwrap_or_else(|e| format!("{{\"error\": \"OpenAPI rendering failed: {e}\"}}"))
}

#[cfg(test)]
mod tests {
    #[test]
    fn has_paths_and_schemas() {
        let v: serde_json::Value = serde_json::from_str(&super::document("0.0.0")).unwrap();
        for p in [
            "/v1/audio/speech",
            "/v1/tts",
            "/v1/models",
            "/v1/voices",
            "/health",
            "/metrics",
        ] {
            assert!(v["paths"][p].is_object(), "{p}");
        }
        let speech = &v["components"]["schemas"]["SpeechRequest"];
        assert!(speech["properties"]["input"].is_object());
        assert!(speech["required"]
            .as_array()
            .unwrap()
            .contains(&"input".into()));
        assert!(v["components"]["schemas"]["TtsRequest"]["properties"]["normalize"].is_object());
    }
}
