//! The human table of `dramatis plan` (the JSON form is `serde_json` of `Plan`).

use crate::contract::FrameCap;
use crate::plan::{Plan, ReplyMode, Verdict};
use crate::units::{group_digits, Bytes};
use std::fmt::{self, Write};

/// `47104` -> `46 KiB`; `1000` -> `0.977 KiB`.
fn kib(bytes: Bytes) -> String {
    let b = u128::from(bytes.0);
    if b % 1024 == 0 {
        format!("{} KiB", b / 1024)
    } else {
        let milli = (b * 1000 + 512) / 1024;
        format!("{}.{:03} KiB", milli / 1000, milli % 1000)
    }
}

/// Decimal gigabytes with two decimals: `12348030976` -> `12.35 GB`.
fn gb(bytes: Bytes) -> String {
    let centi = (u128::from(bytes.0) + 5_000_000) / 10_000_000;
    format!("{}.{:02} GB", centi / 100, centi % 100)
}

fn b(bytes: Bytes) -> String {
    format!("{} B", group_digits(bytes.0))
}

fn n(v: u64) -> String {
    group_digits(v)
}

impl Plan {
    /// The table `dramatis plan` prints: every budget in its unit, every byte class with bytes
    /// and GiB, the totals and the verdict line.
    pub fn render_table(&self) -> String {
        let mut s = String::new();
        // Writing to a String cannot fail.
        let _ = self.write_table(&mut s);
        s
    }

    fn write_table(&self, s: &mut String) -> fmt::Result {
        let bu = &self.budgets;
        writeln!(
            s,
            "dramatis plan: geometry {}, backend {}, experts {}",
            self.geometry,
            self.backend.as_str(),
            self.expert_format
        )?;
        writeln!(s)?;
        writeln!(s, "budgets")?;
        let row = |s: &mut String, k: &str, v: String| writeln!(s, "  {k:<26} {v}");
        row(
            s,
            "window C",
            format!(
                "{} window rows (model max {} window rows)",
                n(bu.window.0),
                n(bu.max_position_embeddings.0)
            ),
        )?;
        row(s, "lanes", format!("{} lanes", n(bu.lanes.0)))?;
        if let Some(p) = bu.pool_rows {
            row(s, "KV pool", format!("{} KV rows", n(p.0)))?;
        }
        if let Some(p) = bu.prompt_rows_max {
            row(s, "prompt rows max", format!("{} prompt rows", n(p.0)))?;
        }
        row(
            s,
            "frames default cap",
            format!("{} frames", n(bu.frames_default.0)),
        )?;
        if let Some(f) = bu.frames_max {
            row(s, "frames max", format!("{} frames (C - 2 - 1)", n(f.0)))?;
        }
        let asked = match bu.requested_frames {
            FrameCap::Explicit(f) => format!("explicit cap {} frames", n(f.0)),
            FrameCap::Default => "default cap".to_string(),
        };
        row(
            s,
            "request",
            format!("P = {} prompt rows, {asked}", n(bu.requested_prompt_rows.0)),
        )?;
        if let Some(a) = bu.admission {
            row(
                s,
                "admitted",
                format!(
                    "F = {} frames ({} cap), reserves {} KV rows (P + F + 1)",
                    n(a.frames.0),
                    a.cap.as_str(),
                    n(a.rows().0)
                ),
            )?;
        }
        let reply = match bu.reply {
            ReplyMode::Streamed => "streamed".to_string(),
            ReplyMode::Whole {
                redraw_buffer: true,
            } => "whole, with a redraw buffer".to_string(),
            ReplyMode::Whole {
                redraw_buffer: false,
            } => "whole".to_string(),
        };
        row(
            s,
            "reply",
            format!(
                "{reply}, PCM {}; CFG {}",
                match bu.pcm {
                    crate::plan::PcmFormat::F32 => "f32",
                    crate::plan::PcmFormat::I16 => "i16",
                },
                if bu.cfg { "on" } else { "off" }
            ),
        )?;
        row(
            s,
            "prefill chunk",
            format!("{} KV rows", n(bu.prefill_chunk_rows.0)),
        )?;
        let ip = &bu.limits.input_policy;
        let rl = &bu.limits.reference_limits;
        row(s, "HTTP body", format!("{} bytes", n(ip.max_body_bytes.0)))?;
        row(
            s,
            "request text",
            format!(
                "{} bytes and {} code points",
                n(ip.max_text_bytes.0),
                n(ip.max_code_points.0)
            ),
        )?;
        row(
            s,
            "reference passages",
            format!("{} reference passages per request", n(rl.max_passages.0)),
        )?;
        row(
            s,
            "reference transcript",
            format!(
                "{} reference transcript bytes each",
                n(rl.max_transcript_bytes.0)
            ),
        )?;
        row(
            s,
            "reference audio",
            format!("{} reference frames each", n(rl.max_frames.0)),
        )?;

        if let Some(r) = self.state_per_row {
            writeln!(s)?;
            writeln!(s, "attention state per row ({})", r.kv_dtype)?;
            row(s, "backbone KV", b(r.backbone_kv))?;
            if r.backbone_kv_cfg.0 > 0 {
                row(s, "backbone KV (CFG branch)", b(r.backbone_kv_cfg))?;
            }
            row(s, "tower KV", b(r.tower_kv))?;
            row(s, "total", format!("{} ({})", b(r.total), kib(r.total)))?;
            row(
                s,
                "one full window",
                format!(
                    "{} ({}, {} GiB) for {} rows",
                    b(r.full_window),
                    gb(r.full_window),
                    r.full_window.gib_string(),
                    n(bu.window.0)
                ),
            )?;
        }
        if let Some(l) = self.state_per_lane {
            writeln!(s)?;
            writeln!(s, "fixed state per lane")?;
            row(s, "GDN recurrent (f32)", b(l.gdn_recurrent))?;
            row(s, "GDN conv (f32)", b(l.gdn_conv))?;
            if l.gdn_cfg.0 > 0 {
                row(s, "GDN (CFG branch)", b(l.gdn_cfg))?;
            }
            row(s, "scratch", b(l.scratch))?;
            row(s, "codec state", b(l.codec_state))?;
            row(s, "codec workspace", b(l.codec_workspace))?;
            if l.staging.0 > 0 {
                row(s, "staging (each side)", b(l.staging))?;
            }
        }

        if !self.classes.is_empty() {
            writeln!(s)?;
            writeln!(
                s,
                "  {:<26} {:<7} {:>26} {:>16}  arithmetic",
                "byte class", "memory", "bytes", "GiB"
            )?;
            for c in &self.classes {
                writeln!(
                    s,
                    "  {:<26} {:<7} {:>26} {:>16}  {}",
                    c.class,
                    c.memory.as_str(),
                    b(c.bytes),
                    c.gib,
                    c.arithmetic
                )?;
            }
        }
        if !self.totals.is_empty() {
            writeln!(s)?;
            for t in &self.totals {
                let budget = match t.budget {
                    Some(bg) => format!(
                        "budget {} ({} GiB, {})",
                        b(bg.bytes),
                        bg.bytes.gib_string(),
                        match bg.source {
                            crate::plan::BudgetSource::Flag => "flag",
                            crate::plan::BudgetSource::Detected => "detected",
                        }
                    ),
                    None => "budget unknown".to_string(),
                };
                let fits = match t.fits {
                    Some(true) => "fits",
                    Some(false) => "DOES NOT FIT",
                    None => "not checked",
                };
                writeln!(
                    s,
                    "  {:<6} needs {} ({} GiB); {budget}: {fits}",
                    t.memory.as_str(),
                    b(t.needed),
                    t.needed.gib_string()
                )?;
            }
        }
        writeln!(s)?;
        match &self.verdict {
            Verdict::Admitted { unchecked_budgets } if unchecked_budgets.is_empty() => {
                writeln!(s, "verdict: admitted")?;
            }
            Verdict::Admitted { unchecked_budgets } => {
                let sides: Vec<&str> = unchecked_budgets.iter().map(|m| m.as_str()).collect();
                writeln!(
                    s,
                    "verdict: admitted ({} budget unknown: fit not checked there)",
                    sides.join(" and ")
                )?;
            }
            Verdict::Refused { code, message, .. } => {
                writeln!(s, "verdict: refused ({code}): {message}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.render_table())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_strings() {
        assert_eq!(kib(Bytes(47_104)), "46 KiB");
        assert_eq!(kib(Bytes(1000)), "0.977 KiB");
        assert_eq!(gb(Bytes(12_348_030_976)), "12.35 GB");
        assert_eq!(gb(Bytes(u64::MAX)), "18446744073.71 GB");
        assert_eq!(b(Bytes(20_480)), "20,480 B");
    }
}
