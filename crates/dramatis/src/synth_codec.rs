//! A random codec at the real ModifiedDAC geometry, for full-size synthetic checkpoints.

use anyhow::{bail, Result};

pub fn drama3_codec_pth(_seed: u64) -> Result<Vec<u8>> {
    bail!("writing a full-size synthetic codec is not implemented yet")
}
