//! The request bodies of the HTTP API (OpenAI and Fish schemas, voice upload), validated at the
//! edge into a [`SynthesisRequest`] plus how the reply is to be shaped. The engine re-checks what
//! only it can know (voices, tags, limits, the window); everything checkable from the body alone is
//! refused here with a 400.

use crate::error::ApiError;
use base64::Engine as _;
use serde::de::{self, IgnoredAny};
use serde::{Deserialize, Deserializer};
use speech::api::{ReferenceAudio, ReferenceInput, Split, SynthesisRequest};
use utoipa::ToSchema;

/// Largest `top_k` accepted (0 = off).
pub const TOP_K_MAX: u32 = 4096;
/// Largest per-request `cfg_gamma` accepted (the engine also needs `--cfg-allow-request-gamma`).
pub const CFG_GAMMA_MAX: f64 = 10.0;

/// Audio bytes: base64 text in JSON (a `data:` URL prefix is tolerated), raw bytes in msgpack.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AudioData(pub Vec<u8>);

impl<'de> Deserialize<'de> for AudioData {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> de::Visitor<'de> for V {
            type Value = AudioData;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("base64-encoded audio (a string) or raw bytes")
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<AudioData, E> {
                decode_base64(s).map(AudioData).map_err(E::custom)
            }
            fn visit_bytes<E: de::Error>(self, b: &[u8]) -> Result<AudioData, E> {
                Ok(AudioData(b.to_vec()))
            }
            fn visit_byte_buf<E: de::Error>(self, b: Vec<u8>) -> Result<AudioData, E> {
                Ok(AudioData(b))
            }
            fn visit_seq<A: de::SeqAccess<'de>>(self, mut seq: A) -> Result<AudioData, A::Error> {
                let mut out = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(b) = seq.next_element::<u8>()? {
                    out.push(b);
                }
                Ok(AudioData(out))
            }
        }
        d.deserialize_any(V)
    }
}

fn decode_base64(s: &str) -> Result<Vec<u8>, String> {
    use base64::engine::{
        general_purpose, DecodePaddingMode, GeneralPurpose, GeneralPurposeConfig,
    };
    const LENIENT: GeneralPurpose = GeneralPurpose::new(
        &base64::alphabet::STANDARD,
        GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
    );
    let s = s.trim();
    let s = match s.strip_prefix("data:") {
        Some(rest) => rest.split_once(',').map_or(rest, |(_, data)| data),
        None => s,
    };
    LENIENT
        .decode(s)
        .or_else(|_| general_purpose::URL_SAFE_NO_PAD.decode(s.trim_end_matches('=')))
        .map_err(|e| format!("audio is not valid base64: {e}"))
}

/// `response_format` of `POST /v1/audio/speech`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ResponseFormat {
    /// 16-bit mono WAV at the codec rate (44.1 kHz).
    #[default]
    Wav,
    /// Raw s16le mono samples.
    Pcm,
    /// FLAC, 16-bit mono (whole replies only).
    Flac,
    /// Not encoded by dramatis: refused with `unsupported_response_format`.
    Mp3,
    /// Not encoded by dramatis: refused with `unsupported_response_format`.
    Opus,
    /// Not encoded by dramatis: refused with `unsupported_response_format`.
    Aac,
}

/// The audio container of a reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AudioFormat {
    Wav,
    Pcm,
    Flac,
}

impl AudioFormat {
    pub const fn content_type(self) -> &'static str {
        match self {
            Self::Wav => "audio/wav",
            Self::Pcm => "audio/pcm",
            Self::Flac => "audio/flac",
        }
    }
    pub const fn extension(self) -> &'static str {
        match self {
            Self::Wav => "wav",
            Self::Pcm => "pcm",
            Self::Flac => "flac",
        }
    }
}

impl ResponseFormat {
    fn supported(self, param: &str) -> Result<AudioFormat, ApiError> {
        match self {
            Self::Wav => Ok(AudioFormat::Wav),
            Self::Pcm => Ok(AudioFormat::Pcm),
            Self::Flac => Ok(AudioFormat::Flac),
            Self::Mp3 | Self::Opus | Self::Aac => Err(ApiError::invalid(
                "unsupported_response_format",
                format!("{param} {self:?} is not supported; use wav, pcm or flac").to_lowercase(),
            )
            .with_param(param)),
        }
    }
}

/// `stream_format` of `POST /v1/audio/speech` with `stream: true`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum StreamFormat {
    /// Server-sent events: `speech.audio.delta` (base64 s16le), `speech.audio.done`, `[DONE]`.
    #[default]
    Sse,
    /// Raw chunked bytes of `response_format` (`pcm`, or `wav` with streaming header sizes).
    Audio,
}

/// How long text is turned into prompts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum SplitMode {
    /// Sentence by sentence, carrying voice and speaker.
    #[default]
    Sentence,
    /// One prompt up to the window.
    None,
}

impl From<SplitMode> for Split {
    fn from(s: SplitMode) -> Self {
        match s {
            SplitMode::Sentence => Split::Sentence,
            SplitMode::None => Split::None,
        }
    }
}

/// A reference passage of `POST /v1/audio/speech`.
#[derive(Clone, Debug, Deserialize, ToSchema)]
pub struct SpeechReference {
    /// The clip as base64-encoded WAV (any rate; resampled to the codec's).
    #[schema(value_type = Option<String>, format = Byte)]
    pub audio: Option<AudioData>,
    /// Not supported (the server reads no paths); send `audio`.
    pub audio_path: Option<String>,
    /// The clip's transcript.
    pub text: String,
}

/// `POST /v1/audio/speech`: the OpenAI schema plus dramatis extensions.
#[derive(Clone, Debug, Deserialize, ToSchema)]
pub struct SpeechRequest {
    /// Accepted for compatibility; the loaded model answers.
    pub model: Option<String>,
    /// The text to speak (speaker tags `<|speaker:0..15|>` and direction tags allowed).
    pub input: String,
    /// A catalog voice; absent or `default` = the builtin voice.
    pub voice: Option<String>,
    pub response_format: Option<ResponseFormat>,
    /// Only 1.0 is supported.
    #[schema(minimum = 1.0, maximum = 1.0)]
    pub speed: Option<f64>,
    pub stream: Option<bool>,
    pub stream_format: Option<StreamFormat>,
    /// Inline reference passages (up to the reference limit).
    pub references: Option<Vec<SpeechReference>>,
    /// Any u64; absent = drawn and returned in `X-Dramatis-Seed`.
    pub seed: Option<u64>,
    /// [0, 2]; 0 = greedy.
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f64>,
    /// (0, 1].
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    /// 0..=4096; 0 = off.
    #[schema(maximum = 4096)]
    pub top_k: Option<u32>,
    /// Explicit frame cap: honoured exactly or refused (413).
    pub max_frames: Option<u64>,
    /// Per-request guidance strength in [0, 10] (server flag `--cfg-allow-request-gamma`).
    #[schema(minimum = 0.0, maximum = 10.0)]
    pub cfg_gamma: Option<f64>,
    pub split: Option<SplitMode>,
    /// Sentence-group size in UTF-8 bytes for `split: sentence`.
    pub chunk_length: Option<usize>,
}

/// `format` of `POST /v1/tts`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum FishFormat {
    #[default]
    Wav,
    Pcm,
    Flac,
    /// Not encoded by dramatis: refused with `unsupported_format`.
    Mp3,
    /// Not encoded by dramatis: refused with `unsupported_format`.
    Opus,
}

/// A reference passage of `POST /v1/tts`.
#[derive(Clone, Debug, Deserialize, ToSchema)]
pub struct FishReference {
    /// WAV bytes: base64 in JSON, raw bytes in msgpack.
    #[schema(value_type = String, format = Byte)]
    pub audio: AudioData,
    pub text: String,
}

/// `POST /v1/tts`: the fish-speech `ServeTTSRequest` schema, as JSON or msgpack.
#[derive(Clone, Debug, Deserialize, ToSchema)]
pub struct TtsRequest {
    pub text: String,
    /// Sentence-group size in UTF-8 bytes.
    pub chunk_length: Option<usize>,
    pub format: Option<FishFormat>,
    pub references: Option<Vec<FishReference>>,
    /// A catalog voice.
    pub reference_id: Option<String>,
    pub seed: Option<u64>,
    /// Chunked WAV; requires `format: wav`.
    pub streaming: Option<bool>,
    /// Explicit frame cap (0 or absent = the default cap).
    pub max_new_tokens: Option<u64>,
    /// (0, 1].
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub top_p: Option<f64>,
    /// [0, 2]; 0 = greedy.
    #[schema(minimum = 0.0, maximum = 2.0)]
    pub temperature: Option<f64>,
    /// Accepted and ignored (named in `X-Dramatis-Ignored`).
    #[schema(value_type = Option<f64>)]
    pub repetition_penalty: Option<IgnoredAny>,
    /// Accepted and ignored.
    #[schema(value_type = Option<String>)]
    pub latency: Option<IgnoredAny>,
    /// Accepted and ignored.
    #[schema(value_type = Option<String>)]
    pub use_memory_cache: Option<IgnoredAny>,
    /// Accepted and ignored.
    #[schema(value_type = Option<bool>)]
    pub normalize: Option<IgnoredAny>,
    /// Accepted and ignored.
    #[schema(value_type = Option<Object>)]
    pub prosody: Option<IgnoredAny>,
}

/// `POST /v1/voices`.
#[derive(Clone, Debug, Deserialize, ToSchema)]
pub struct VoiceCreateRequest {
    pub name: String,
    /// The clip as base64-encoded WAV (raw bytes in msgpack).
    #[schema(value_type = String, format = Byte)]
    pub audio: AudioData,
    /// The clip's transcript.
    #[serde(alias = "transcript")]
    pub text: String,
}

/// How a synthesis reply is sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyKind {
    /// The whole take in one body, with the frames/seed/hash headers.
    Whole(AudioFormat),
    /// Server-sent events with base64 s16le deltas.
    Sse,
    /// Raw chunked `pcm` or streaming `wav`.
    Raw(AudioFormat),
}

/// A validated synthesis request and the shape of its reply.
#[derive(Debug)]
pub struct Synthesis {
    pub request: SynthesisRequest,
    pub reply: ReplyKind,
    /// Fields accepted but ignored, for `X-Dramatis-Ignored`.
    pub ignored: Vec<&'static str>,
    /// Fish replies carry `Content-Disposition: attachment; filename=audio.<ext>`.
    pub attachment: bool,
}

struct Sampling {
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<u32>,
}

fn sampling(
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<u32>,
) -> Result<Sampling, ApiError> {
    if let Some(t) = temperature {
        if !t.is_finite() || !(0.0..=2.0).contains(&t) {
            return Err(ApiError::invalid(
                "invalid_temperature",
                format!("temperature must be finite and in [0, 2]; got {t}"),
            )
            .with_param("temperature"));
        }
    }
    if let Some(p) = top_p {
        if !p.is_finite() || p <= 0.0 || p > 1.0 {
            return Err(ApiError::invalid(
                "invalid_top_p",
                format!("top_p must be finite and in (0, 1]; got {p}"),
            )
            .with_param("top_p"));
        }
    }
    if let Some(k) = top_k {
        if k > TOP_K_MAX {
            return Err(ApiError::invalid(
                "invalid_top_k",
                format!("top_k must be in 0..={TOP_K_MAX} (0 = off); got {k}"),
            )
            .with_param("top_k"));
        }
    }
    Ok(Sampling {
        temperature: temperature.map(|t| t as f32),
        top_p: top_p.map(|p| p as f32),
        top_k,
    })
}

fn chunk_length(v: Option<usize>) -> Result<Option<usize>, ApiError> {
    match v {
        Some(0) => Err(ApiError::invalid(
            "invalid_chunk_length",
            "chunk_length must be at least 1 byte",
        )
        .with_param("chunk_length")),
        other => Ok(other),
    }
}

/// `default` names the builtin voice, as in sglang-omni's schema.
fn voice_name(v: Option<String>) -> Option<String> {
    v.filter(|n| n != "default")
}

impl SpeechRequest {
    pub fn validate(self) -> Result<Synthesis, ApiError> {
        if let Some(speed) = self.speed {
            if speed != 1.0 {
                return Err(ApiError::invalid(
                    "unsupported_speed",
                    format!("speed {speed} is not supported; only 1.0 is"),
                )
                .with_param("speed"));
            }
        }
        let format = self
            .response_format
            .unwrap_or_default()
            .supported("response_format")?;
        let reply = match (self.stream.unwrap_or(false), self.stream_format) {
            (false, _) => ReplyKind::Whole(format),
            (true, None | Some(StreamFormat::Sse)) => ReplyKind::Sse,
            (true, Some(StreamFormat::Audio)) => match format {
                AudioFormat::Flac => {
                    return Err(ApiError::invalid(
                        "unsupported_stream_format",
                        "stream_format audio streams pcm or wav; flac is for whole replies",
                    )
                    .with_param("response_format"))
                }
                f => ReplyKind::Raw(f),
            },
        };
        let s = sampling(self.temperature, self.top_p, self.top_k)?;
        if let Some(g) = self.cfg_gamma {
            if !g.is_finite() || !(0.0..=CFG_GAMMA_MAX).contains(&g) {
                return Err(ApiError::invalid(
                    "invalid_cfg_gamma",
                    format!("cfg_gamma must be finite and in [0, {CFG_GAMMA_MAX}]; got {g}"),
                )
                .with_param("cfg_gamma"));
            }
        }
        let references = self
            .references
            .unwrap_or_default()
            .into_iter()
            .enumerate()
            .map(|(i, r)| match (r.audio, r.audio_path) {
                (Some(audio), _) => Ok(ReferenceInput {
                    audio: ReferenceAudio::Wav(audio.0),
                    transcript: r.text,
                }),
                (None, Some(_)) => Err(ApiError::invalid(
                    "audio_path_unsupported",
                    "references[].audio_path is not supported (the server reads no paths); send the clip as base64 WAV in `audio`",
                )
                .with_param(format!("references[{i}].audio_path"))),
                (None, None) => Err(ApiError::invalid(
                    "missing_field",
                    format!("the required field `references[{i}].audio` is missing"),
                )
                .with_param(format!("references[{i}].audio"))),
            })
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Synthesis {
            request: SynthesisRequest {
                text: self.input,
                voice: voice_name(self.voice),
                references,
                seed: self.seed,
                temperature: s.temperature,
                top_p: s.top_p,
                top_k: s.top_k,
                max_frames: self.max_frames,
                split: self.split.unwrap_or_default().into(),
                chunk_length: chunk_length(self.chunk_length)?,
                cfg_gamma: self.cfg_gamma.map(|g| g as f32),
                whole_reply: matches!(reply, ReplyKind::Whole(_)),
            },
            reply,
            ignored: Vec::new(),
            attachment: false,
        })
    }
}

impl TtsRequest {
    pub fn validate(self) -> Result<Synthesis, ApiError> {
        let format = match self.format.unwrap_or_default() {
            FishFormat::Wav => AudioFormat::Wav,
            FishFormat::Pcm => AudioFormat::Pcm,
            FishFormat::Flac => AudioFormat::Flac,
            f @ (FishFormat::Mp3 | FishFormat::Opus) => {
                return Err(ApiError::invalid(
                    "unsupported_format",
                    format!("format {f:?} is not supported; use wav, pcm or flac").to_lowercase(),
                )
                .with_param("format"))
            }
        };
        let reply = if self.streaming.unwrap_or(false) {
            if format != AudioFormat::Wav {
                return Err(ApiError::invalid(
                    "streaming_requires_wav",
                    "streaming replies are chunked WAV; set format to wav",
                )
                .with_param("format"));
            }
            ReplyKind::Raw(AudioFormat::Wav)
        } else {
            ReplyKind::Whole(format)
        };
        let s = sampling(self.temperature, self.top_p, None)?;
        let ignored = [
            ("repetition_penalty", self.repetition_penalty.is_some()),
            ("latency", self.latency.is_some()),
            ("use_memory_cache", self.use_memory_cache.is_some()),
            ("normalize", self.normalize.is_some()),
            ("prosody", self.prosody.is_some()),
        ]
        .into_iter()
        .filter_map(|(name, present)| present.then_some(name))
        .collect();
        let references = self
            .references
            .unwrap_or_default()
            .into_iter()
            .map(|r| ReferenceInput {
                audio: ReferenceAudio::Wav(r.audio.0),
                transcript: r.text,
            })
            .collect();
        Ok(Synthesis {
            request: SynthesisRequest {
                text: self.text,
                voice: voice_name(self.reference_id.filter(|id| !id.is_empty())),
                references,
                seed: self.seed,
                temperature: s.temperature,
                top_p: s.top_p,
                top_k: None,
                max_frames: self.max_new_tokens.filter(|&n| n != 0),
                split: Split::Sentence,
                chunk_length: chunk_length(self.chunk_length)?,
                cfg_gamma: None,
                whole_reply: matches!(reply, ReplyKind::Whole(_)),
            },
            reply,
            ignored,
            attachment: true,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::body::{decode, Encoding};

    fn speech(json: serde_json::Value) -> Result<Synthesis, ApiError> {
        decode::<SpeechRequest>(json.to_string().as_bytes(), Encoding::Json)?.validate()
    }

    fn tts(json: serde_json::Value) -> Result<Synthesis, ApiError> {
        decode::<TtsRequest>(json.to_string().as_bytes(), Encoding::Json)?.validate()
    }

    fn code(r: Result<Synthesis, ApiError>) -> String {
        r.unwrap_err().code.to_string()
    }

    #[test]
    fn openai_defaults_and_replies() {
        let s = speech(serde_json::json!({"input": "hi"})).unwrap();
        assert_eq!(s.reply, ReplyKind::Whole(AudioFormat::Wav));
        assert_eq!(s.request.text, "hi");
        assert!(s.request.voice.is_none());
        let s = speech(serde_json::json!({"input": "hi", "stream": true})).unwrap();
        assert_eq!(s.reply, ReplyKind::Sse);
        let s = speech(serde_json::json!({"input": "hi", "stream": true, "stream_format": "audio", "response_format": "pcm"})).unwrap();
        assert_eq!(s.reply, ReplyKind::Raw(AudioFormat::Pcm));
        let s =
            speech(serde_json::json!({"input": "hi", "voice": "default", "speed": 1.0})).unwrap();
        assert!(s.request.voice.is_none());
        let s = speech(serde_json::json!({"input": "hi", "voice": "ann", "seed": u64::MAX, "top_k": 0, "temperature": 0})).unwrap();
        assert_eq!(s.request.voice.as_deref(), Some("ann"));
        assert_eq!(s.request.seed, Some(u64::MAX));
    }

    #[test]
    fn openai_refusals() {
        let r = |v| code(speech(v));
        assert_eq!(
            r(serde_json::json!({"input": "a", "speed": 2.0})),
            "unsupported_speed"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "temperature": 2.01})),
            "invalid_temperature"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "temperature": -0.1})),
            "invalid_temperature"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "top_p": 0.0})),
            "invalid_top_p"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "top_p": 1.5})),
            "invalid_top_p"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "top_k": 4097})),
            "invalid_top_k"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "top_k": -1})),
            "invalid_value"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "cfg_gamma": 11})),
            "invalid_cfg_gamma"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "response_format": "mp3"})),
            "unsupported_response_format"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "response_format": "xyz"})),
            "invalid_value"
        );
        assert_eq!(
            r(
                serde_json::json!({"input": "a", "stream": true, "stream_format": "audio", "response_format": "flac"})
            ),
            "unsupported_stream_format"
        );
        assert_eq!(
            r(
                serde_json::json!({"input": "a", "references": [{"audio_path": "/etc/passwd", "text": "x"}]})
            ),
            "audio_path_unsupported"
        );
        assert_eq!(
            r(serde_json::json!({"input": "a", "references": [{"audio": "!!!", "text": "x"}]})),
            "invalid_value"
        );
        assert_eq!(r(serde_json::json!({"input": 5})), "invalid_type");
        assert_eq!(r(serde_json::json!({"voice": "x"})), "missing_field");
        let e = speech(serde_json::json!({"input": "a", "top_p": 2})).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("top_p"));
    }

    #[test]
    fn sampling_boundaries() {
        assert!(sampling(Some(0.0), Some(1.0), Some(4096)).is_ok());
        assert!(sampling(Some(2.0), Some(f64::MIN_POSITIVE), Some(0)).is_ok());
        assert!(sampling(Some(f64::NAN), None, None).is_err());
        assert!(sampling(None, Some(f64::INFINITY), None).is_err());
    }

    #[test]
    fn fish_schema() {
        let s = tts(serde_json::json!({
            "text": "hi", "format": "wav", "streaming": true, "normalize": true, "latency": "normal",
            "max_new_tokens": 0, "reference_id": "ann", "references": [{"audio": "UklGRg==", "text": "t"}]
        }))
        .unwrap();
        assert_eq!(s.reply, ReplyKind::Raw(AudioFormat::Wav));
        assert_eq!(s.ignored, vec!["latency", "normalize"]);
        assert_eq!(s.request.max_frames, None);
        assert_eq!(s.request.voice.as_deref(), Some("ann"));
        match &s.request.references[0].audio {
            ReferenceAudio::Wav(b) => assert_eq!(b, b"RIFF"),
            ReferenceAudio::Codes(_) => panic!("codes"),
        }
        assert_eq!(
            code(tts(
                serde_json::json!({"text": "a", "streaming": true, "format": "pcm"})
            )),
            "streaming_requires_wav"
        );
        assert_eq!(
            code(tts(serde_json::json!({"text": "a", "format": "mp3"}))),
            "unsupported_format"
        );
        assert_eq!(
            code(tts(serde_json::json!({"text": "a", "temperature": 3}))),
            "invalid_temperature"
        );
        let s =
            tts(serde_json::json!({"text": "a", "max_new_tokens": 7, "format": "pcm"})).unwrap();
        assert_eq!(s.request.max_frames, Some(7));
        assert_eq!(s.reply, ReplyKind::Whole(AudioFormat::Pcm));
    }

    #[test]
    fn fish_msgpack_with_raw_bytes() {
        #[derive(serde::Serialize)]
        struct R<'a> {
            #[serde(with = "serde_bytes_shim")]
            audio: &'a [u8],
            text: &'a str,
        }
        #[derive(serde::Serialize)]
        struct T<'a> {
            text: &'a str,
            references: Vec<R<'a>>,
            repetition_penalty: f64,
            seed: Option<u64>,
        }
        mod serde_bytes_shim {
            pub fn serialize<S: serde::Serializer>(b: &[u8], s: S) -> Result<S::Ok, S::Error> {
                s.serialize_bytes(b)
            }
        }
        let body = rmp_serde::to_vec_named(&T {
            text: "hello",
            references: vec![R {
                audio: b"RIFFxxxx",
                text: "ref",
            }],
            repetition_penalty: 1.1,
            seed: None,
        })
        .unwrap();
        let s = decode::<TtsRequest>(&body, Encoding::Msgpack)
            .unwrap()
            .validate()
            .unwrap();
        assert_eq!(s.ignored, vec!["repetition_penalty"]);
        match &s.request.references[0].audio {
            ReferenceAudio::Wav(b) => assert_eq!(b, b"RIFFxxxx"),
            ReferenceAudio::Codes(_) => panic!("codes"),
        }
        // NaN cannot be written in JSON but can in msgpack.
        #[derive(serde::Serialize)]
        struct N {
            text: &'static str,
            temperature: f64,
        }
        let body = rmp_serde::to_vec_named(&N {
            text: "a",
            temperature: f64::NAN,
        })
        .unwrap();
        let e = decode::<TtsRequest>(&body, Encoding::Msgpack)
            .unwrap()
            .validate()
            .unwrap_err();
        assert_eq!(e.code, "invalid_temperature");
    }

    #[test]
    fn base64_forms() {
        assert_eq!(decode_base64("UklGRg==").unwrap(), b"RIFF");
        assert_eq!(decode_base64("UklGRg").unwrap(), b"RIFF");
        assert_eq!(
            decode_base64("data:audio/wav;base64,UklGRg==").unwrap(),
            b"RIFF"
        );
        assert!(decode_base64("@@").is_err());
    }
}
