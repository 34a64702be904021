//! PCM conversion, the PCM hash of SPEC.md, WAV output and reference-clip input.

use crate::SpeechError;
use sha2::{Digest, Sha256};
use std::path::Path;

/// `round_ties_even(clamp(x, -1, 1) * 32767)`, the one f32 -> s16 rule every output uses.
#[inline]
pub fn to_s16(x: f32) -> i16 {
    let y = if x.is_nan() { 0.0 } else { x.clamp(-1.0, 1.0) };
    (y * 32767.0).round_ties_even() as i16
}

pub fn to_s16_vec(pcm: &[f32]) -> Vec<i16> {
    pcm.iter().map(|&x| to_s16(x)).collect()
}

pub fn s16_le_bytes(s: &[i16]) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len() * 2);
    for v in s {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

/// Streaming PCM hash: SHA-256 over little-endian s16 samples only.
#[derive(Clone, Default)]
pub struct PcmHasher(Sha256);

impl PcmHasher {
    pub fn new() -> Self {
        Self(Sha256::new())
    }
    pub fn update_s16(&mut self, s: &[i16]) {
        for v in s {
            self.0.update(v.to_le_bytes());
        }
    }
    pub fn finish(self) -> String {
        hex::encode(self.0.finalize())
    }
}

pub fn pcm_sha256(pcm: &[f32]) -> String {
    let mut h = PcmHasher::new();
    h.update_s16(&to_s16_vec(pcm));
    h.finish()
}

/// A 16-bit mono WAV in memory.
pub fn wav_bytes(samples: &[i16], sample_rate: u32) -> Vec<u8> {
    let mut out = Vec::with_capacity(44 + samples.len() * 2);
    out.extend_from_slice(&wav_header(sample_rate, Some(samples.len() as u64)));
    out.extend_from_slice(&s16_le_bytes(samples));
    out
}

/// A 44-byte WAV header; `samples: None` writes the streaming sizes 0xFFFFFFFF.
pub fn wav_header(sample_rate: u32, samples: Option<u64>) -> Vec<u8> {
    let (riff, data) = match samples
        .and_then(|n| n.checked_mul(2))
        .filter(|&b| b <= u32::MAX as u64 - 36)
    {
        Some(b) => (36 + b as u32, b as u32),
        None => (u32::MAX, u32::MAX),
    };
    let mut h = Vec::with_capacity(44);
    h.extend_from_slice(b"RIFF");
    h.extend_from_slice(&riff.to_le_bytes());
    h.extend_from_slice(b"WAVEfmt ");
    h.extend_from_slice(&16u32.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes());
    h.extend_from_slice(&sample_rate.to_le_bytes());
    h.extend_from_slice(&(sample_rate * 2).to_le_bytes());
    h.extend_from_slice(&2u16.to_le_bytes());
    h.extend_from_slice(&16u16.to_le_bytes());
    h.extend_from_slice(b"data");
    h.extend_from_slice(&data.to_le_bytes());
    h
}

/// Reads a WAV clip (any rate, channels averaged to mono) as f32 at `target_rate`.
pub fn read_clip(bytes: &[u8], target_rate: u32) -> Result<Vec<f32>, SpeechError> {
    let (mono, rate) = decode_wav(bytes)?;
    resample(&mono, rate, target_rate)
}

/// Sample rates a reference clip may have (a crafted header must not size the resampler).
pub const CLIP_RATES: std::ops::RangeInclusive<u32> = 8_000..=192_000;

/// A WAV clip as mono f32 at its own rate (channels averaged).
pub fn decode_wav(bytes: &[u8]) -> Result<(Vec<f32>, u32), SpeechError> {
    let reader = hound::WavReader::new(std::io::Cursor::new(bytes))
        .map_err(|e| SpeechError::Audio(format!("not a readable WAV file: {e}")))?;
    let spec = reader.spec();
    if spec.channels == 0 {
        return Err(SpeechError::Audio("WAV has no channels".into()));
    }
    if !CLIP_RATES.contains(&spec.sample_rate) {
        return Err(SpeechError::Audio(format!(
            "WAV sample rate {} Hz is outside the accepted {} to {} Hz",
            spec.sample_rate,
            CLIP_RATES.start(),
            CLIP_RATES.end()
        )));
    }
    let ch = spec.channels as usize;
    let interleaved: Vec<f32> = match spec.sample_format {
        hound::SampleFormat::Float => reader
            .into_samples::<f32>()
            .collect::<Result<_, _>>()
            .map_err(|e| SpeechError::Audio(e.to_string()))?,
        hound::SampleFormat::Int => {
            let scale = 1.0 / (1u64 << (spec.bits_per_sample.clamp(1, 32) - 1)) as f32;
            reader
                .into_samples::<i32>()
                .map(|s| s.map(|v| v as f32 * scale))
                .collect::<Result<_, _>>()
                .map_err(|e| SpeechError::Audio(e.to_string()))?
        }
    };
    let mono: Vec<f32> = interleaved
        .chunks(ch)
        .map(|c| c.iter().sum::<f32>() / ch as f32)
        .collect();
    if mono.is_empty() {
        return Err(SpeechError::Audio("WAV holds no samples".into()));
    }
    if !mono.iter().all(|x| x.is_finite()) {
        return Err(SpeechError::Audio("WAV holds non-finite samples".into()));
    }
    Ok((mono, spec.sample_rate))
}

pub fn read_clip_file(path: &Path, target_rate: u32) -> Result<Vec<f32>, SpeechError> {
    let bytes =
        std::fs::read(path).map_err(|e| SpeechError::Audio(format!("{}: {e}", path.display())))?;
    read_clip(&bytes, target_rate)
        .map_err(|e| SpeechError::Audio(format!("{}: {e}", path.display())))
}

/// Band-limited resampling of a whole clip (rubato's synchronous FFT resampler), aligned: the
/// resampler's delay is removed by flushing it with zeros and dropping its reported delay.
pub fn resample(x: &[f32], from: u32, to: u32) -> Result<Vec<f32>, SpeechError> {
    use rubato::{FftFixedIn, Resampler};
    if from == to {
        return Ok(x.to_vec());
    }
    let chunk = 4096usize;
    let mut rs = FftFixedIn::<f32>::new(from as usize, to as usize, chunk, 1, 1)
        .map_err(|e| SpeechError::Audio(format!("resampler: {e}")))?;
    let delay = rs.output_delay();
    let want = (x.len() as f64 * to as f64 / from as f64).round() as usize;
    let mut y = Vec::with_capacity(want + delay + 2 * chunk);
    let mut pos = 0usize;
    // Zero-padded chunks until the delayed output covers the whole clip.
    while y.len() < want + delay {
        // The resampler rounds its chunk to suit the rate ratio: feed exactly what it asks.
        let need = rs.input_frames_next();
        let mut block = vec![0f32; need];
        if pos < x.len() {
            let n = need.min(x.len() - pos);
            block[..n].copy_from_slice(&x[pos..pos + n]);
        }
        pos += need;
        let out = rs
            .process(&[block], None)
            .map_err(|e| SpeechError::Audio(format!("resampler: {e}")))?;
        y.extend_from_slice(&out[0]);
    }
    y.drain(..delay.min(y.len()));
    y.truncate(want);
    Ok(y)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s16_rule() {
        assert_eq!(to_s16(1.0), 32767);
        assert_eq!(to_s16(2.0), 32767);
        assert_eq!(to_s16(-1.0), -32767);
        assert_eq!(to_s16(0.5 / 32767.0), 0); // 0.5 ties to even
        assert_eq!(to_s16(1.5 / 32767.0), 2);
        assert_eq!(to_s16(f32::NAN), 0);
    }

    #[test]
    fn wav_round_trip_and_hash() {
        let pcm: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.01).sin() * 0.7).collect();
        let s = to_s16_vec(&pcm);
        let wav = wav_bytes(&s, 44100);
        let back = read_clip(&wav, 44100).unwrap();
        // Integer WAV reads as s / 32768 (the torchaudio convention), exactly.
        assert_eq!(back.len(), s.len());
        for (a, b) in back.iter().zip(&s) {
            assert_eq!(*a, f32::from(*b) / 32768.0);
        }
        // The hash covers the s16 samples only: the WAV's data chunk, headers excluded.
        use sha2::{Digest, Sha256};
        assert_eq!(pcm_sha256(&pcm), hex::encode(Sha256::digest(&wav[44..])));
        assert_ne!(pcm_sha256(&pcm), pcm_sha256(&pcm[1..]));
    }

    #[test]
    fn not_audio_is_an_error() {
        let e = read_clip(b"hello, this is not a wav", 44100).unwrap_err();
        assert!(e.to_string().contains("not a readable WAV"));
    }

    #[test]
    fn resample_keeps_a_tone() {
        // A 440 Hz tone at several source rates lands on the analytic tone at 44.1 kHz, aligned.
        for from in [22050u32, 16000, 48000, 24000] {
            let n = from as usize;
            let w = 2.0 * std::f64::consts::PI * 440.0;
            let x: Vec<f32> = (0..n)
                .map(|i| (w * i as f64 / from as f64).sin() as f32)
                .collect();
            let y = resample(&x, from, 44100).unwrap();
            assert_eq!(y.len(), 44100);
            let mut best = (f64::MAX, 0i64);
            for lag in -8i64..=8 {
                let mut e = 0f64;
                for i in 5000..40000i64 {
                    let t = (w * i as f64 / 44100.0).sin();
                    e = e.max((f64::from(y[(i + lag) as usize]) - t).abs());
                }
                if e < best.0 {
                    best = (e, lag);
                }
            }
            assert_eq!(best.1, 0, "from {from}: best alignment {best:?}");
            assert!(best.0 < 1e-4, "from {from}: {best:?}");
        }
    }
}
