//! Decode/encode speed of a codec: `cargo run --release -p codec --example codec_speed [DIR] [FRAMES] [CHUNK]`
//! (DIR defaults to the vendored tiny fixture; codes are a fixed pseudo-random pattern).

use std::path::PathBuf;
use std::time::Instant;

use codec::{Codec, Codes};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let dir = args.next().map(PathBuf::from).unwrap_or_else(|| {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
    });
    let frames: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(300);
    let chunk: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(16);
    let codec = Codec::load(&dir, None)?;
    let nc = codec.num_codebooks();
    let data = (0..nc * frames)
        .map(|i| ((i as u64).wrapping_mul(2_654_435_761) >> 7) as u32 % 1024)
        .collect();
    let codes = Codes::new(nc, frames, data)?;
    let secs = (frames * codec.frame_length()) as f64 / f64::from(codec.sample_rate());

    let t = Instant::now();
    let pcm = codec.decode(&codes)?;
    let whole = t.elapsed().as_secs_f64();

    let t = Instant::now();
    let mut st = codec.decoder_state();
    let mut n = 0;
    for f in (0..frames).step_by(chunk) {
        n += st.push(&codes.slice(f, f + chunk))?.len();
    }
    let streamed = t.elapsed().as_secs_f64();
    assert_eq!(n, pcm.len());

    let t = Instant::now();
    let enc = codec.encode(&pcm)?;
    let encode = t.elapsed().as_secs_f64();

    let threads = rayon::current_num_threads();
    println!(
        "codec {} ({threads} threads), {frames} frames = {secs:.2} s of audio",
        dir.display()
    );
    println!(
        "decode whole     {:8.1} frames/s  RTF {:.4}",
        frames as f64 / whole,
        whole / secs
    );
    println!(
        "decode chunk {chunk:<3} {:8.1} frames/s  RTF {:.4}",
        frames as f64 / streamed,
        streamed / secs
    );
    println!(
        "encode           {:8.1} frames/s  RTF {:.4}",
        enc.frames() as f64 / encode,
        encode / secs
    );
    Ok(())
}
