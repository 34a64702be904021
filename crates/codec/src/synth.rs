//! A random-weight codec state dict at any [`CodecConfig`], named and shaped exactly as
//! `codec.pth` (what [`crate::Codec::load`] requires), for full-size synthetic checkpoints.
//!
//! Values are scaled so activations stay O(1) and decoded PCM is finite and not saturated:
//! weight-normed convs draw `v ~ N(0, 1)` with `g = ‖v‖·gain/√fan_in` (so `w ~ gain/√fan_in`),
//! plain matrices `N(0, 1/fan_in)`, Snake alphas `U(0.9, 1.1)`, norms `1 ± 0.02`, LayerScale
//! gammas `≈ 0.01`, biases `N(0, 0.02²)`, codebooks `N(0, 1)`. Residual branches and the output
//! conv are damped so variance does not grow block over block.
//!
//! Every tensor (and every 64 Ki-element piece of one) draws from its own ChaCha8 stream keyed
//! by (seed, name, piece), so the output is a pure function of (config, seed), whatever the
//! thread count. Pieces are generated in parallel with rayon.

use checkpoint::rng::{normal, stream, uniform};
use rayon::prelude::*;

use crate::CodecConfig;

/// One named tensor: (name, shape, row-major values) — what `checkpoint::pth_write` takes.
pub type NamedTensor = (String, Vec<usize>, Vec<f32>);

/// Elements per independently seeded piece of a tensor.
const PIECE: usize = 1 << 16;
const BIAS_STD: f32 = 0.02;
const NORM_STD: f32 = 0.02;
const GAMMA: f32 = 0.01;
/// Gain of a residual unit's closing 1×1 conv (keeps `x + branch` from growing ×2 per unit).
const RES_GAIN: f32 = 0.3;
/// Gain of the decoder's last conv (pre-tanh RMS well below 1).
const OUT_GAIN: f32 = 0.12;

#[derive(Debug, Clone, Copy)]
enum Init {
    /// N(mean, std²).
    Normal { mean: f32, std: f32 },
    /// U(lo, hi).
    Uniform { lo: f32, hi: f32 },
}

#[derive(Debug)]
enum Item {
    Plain {
        name: String,
        shape: Vec<usize>,
        init: Init,
    },
    /// Weight norm over all dims but 0: `g` `[d0, 1, …]` then `v` `shape`.
    WeightNorm {
        g: String,
        v: String,
        shape: Vec<usize>,
        /// Std of the folded weight.
        std: f32,
    },
}

/// Collects the tensors in `codec.pth` order (encoder, quantizer, decoder).
#[derive(Default)]
struct Plan {
    items: Vec<Item>,
}

fn fan_std(gain: f32, fan_in: usize) -> f32 {
    gain / (fan_in.max(1) as f32).sqrt()
}

impl Plan {
    fn plain(&mut self, name: String, shape: Vec<usize>, init: Init) {
        self.items.push(Item::Plain { name, shape, init });
    }

    fn normal(&mut self, name: String, shape: Vec<usize>, mean: f32, std: f32) {
        self.plain(name, shape, Init::Normal { mean, std });
    }

    fn bias(&mut self, name: String, n: usize) {
        self.normal(name, vec![n], 0.0, BIAS_STD);
    }

    /// Weight-normed conv (torch parametrizations), bias first as in `codec.pth`.
    fn wn_conv(&mut self, prefix: &str, shape: Vec<usize>, bias: usize, std: f32) {
        self.bias(format!("{prefix}.bias"), bias);
        self.items.push(Item::WeightNorm {
            g: format!("{prefix}.parametrizations.weight.original0"),
            v: format!("{prefix}.parametrizations.weight.original1"),
            shape,
            std,
        });
    }

    /// Causal conv `cin → cout`, kernel `k` (weight `[cout, cin, k]`).
    fn conv(&mut self, prefix: &str, cin: usize, cout: usize, k: usize, gain: f32) {
        self.wn_conv(prefix, vec![cout, cin, k], cout, fan_std(gain, cin * k));
    }

    /// Transposed conv `cin → cout` (weight `[cin, cout, k]`); each output sees `cin·k/stride`.
    fn convt(&mut self, prefix: &str, cin: usize, cout: usize, k: usize, stride: usize) {
        let fan = cin * (k / stride.max(1)).max(1);
        self.wn_conv(prefix, vec![cin, cout, k], cout, fan_std(1.0, fan));
    }

    fn snake(&mut self, prefix: &str, c: usize) {
        self.plain(
            format!("{prefix}.alpha"),
            vec![1, c, 1],
            Init::Uniform { lo: 0.9, hi: 1.1 },
        );
    }

    fn res_unit(&mut self, prefix: &str, c: usize) {
        self.snake(&format!("{prefix}.block.0"), c);
        self.conv(&format!("{prefix}.block.1.conv"), c, c, 7, 1.0);
        self.snake(&format!("{prefix}.block.2"), c);
        self.conv(&format!("{prefix}.block.3.conv"), c, c, 1, RES_GAIN);
    }

    fn convnext(&mut self, prefix: &str, c: usize) {
        let hidden = 4 * c;
        let p = |s: &str| format!("{prefix}.{s}");
        self.plain(
            p("gamma"),
            vec![c],
            Init::Uniform {
                lo: 0.5 * GAMMA,
                hi: 1.5 * GAMMA,
            },
        );
        self.normal(p("dwconv.conv.weight"), vec![c, 1, 7], 0.0, fan_std(1.0, 7));
        self.bias(p("dwconv.conv.bias"), c);
        self.normal(p("norm.weight"), vec![c], 1.0, NORM_STD);
        self.bias(p("norm.bias"), c);
        self.normal(p("pwconv1.weight"), vec![hidden, c], 0.0, fan_std(1.0, c));
        self.bias(p("pwconv1.bias"), hidden);
        self.normal(
            p("pwconv2.weight"),
            vec![c, hidden],
            0.0,
            fan_std(1.0, hidden),
        );
        self.bias(p("pwconv2.bias"), c);
    }

    fn transformer(&mut self, prefix: &str, n_layer: usize, dim: usize, w: usize, ffn: usize) {
        for l in 0..n_layer {
            let p = |s: &str| format!("{prefix}.layers.{l}.{s}");
            let m = |rows: usize, cols: usize| (vec![rows, cols], fan_std(1.0, cols));
            let (s, std) = m(3 * w, dim);
            self.normal(p("attention.wqkv.weight"), s, 0.0, std);
            let (s, std) = m(dim, w);
            self.normal(p("attention.wo.weight"), s, 0.0, std);
            let (s, std) = m(ffn, dim);
            self.normal(p("feed_forward.w1.weight"), s, 0.0, std);
            let (s, std) = m(ffn, dim);
            self.normal(p("feed_forward.w3.weight"), s, 0.0, std);
            let (s, std) = m(dim, ffn);
            self.normal(p("feed_forward.w2.weight"), s, 0.0, std);
            self.normal(p("ffn_norm.weight"), vec![dim], 1.0, NORM_STD);
            self.normal(p("attention_norm.weight"), vec![dim], 1.0, NORM_STD);
            for g in ["attention_layer_scale.gamma", "ffn_layer_scale.gamma"] {
                self.plain(
                    p(g),
                    vec![dim],
                    Init::Uniform {
                        lo: 0.5 * GAMMA,
                        hi: 1.5 * GAMMA,
                    },
                );
            }
        }
        self.normal(format!("{prefix}.norm.weight"), vec![dim], 1.0, NORM_STD);
    }

    /// A VQ (`in_proj`/`out_proj` old-style `weight_g`/`weight_v`, as `codec.pth` has them).
    fn vq(&mut self, prefix: &str, dim: usize, cb: usize, n: usize) {
        for (proj, cin, cout) in [("in_proj", dim, cb), ("out_proj", cb, dim)] {
            self.bias(format!("{prefix}.{proj}.bias"), cout);
            self.items.push(Item::WeightNorm {
                g: format!("{prefix}.{proj}.weight_g"),
                v: format!("{prefix}.{proj}.weight_v"),
                shape: vec![cout, cin, 1],
                std: fan_std(1.0, cin),
            });
        }
        self.normal(format!("{prefix}.codebook.weight"), vec![n, cb], 0.0, 1.0);
    }

    /// Mirrors `weights::build`: every tensor it reads, nothing more.
    fn of(cfg: &CodecConfig) -> Self {
        let mut p = Plan::default();
        let latent = cfg.latent_dim();

        let mut d = cfg.encoder_dim;
        p.conv("encoder.block.0.conv", 1, d, 7, 1.0);
        for (i, (&stride, &n_t)) in cfg
            .encoder_rates
            .iter()
            .zip(&cfg.encoder_transformer_layers)
            .enumerate()
        {
            let b = format!("encoder.block.{}", i + 1);
            let (half, full) = (d, 2 * d);
            for j in 0..3 {
                p.res_unit(&format!("{b}.block.{j}"), half);
            }
            p.snake(&format!("{b}.block.3"), half);
            p.conv(&format!("{b}.block.4.conv"), half, full, 2 * stride, 1.0);
            if n_t > 0 {
                // a config too narrow for one head writes none (loading it then names the width)
                if let Ok((heads, ffn)) = cfg.encoder_transformer_shape(full) {
                    p.transformer(
                        &format!("{b}.block.5"),
                        n_t,
                        full,
                        heads * cfg.encoder_head_dim,
                        ffn,
                    );
                }
            }
            d = full;
        }
        let nb = cfg.encoder_rates.len();
        p.snake(&format!("encoder.block.{}", nb + 1), d);
        p.conv(&format!("encoder.block.{}.conv", nb + 2), d, latent, 3, 1.0);

        let q = &cfg.quantizer;
        let dim = q.dim;
        p.vq(
            "quantizer.semantic_quantizer.quantizers.0",
            dim,
            cfg.codebook_dim,
            cfg.semantic_codebook_size,
        );
        for i in 0..cfg.n_codebooks {
            p.vq(
                &format!("quantizer.quantizer.quantizers.{i}"),
                dim,
                cfg.codebook_dim,
                cfg.codebook_size,
            );
        }
        // Plain (not weight-normed) resampling convs; weight before bias as in `codec.pth`.
        for (i, &f) in cfg.downsample_factor.iter().enumerate() {
            let b = format!("quantizer.downsample.{i}");
            p.normal(
                format!("{b}.0.conv.weight"),
                vec![dim, dim, f],
                0.0,
                fan_std(1.0, dim * f),
            );
            p.bias(format!("{b}.0.conv.bias"), dim);
            p.convnext(&format!("{b}.1"), dim);
        }
        for (j, &f) in cfg.downsample_factor.iter().rev().enumerate() {
            let b = format!("quantizer.upsample.{j}");
            // Transposed, kernel = stride: each output sees `dim` inputs.
            p.normal(
                format!("{b}.0.conv.weight"),
                vec![dim, dim, f],
                0.0,
                fan_std(1.0, dim),
            );
            p.bias(format!("{b}.0.conv.bias"), dim);
            p.convnext(&format!("{b}.1"), dim);
        }
        let w = q.n_head * q.head_dim;
        p.transformer(
            "quantizer.pre_module",
            q.n_layer,
            dim,
            w,
            q.intermediate_size,
        );
        p.transformer(
            "quantizer.post_module",
            q.n_layer,
            dim,
            w,
            q.intermediate_size,
        );

        let dd = cfg.decoder_dim;
        p.conv("decoder.model.0.conv", latent, dd, 7, 1.0);
        let mut cin = dd;
        for (i, &stride) in cfg.decoder_rates.iter().enumerate() {
            let b = format!("decoder.model.{}", i + 1);
            let cout = dd >> (i + 1);
            p.snake(&format!("{b}.block.0"), cin);
            p.convt(&format!("{b}.block.1.conv"), cin, cout, 2 * stride, stride);
            for j in 0..3 {
                p.res_unit(&format!("{b}.block.{}", j + 2), cout);
            }
            cin = cout;
        }
        let nd = cfg.decoder_rates.len();
        p.snake(&format!("decoder.model.{}", nd + 1), cin);
        p.conv(
            &format!("decoder.model.{}.conv", nd + 2),
            cin,
            1,
            7,
            OUT_GAIN,
        );
        p
    }
}

fn draw(seed: u64, name: &str, numel: usize, init: Init) -> Vec<f32> {
    let mut out = vec![0f32; numel];
    out.par_chunks_mut(PIECE)
        .enumerate()
        .for_each(|(piece, chunk)| {
            let mut rng = stream(seed, name, piece as u64);
            match init {
                Init::Normal { mean, std } => {
                    chunk
                        .iter_mut()
                        .for_each(|v| *v = mean + std * normal(&mut rng));
                }
                Init::Uniform { lo, hi } => {
                    chunk
                        .iter_mut()
                        .for_each(|v| *v = lo + (hi - lo) * uniform(&mut rng));
                }
            }
        });
    out
}

fn generate(seed: u64, item: &Item) -> Vec<NamedTensor> {
    match item {
        Item::Plain { name, shape, init } => {
            let numel = shape.iter().product();
            vec![(name.clone(), shape.clone(), draw(seed, name, numel, *init))]
        }
        Item::WeightNorm { g, v, shape, std } => {
            let numel: usize = shape.iter().product();
            let rows = shape.first().copied().unwrap_or(1);
            let vals = draw(
                seed,
                v,
                numel,
                Init::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
            );
            let per = numel.checked_div(rows).unwrap_or(0).max(1);
            let mut gv: Vec<f32> = vals
                .par_chunks(per)
                .map(|row| {
                    let n = row
                        .iter()
                        .map(|&x| f64::from(x).powi(2))
                        .sum::<f64>()
                        .sqrt();
                    (n * f64::from(*std)) as f32
                })
                .collect();
            gv.resize(rows, 0.0);
            let mut gshape = vec![1; shape.len()];
            if let Some(first) = gshape.first_mut() {
                *first = rows;
            }
            vec![(g.clone(), gshape, gv), (v.clone(), shape.clone(), vals)]
        }
    }
}

/// Every tensor `Codec::load` reads for `cfg`, with random values from `seed`, in `codec.pth`
/// order. Deterministic in (cfg, seed). The real Drama 3 geometry is ~1.5 GB of f32.
pub fn synthetic_state_dict(cfg: &CodecConfig, seed: u64) -> Vec<NamedTensor> {
    let plan = Plan::of(cfg);
    plan.items
        .par_iter()
        .map(|item| generate(seed, item))
        .collect::<Vec<_>>()
        .into_iter()
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Codec, Codes};
    use checkpoint::pth::read_pth;
    use checkpoint::pth_write::write_pth;
    use std::path::{Path, PathBuf};
    use std::time::Instant;

    fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../testdata/drama3-tiny")
    }

    fn tiny_cfg() -> CodecConfig {
        let text = std::fs::read_to_string(fixture_dir().join("codec_config.json")).unwrap();
        CodecConfig::from_json(&text).unwrap()
    }

    /// Deterministic pseudo-random codes within each codebook's range.
    fn random_codes(cfg: &CodecConfig, frames: usize) -> Codes {
        let n = cfg.num_codebooks();
        let mut rng = checkpoint::rng::stream(12345, "codes", 0);
        let data = (0..n * frames)
            .map(|i| {
                let s = rand_chacha::rand_core::RngCore::next_u64(&mut rng);
                let size = if i / frames == 0 {
                    cfg.semantic_codebook_size
                } else {
                    cfg.codebook_size
                };
                (s % size as u64) as u32
            })
            .collect();
        Codes::new(n, frames, data).unwrap()
    }

    /// Writes `codec.pth` (no `codec_config.json`) and loads it with `cfg` (or the default).
    fn write_and_load(cfg: &CodecConfig, seed: u64, pass_cfg: bool) -> (tempfile::TempDir, Codec) {
        let t = Instant::now();
        let sd = synthetic_state_dict(cfg, seed);
        let t_gen = t.elapsed();
        let bytes = write_pth(&sd).unwrap();
        drop(sd);
        let t_write = t.elapsed();
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("codec.pth"), &bytes).unwrap();
        let size = bytes.len();
        drop(bytes);
        let codec = Codec::load(dir.path(), pass_cfg.then(|| cfg.clone())).unwrap();
        eprintln!(
            "synthetic codec: {:.1} MB, generate {:.2?}, +write_pth {:.2?}, +load {:.2?}",
            size as f64 / 1e6,
            t_gen,
            t_write - t_gen,
            t.elapsed() - t_write
        );
        (dir, codec)
    }

    fn check_decode(codec: &Codec, frames: usize) {
        let cfg = codec.config().clone();
        let pcm = codec.decode(&random_codes(&cfg, frames)).unwrap();
        assert_eq!(pcm.len(), frames * cfg.frame_length());
        assert!(pcm.iter().all(|v| v.is_finite() && v.abs() <= 1.0));
        let rms =
            (pcm.iter().map(|&v| f64::from(v).powi(2)).sum::<f64>() / pcm.len() as f64).sqrt();
        let sat = pcm.iter().filter(|v| v.abs() > 0.99).count() as f64 / pcm.len() as f64;
        eprintln!(
            "decoded {frames} frames: rms {rms:.4}, saturated {:.2}%",
            sat * 100.0
        );
        assert!(rms > 1e-3, "PCM nearly silent: rms {rms}");
        assert!(
            rms < 0.8 && sat < 0.05,
            "PCM saturated: rms {rms}, {sat} at ±1"
        );
    }

    #[test]
    fn tiny_matches_fixture_names_and_shapes() {
        let fixture = read_pth(&fixture_dir().join("codec.pth")).unwrap();
        let sd = synthetic_state_dict(&tiny_cfg(), 7);
        let got: Vec<(&str, &[usize])> = sd.iter().map(|t| (t.0.as_str(), &t.1[..])).collect();
        let want: Vec<(&str, &[usize])> = fixture
            .iter()
            .map(|t| (t.name.as_str(), &t.shape[..]))
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn tiny_loads_decodes_and_encodes() {
        let cfg = tiny_cfg();
        let (_dir, codec) = write_and_load(&cfg, 1, true);
        check_decode(&codec, 6);
        // The encoder runs too and gives codes in range.
        let pcm: Vec<f32> = (0..4 * cfg.frame_length())
            .map(|i| 0.3 * (i as f32 * 0.031).sin())
            .collect();
        let codes = codec.encode(&pcm).unwrap();
        assert_eq!(codes.num_codebooks(), cfg.num_codebooks());
        assert_eq!(codes.frames(), 4);
    }

    #[test]
    fn deterministic_in_seed() {
        let cfg = tiny_cfg();
        let a = write_pth(&synthetic_state_dict(&cfg, 3)).unwrap();
        let b = write_pth(&synthetic_state_dict(&cfg, 3)).unwrap();
        let c = write_pth(&synthetic_state_dict(&cfg, 4)).unwrap();
        assert_eq!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn weight_norm_folds_to_the_target_scale() {
        let item = Item::WeightNorm {
            g: "g".into(),
            v: "v".into(),
            shape: vec![4, 300, 7],
            std: 0.1,
        };
        let out = generate(9, &item);
        let (g, v) = (&out[0].2, &out[1].2);
        assert_eq!(out[0].1, vec![4, 1, 1]);
        for (o, row) in v.chunks_exact(2100).enumerate() {
            let norm = row
                .iter()
                .map(|&x| f64::from(x).powi(2))
                .sum::<f64>()
                .sqrt();
            let w_std = f64::from(g[o]) / norm * (norm / (row.len() as f64).sqrt());
            assert!((w_std - 0.1).abs() < 0.01, "row {o}: folded std {w_std}");
        }
    }

    /// The real Drama 3 geometry: generate, write, load without a config file, decode.
    #[test]
    #[ignore = "real size: 1.57 GB codec.pth, ~5 GB peak memory, 15-30 s; run with --ignored"]
    fn real_size_loads_and_decodes() {
        let (_dir, codec) = write_and_load(&CodecConfig::default(), 0, false);
        assert_eq!(codec.config(), &CodecConfig::default());
        let t = Instant::now();
        check_decode(&codec, 4);
        eprintln!("decode 4 frames: {:.2?}", t.elapsed());
    }
}
