//! The `reference-bracket-v1` prompt (DRAMA3.md section 6): pieces tokenised separately, in
//! order; references contribute their transcript and one row per codec frame.

use crate::SpeechError;
use tokenizers::Tokenizer;

/// One backbone input row: `[token, c0..c9]` (width = 1 + codebooks).
pub type Row = Vec<i64>;

/// Markers user text may not contain: they would forge the template.
pub const STRUCTURAL: &[&str] = &[
    "<|im_start|>",
    "<|im_end|>",
    "<|endoftext|>",
    "<|voice|>",
    "<|text|>",
    "<|interleave|>",
    "<|semantic:",
];

pub const MAX_SPEAKER: u32 = 15;

/// A reference passage: transcript plus its codes, frame-major `[frames][codebooks]`.
#[derive(Debug, Clone, PartialEq)]
pub struct Reference {
    pub transcript: String,
    pub codes: Vec<Vec<i64>>,
}

/// Token ids and sizes the builder needs, read from config and tokenizer.
#[derive(Debug, Clone)]
pub struct PromptSpec {
    pub semantic_start: u32,
    pub num_codebooks: usize,
    /// Codebook 0 size (semantic band).
    pub semantic_codebook_size: usize,
    /// Size of the residual codebooks codes are checked against (codec's).
    pub residual_codebook_size: usize,
}

/// The assembled prompt with the unit counts admission reports.
#[derive(Debug, Clone)]
pub struct Prompt {
    pub rows: Vec<Row>,
    /// Rows through the last reference frame (0 without references): the prefix the reference
    /// prefill cache keys on. Every prefill splits here, cached or not, so a hit equals a miss.
    pub prefix_rows: usize,
    pub text_tokens: usize,
    pub structural_tokens: usize,
    pub reference_transcript_tokens: usize,
    pub reference_frames: usize,
}

/// Checks user-supplied text: no structural markers, speaker tags in 0..=15.
pub fn validate_text(text: &str, what: &str) -> Result<(), SpeechError> {
    for s in STRUCTURAL {
        if text.contains(s) {
            return Err(SpeechError::StructuralToken {
                what: what.to_string(),
                token: s.to_string(),
            });
        }
    }
    let mut rest = text;
    while let Some(i) = rest.find("<|speaker:") {
        let after = &rest[i + "<|speaker:".len()..];
        let end = after.find("|>").ok_or_else(|| SpeechError::BadSpeakerTag {
            what: what.to_string(),
            tag: after.chars().take(12).collect(),
        })?;
        let num = &after[..end];
        let ok = !num.is_empty()
            && num.chars().all(|c| c.is_ascii_digit())
            && (num == "0" || !num.starts_with('0'))
            && num
                .parse::<u32>()
                .map(|n| n <= MAX_SPEAKER)
                .unwrap_or(false);
        if !ok {
            return Err(SpeechError::BadSpeakerTag {
                what: what.to_string(),
                tag: format!("<|speaker:{num}|>"),
            });
        }
        rest = &after[end + 2..];
    }
    Ok(())
}

fn starts_with_speaker(text: &str) -> bool {
    text.starts_with("<|speaker:")
}

/// Reference transcript: the tag directly follows "Text: "; leading whitespace moves after it.
fn tag_transcript(t: &str) -> String {
    if starts_with_speaker(t) {
        t.to_string()
    } else {
        let trimmed = t.trim_start();
        let ws = &t[..t.len() - trimmed.len()];
        format!("<|speaker:0|> {ws}{trimmed}")
    }
}

fn tag_user(t: &str) -> String {
    if starts_with_speaker(t) {
        t.to_string()
    } else {
        format!("<|speaker:0|> {t}")
    }
}

/// A speaker tag to carry forward across sentence chunks.
pub fn leading_speaker(text: &str) -> Option<&str> {
    if !starts_with_speaker(text) {
        return None;
    }
    text.find("|>").map(|e| &text[..e + 2])
}

pub struct PromptBuilder<'a> {
    pub tokenizer: &'a Tokenizer,
    pub spec: PromptSpec,
}

impl<'a> PromptBuilder<'a> {
    fn encode(&self, s: &str) -> Result<Vec<u32>, SpeechError> {
        let enc = self
            .tokenizer
            .encode(s, true)
            .map_err(|e| SpeechError::Tokenizer(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    fn push_text(&self, rows: &mut Vec<Row>, s: &str) -> Result<usize, SpeechError> {
        let ids = self.encode(s)?;
        let w = 1 + self.spec.num_codebooks;
        for id in &ids {
            let mut r = vec![0i64; w];
            r[0] = *id as i64;
            rows.push(r);
        }
        Ok(ids.len())
    }

    /// Builds the rows for `text` with up to N references (limits are admission's job).
    pub fn build(&self, text: &str, refs: &[Reference]) -> Result<Prompt, SpeechError> {
        if text.trim().is_empty() {
            return Err(SpeechError::EmptyText);
        }
        validate_text(text, "input text")?;
        let nc = self.spec.num_codebooks;
        let mut rows = Vec::new();
        let mut structural = 0;
        let mut ref_tokens = 0;
        let mut ref_frames = 0;
        structural += self.push_text(&mut rows, "<|im_start|>system\n")?;
        let sys = if refs.is_empty() {
            "convert the provided text to speech"
        } else {
            "convert the provided text to speech reference to the following:"
        };
        structural += self.push_text(&mut rows, sys)?;
        for (k, r) in refs.iter().enumerate() {
            if r.transcript.trim().is_empty() {
                return Err(SpeechError::EmptyTranscript { index: k + 1 });
            }
            validate_text(&r.transcript, &format!("reference {} transcript", k + 1))?;
            if r.codes.is_empty() {
                return Err(SpeechError::EmptyReferenceAudio { index: k + 1 });
            }
            structural +=
                self.push_text(&mut rows, &format!("\n\n[Reference {}]\nText: ", k + 1))?;
            ref_tokens += self.push_text(&mut rows, &tag_transcript(&r.transcript))?;
            structural += self.push_text(&mut rows, "\nSpeech: ")?;
            for (fi, frame) in r.codes.iter().enumerate() {
                if frame.len() != nc {
                    return Err(SpeechError::BadReferenceCodes {
                        index: k + 1,
                        why: format!("frame {fi} has {} codes, expected {nc}", frame.len()),
                    });
                }
                for (c, &code) in frame.iter().enumerate() {
                    let lim = if c == 0 {
                        self.spec.semantic_codebook_size
                    } else {
                        self.spec.residual_codebook_size
                    };
                    if code < 0 || code as u64 >= lim as u64 {
                        return Err(SpeechError::BadReferenceCodes {
                            index: k + 1,
                            why: format!("frame {fi} codebook {c} code {code} is outside 0..{lim}"),
                        });
                    }
                }
                let mut row = Vec::with_capacity(nc + 1);
                row.push(self.spec.semantic_start as i64 + frame[0]);
                row.extend_from_slice(frame);
                rows.push(row);
            }
            ref_frames += r.codes.len();
        }
        let prefix_rows = if refs.is_empty() { 0 } else { rows.len() };
        structural += self.push_text(&mut rows, "<|im_end|>\n")?;
        structural += self.push_text(&mut rows, "<|im_start|>user\n")?;
        let text_tokens = self.push_text(&mut rows, &tag_user(text))?;
        structural += self.push_text(&mut rows, "<|im_end|>\n")?;
        structural += self.push_text(&mut rows, "<|im_start|>assistant\n<|voice|>")?;
        Ok(Prompt {
            rows,
            prefix_rows,
            text_tokens,
            structural_tokens: structural,
            reference_transcript_tokens: ref_tokens,
            reference_frames: ref_frames,
        })
    }
}
