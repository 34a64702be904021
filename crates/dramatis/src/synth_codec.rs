//! A random codec at the real ModifiedDAC geometry, for full-size synthetic checkpoints.

use anyhow::{anyhow, Result};
use codec::synth::synthetic_state_dict;
use codec::CodecConfig;

/// `codec.pth` bytes of a random-weight codec at [`CodecConfig::default`] (DRAMA3.md §8),
/// deterministic in `seed`; `codec::Codec::load` reads it with no `codec_config.json`.
pub fn drama3_codec_pth(seed: u64) -> Result<Vec<u8>> {
    let tensors = synthetic_state_dict(&CodecConfig::default(), seed);
    checkpoint::pth_write::write_pth(&tensors).map_err(|e| anyhow!("writing codec.pth: {e}"))
}
