//! The voice catalog on disk: one JSON file per voice holding its transcript and the codes the
//! codec encoder made from its clip once. `dramatis voices` and `/v1/voices` share it.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::api::RequestError;

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Voice {
    pub name: String,
    pub transcript: String,
    /// Frame-major `[frames][codebooks]`.
    pub codes: Vec<Vec<i64>>,
    pub frames: usize,
    /// SHA-256 of the clip bytes as given.
    pub clip_sha256: String,
    pub created_unix: u64,
}

#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct VoiceInfo {
    pub name: String,
    pub transcript: String,
    pub frames: usize,
    pub audio_seconds: f64,
    pub clip_sha256: String,
    pub created_unix: u64,
}

pub struct VoiceCatalog {
    dir: PathBuf,
    /// Serialises writers so add/remove never interleave.
    lock: Mutex<()>,
    frame_seconds: f64,
}

/// Voice names are file names: ASCII letters, digits, `-`, `_`, `.`; 1..=64 bytes; no leading dot.
pub fn valid_name(name: &str) -> bool {
    // "default" and "builtin" select the builtin voice in requests: never a catalog entry.
    !matches!(name, "default" | "builtin")
        && !name.is_empty()
        && name.len() <= 64
        && !name.starts_with('.')
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

impl VoiceCatalog {
    pub fn open(dir: &Path, frame_seconds: f64) -> std::io::Result<Self> {
        std::fs::create_dir_all(dir)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            lock: Mutex::new(()),
            frame_seconds,
        })
    }

    /// The platform data directory: `$XDG_DATA_HOME/dramatis/voices` or `~/.local/share/...`.
    pub fn default_dir() -> PathBuf {
        let base = std::env::var_os("XDG_DATA_HOME")
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".local/share")))
            .unwrap_or_else(|| PathBuf::from("."));
        base.join("dramatis/voices")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.join(format!("{name}.json"))
    }

    fn check_name(name: &str) -> Result<(), RequestError> {
        if valid_name(name) {
            Ok(())
        } else {
            Err(RequestError::invalid(
                "invalid_voice_name",
                Some("name"),
                format!("voice name {name:?} must be 1 to 64 ASCII letters, digits, '-', '_' or '.', not starting with '.', and not \"default\" or \"builtin\""),
            ))
        }
    }

    pub fn get(&self, name: &str) -> Result<Voice, RequestError> {
        Self::check_name(name).map_err(|_| unknown(name))?;
        let p = self.path(name);
        let text = std::fs::read_to_string(&p).map_err(|_| unknown(name))?;
        serde_json::from_str(&text).map_err(|e| RequestError {
            kind: crate::api::RequestErrorKind::Server,
            code: "voice_corrupt".into(),
            param: Some("voice".into()),
            message: format!("voice {name:?} on disk is unreadable: {e}"),
        })
    }

    pub fn info(&self, v: &Voice) -> VoiceInfo {
        VoiceInfo {
            name: v.name.clone(),
            transcript: v.transcript.clone(),
            frames: v.frames,
            audio_seconds: v.frames as f64 * self.frame_seconds,
            clip_sha256: v.clip_sha256.clone(),
            created_unix: v.created_unix,
        }
    }

    pub fn list(&self) -> Vec<VoiceInfo> {
        let mut out = Vec::new();
        if let Ok(rd) = std::fs::read_dir(&self.dir) {
            for e in rd.flatten() {
                let p = e.path();
                if p.extension().and_then(|x| x.to_str()) != Some("json") {
                    continue;
                }
                let Some(stem) = p.file_stem().and_then(|s| s.to_str()) else {
                    continue;
                };
                if let Ok(v) = self.get(stem) {
                    out.push(self.info(&v));
                }
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        out
    }

    /// Stores a voice atomically (write to a temporary file, then rename).
    pub fn put(&self, voice: &Voice) -> Result<VoiceInfo, RequestError> {
        Self::check_name(&voice.name)?;
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        let p = self.path(&voice.name);
        let tmp = self.dir.join(format!(".{}.tmp", voice.name));
        let text = serde_json::to_string(voice).map_err(|e| server(e.to_string()))?;
        std::fs::write(&tmp, text).map_err(|e| server(format!("{}: {e}", tmp.display())))?;
        std::fs::rename(&tmp, &p).map_err(|e| server(format!("{}: {e}", p.display())))?;
        Ok(self.info(voice))
    }

    pub fn remove(&self, name: &str) -> Result<bool, RequestError> {
        Self::check_name(name)?;
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        match std::fs::remove_file(self.path(name)) {
            Ok(()) => Ok(true),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(server(e.to_string())),
        }
    }
}

fn unknown(name: &str) -> RequestError {
    RequestError::invalid(
        "unknown_voice",
        Some("voice"),
        format!("voice {name:?} is not in the catalog"),
    )
}

fn server(msg: String) -> RequestError {
    RequestError {
        kind: crate::api::RequestErrorKind::Server,
        code: "voice_store_failed".into(),
        param: None,
        message: msg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn catalog_round_trip_and_survives_reopen() {
        let d = std::env::temp_dir().join(format!("dramatis-voices-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        let c = VoiceCatalog::open(&d, 2048.0 / 44100.0).unwrap();
        let v = Voice {
            name: "alice".into(),
            transcript: "Hi there.".into(),
            codes: vec![vec![1, 2, 3, 4, 5, 6, 7, 8, 9, 10]; 3],
            frames: 3,
            clip_sha256: "00".into(),
            created_unix: 1,
        };
        c.put(&v).unwrap();
        let c2 = VoiceCatalog::open(&d, 2048.0 / 44100.0).unwrap();
        assert_eq!(c2.get("alice").unwrap(), v);
        assert_eq!(c2.list().len(), 1);
        assert!(c2.remove("alice").unwrap());
        assert!(!c2.remove("alice").unwrap());
        assert_eq!(c2.get("alice").unwrap_err().code, "unknown_voice");
        assert!(c2
            .put(&Voice {
                name: "../x".into(),
                ..v
            })
            .is_err());
        let _ = std::fs::remove_dir_all(&d);
    }
}
