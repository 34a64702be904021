//! `dramatis fixture`: the synthetic checkpoint writer with a progress bar.

use anyhow::{anyhow, bail, Result};
use checkpoint::fixture::{CodecSource, FixtureExperts, FixtureOptions};
use checkpoint::geometry::Geometry;
use std::path::PathBuf;
use std::process::ExitCode;

pub fn run(
    geometry: Geometry,
    seed: u64,
    out: Option<PathBuf>,
    experts: FixtureExperts,
    manifest_only: bool,
) -> Result<ExitCode> {
    if manifest_only {
        print!(
            "{}",
            checkpoint::fixture::resolve_experts(geometry, &experts, seed)
                .and_then(|f| checkpoint::fixture::manifest_listing(geometry, &f))
                .map_err(|e| anyhow!("{e}"))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let Some(out) = out else {
        bail!("--out DIR is required to write a checkpoint")
    };
    let codec = match geometry {
        Geometry::Tiny => Some(CodecSource::Bytes(
            speech::builtin::tiny_codec_pth().to_vec(),
        )),
        Geometry::Drama3 => Some(CodecSource::Bytes(crate::synth_codec::drama3_codec_pth(
            seed,
        )?)),
    };
    let bar = indicatif::ProgressBar::new(0);
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "[{elapsed_precise}] {bar:40} {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let opts = FixtureOptions {
        geometry,
        seed,
        out: out.clone(),
        experts,
        codec,
    };
    let t = std::time::Instant::now();
    let s = checkpoint::fixture::write(&opts, &|done, total| {
        bar.set_length(total);
        bar.set_position(done);
    })
    .map_err(|e| anyhow!("{e}"))?;
    bar.finish_and_clear();
    if geometry == Geometry::Tiny {
        std::fs::write(
            out.join("codec_config.json"),
            speech::builtin::tiny_codec_config(),
        )?;
    }
    println!(
        "wrote {}: {} tensors, {} bytes in {} shard(s), experts {}, in {:.1} s",
        s.dir.display(),
        s.tensors,
        s.tensor_bytes,
        s.shards,
        s.expert_format.name(),
        t.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}
