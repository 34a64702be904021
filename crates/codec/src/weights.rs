//! Builds the codec from `codec.pth` names (sglang-omni / fish-speech `modded_dac.DAC` module
//! tree), checking every shape against the config and folding weight norm.

use checkpoint::pth::PthStateDict;

use crate::ops::{Conv1d, ConvTranspose1d, DwConv1d, Rope, Snake};
use crate::{
    CodecConfig, CodecError, ConvNeXt, DecBlock, EncBlock, Inner, ResUnit, TfLayer, Transformer, Vq,
};

pub(crate) struct Store {
    sd: PthStateDict,
}

impl Store {
    pub(crate) fn new(sd: PthStateDict) -> Self {
        Self { sd }
    }

    fn has(&self, name: &str) -> bool {
        self.sd.get(name).is_some()
    }

    fn get64(&self, name: &str, shape: &[usize]) -> Result<Vec<f64>, CodecError> {
        let t = self.sd.get(name).ok_or_else(|| CodecError::Missing {
            name: name.to_owned(),
        })?;
        if t.shape != shape {
            return Err(CodecError::Shape {
                name: name.to_owned(),
                expected: shape.to_vec(),
                found: t.shape.clone(),
            });
        }
        Ok(t.to_f64())
    }

    fn get(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>, CodecError> {
        Ok(self
            .get64(name, shape)?
            .into_iter()
            .map(|v| v as f32)
            .collect())
    }

    /// A conv weight of `shape` (`[d0, ...]`) at `prefix`: torch parametrizations
    /// (`parametrizations.weight.original0/1`), old-style `weight_g`/`weight_v`, or plain
    /// `weight`. Weight norm is folded in f64: `w = v · g / ‖v‖`, the norm over all dims but 0.
    fn conv_weight(&self, prefix: &str, shape: &[usize]) -> Result<Vec<f32>, CodecError> {
        let param = format!("{prefix}.parametrizations.weight.original0");
        let (gname, vname) = if self.has(&param) {
            (param, format!("{prefix}.parametrizations.weight.original1"))
        } else if self.has(&format!("{prefix}.weight_g")) {
            (format!("{prefix}.weight_g"), format!("{prefix}.weight_v"))
        } else {
            return self.get(&format!("{prefix}.weight"), shape);
        };
        let mut gshape = vec![1; shape.len()];
        gshape[0] = shape[0];
        let g = self.get64(&gname, &gshape)?;
        let v = self.get64(&vname, shape)?;
        let per = v.len() / shape[0].max(1);
        let mut w = Vec::with_capacity(v.len());
        for (o, chunk) in v.chunks_exact(per.max(1)).enumerate() {
            let norm = chunk.iter().map(|x| x * x).sum::<f64>().sqrt();
            let scale = g[o] / norm;
            w.extend(chunk.iter().map(|x| (x * scale) as f32));
        }
        Ok(w)
    }

    fn snake(&self, prefix: &str, c: usize) -> Result<Snake, CodecError> {
        Ok(Snake::new(
            self.get(&format!("{prefix}.alpha"), &[1, c, 1])?,
        ))
    }

    /// A causal conv `cin → cout` (torch weight `[cout, cin, k]`) at `prefix` (…`.conv`).
    #[allow(clippy::too_many_arguments)]
    fn conv(
        &self,
        prefix: &str,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
        dil: usize,
    ) -> Result<Conv1d, CodecError> {
        let w = self.conv_weight(prefix, &[cout, cin, k])?;
        let b = self.get(&format!("{prefix}.bias"), &[cout])?;
        Ok(Conv1d::new(&w, b, cout, cin, k, stride, dil))
    }

    fn convt(
        &self,
        prefix: &str,
        cin: usize,
        cout: usize,
        k: usize,
        stride: usize,
    ) -> Result<ConvTranspose1d, CodecError> {
        if k.checked_rem(stride) != Some(0) || k < stride {
            return Err(CodecError::Config(format!(
                "{prefix}: transposed conv kernel {k} is not a multiple of its stride {stride}"
            )));
        }
        let w = self.conv_weight(prefix, &[cin, cout, k])?;
        let b = self.get(&format!("{prefix}.bias"), &[cout])?;
        Ok(ConvTranspose1d::new(&w, b, cin, cout, k, stride))
    }

    fn res_unit(&self, prefix: &str, c: usize, dil: usize) -> Result<ResUnit, CodecError> {
        Ok(ResUnit {
            snake1: self.snake(&format!("{prefix}.block.0"), c)?,
            conv1: self.conv(&format!("{prefix}.block.1.conv"), c, c, 7, 1, dil)?,
            snake2: self.snake(&format!("{prefix}.block.2"), c)?,
            conv2: self.conv(&format!("{prefix}.block.3.conv"), c, c, 1, 1, 1)?,
        })
    }

    fn convnext(&self, prefix: &str, c: usize) -> Result<ConvNeXt, CodecError> {
        let hidden = 4 * c;
        let p = |s: &str| format!("{prefix}.{s}");
        Ok(ConvNeXt {
            dw: DwConv1d::new(
                &self.get(&p("dwconv.conv.weight"), &[c, 1, 7])?,
                self.get(&p("dwconv.conv.bias"), &[c])?,
                c,
                7,
            ),
            ln_w: self.get(&p("norm.weight"), &[c])?,
            ln_b: self.get(&p("norm.bias"), &[c])?,
            pw1_w: self.get(&p("pwconv1.weight"), &[hidden, c])?,
            pw1_b: self.get(&p("pwconv1.bias"), &[hidden])?,
            pw2_w: self.get(&p("pwconv2.weight"), &[c, hidden])?,
            pw2_b: self.get(&p("pwconv2.bias"), &[c])?,
            gamma: self.get(&p("gamma"), &[c])?,
            hidden,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn transformer(
        &self,
        prefix: &str,
        n_layer: usize,
        dim: usize,
        heads: usize,
        hd: usize,
        ffn: usize,
        eps: f32,
        window: usize,
        rope_base: f64,
    ) -> Result<Transformer, CodecError> {
        let w = heads * hd;
        let mut layers = Vec::with_capacity(n_layer);
        for l in 0..n_layer {
            let p = |s: &str| format!("{prefix}.layers.{l}.{s}");
            layers.push(TfLayer {
                attn_norm: self.get(&p("attention_norm.weight"), &[dim])?,
                wqkv: self.get(&p("attention.wqkv.weight"), &[3 * w, dim])?,
                wo: self.get(&p("attention.wo.weight"), &[dim, w])?,
                ffn_norm: self.get(&p("ffn_norm.weight"), &[dim])?,
                w1: self.get(&p("feed_forward.w1.weight"), &[ffn, dim])?,
                w3: self.get(&p("feed_forward.w3.weight"), &[ffn, dim])?,
                w2: self.get(&p("feed_forward.w2.weight"), &[dim, ffn])?,
                gamma_attn: self.get(&p("attention_layer_scale.gamma"), &[dim])?,
                gamma_ffn: self.get(&p("ffn_layer_scale.gamma"), &[dim])?,
            });
        }
        // One layer more than configured would be silently ignored: refuse it.
        let extra = format!("{prefix}.layers.{n_layer}.attention.wqkv.weight");
        if self.has(&extra) {
            return Err(CodecError::Config(format!(
                "{prefix}: codec.pth has more than the configured {n_layer} layers ({extra})"
            )));
        }
        Ok(Transformer {
            layers,
            norm: self.get(&format!("{prefix}.norm.weight"), &[dim])?,
            dim,
            heads,
            hd,
            ffn,
            eps,
            window,
            rope: Rope::new(hd, rope_base),
        })
    }

    fn vq(&self, prefix: &str, dim: usize, cb: usize, n: usize) -> Result<Vq, CodecError> {
        let in_w = self.conv_weight(&format!("{prefix}.in_proj"), &[cb, dim, 1])?;
        let out_w = self.conv_weight(&format!("{prefix}.out_proj"), &[dim, cb, 1])?;
        let codebook = self.get(&format!("{prefix}.codebook.weight"), &[n, cb])?;
        let (codebook_n, cn2) = crate::normalised_codebook(&codebook, cb);
        Ok(Vq {
            in_w,
            in_b: self.get(&format!("{prefix}.in_proj.bias"), &[cb])?,
            out_w,
            out_b: self.get(&format!("{prefix}.out_proj.bias"), &[dim])?,
            codebook,
            codebook_n,
            cn2,
            n,
            cb,
            dim,
        })
    }
}

pub(crate) fn build(s: &Store, cfg: CodecConfig) -> Result<Inner, CodecError> {
    let latent = cfg.latent_dim();

    // Encoder: Conv7(1→d) → blocks [RU×3, Snake, Conv(k=2s, s), transformer?] → Snake → Conv3.
    let mut d = cfg.encoder_dim;
    let enc_in = s.conv("encoder.block.0.conv", 1, d, 7, 1, 1)?;
    let mut enc_blocks = Vec::new();
    for (i, (&stride, &n_t)) in cfg
        .encoder_rates
        .iter()
        .zip(&cfg.encoder_transformer_layers)
        .enumerate()
    {
        let p = format!("encoder.block.{}", i + 1);
        let (half, full) = (d, 2 * d);
        let res = [1, 3, 9]
            .iter()
            .enumerate()
            .map(|(j, &dil)| s.res_unit(&format!("{p}.block.{j}"), half, dil))
            .collect::<Result<Vec<_>, _>>()?;
        let snake = s.snake(&format!("{p}.block.3"), half)?;
        let conv = s.conv(
            &format!("{p}.block.4.conv"),
            half,
            full,
            2 * stride,
            stride,
            1,
        )?;
        let transformer = if n_t > 0 {
            let (heads, ffn) = cfg
                .encoder_transformer_shape(full)
                .map_err(|e| CodecError::Config(format!("{p}: {e}")))?;
            Some(s.transformer(
                &format!("{p}.block.5"),
                n_t,
                full,
                heads,
                cfg.encoder_head_dim,
                ffn,
                cfg.encoder_norm_eps,
                cfg.encoder_window,
                cfg.encoder_rope_base,
            )?)
        } else {
            None
        };
        enc_blocks.push(EncBlock {
            res,
            snake,
            conv,
            transformer,
        });
        d = full;
    }
    let nb = cfg.encoder_rates.len();
    let enc_snake = s.snake(&format!("encoder.block.{}", nb + 1), d)?;
    let enc_out = s.conv(
        &format!("encoder.block.{}.conv", nb + 2),
        d,
        latent,
        3,
        1,
        1,
    )?;

    // Quantizer.
    let q = &cfg.quantizer;
    let dim = q.dim;
    let semantic = s.vq(
        "quantizer.semantic_quantizer.quantizers.0",
        dim,
        cfg.codebook_dim,
        cfg.semantic_codebook_size,
    )?;
    let residual = (0..cfg.n_codebooks)
        .map(|i| {
            s.vq(
                &format!("quantizer.quantizer.quantizers.{i}"),
                dim,
                cfg.codebook_dim,
                cfg.codebook_size,
            )
        })
        .collect::<Result<Vec<_>, _>>()?;
    let mut down = Vec::new();
    for (i, &f) in cfg.downsample_factor.iter().enumerate() {
        let p = format!("quantizer.downsample.{i}");
        down.push((
            s.conv(&format!("{p}.0.conv"), dim, dim, f, f, 1)?,
            s.convnext(&format!("{p}.1"), dim)?,
        ));
    }
    // upsample.j undoes downsample factor n−1−j.
    let mut up = Vec::new();
    for (j, &f) in cfg.downsample_factor.iter().rev().enumerate() {
        let p = format!("quantizer.upsample.{j}");
        up.push((
            s.convt(&format!("{p}.0.conv"), dim, dim, f, f)?,
            s.convnext(&format!("{p}.1"), dim)?,
        ));
    }
    let tf = |name: &str| {
        s.transformer(
            name,
            q.n_layer,
            dim,
            q.n_head,
            q.head_dim,
            q.intermediate_size,
            q.norm_eps,
            q.window,
            q.rope_base,
        )
    };
    let pre = tf("quantizer.pre_module")?;
    let post = tf("quantizer.post_module")?;

    // Decoder: Conv7(latent→D) → blocks [Snake, ConvT(k=2s, s), RU×3] → Snake → Conv7(→1).
    let dd = cfg.decoder_dim;
    let dec_in = s.conv("decoder.model.0.conv", latent, dd, 7, 1, 1)?;
    let mut dec_blocks = Vec::new();
    let mut cin = dd;
    for (i, &stride) in cfg.decoder_rates.iter().enumerate() {
        let p = format!("decoder.model.{}", i + 1);
        let cout = dd >> (i + 1);
        dec_blocks.push(DecBlock {
            snake: s.snake(&format!("{p}.block.0"), cin)?,
            convt: s.convt(&format!("{p}.block.1.conv"), cin, cout, 2 * stride, stride)?,
            res: [1, 3, 9]
                .iter()
                .enumerate()
                .map(|(j, &dil)| s.res_unit(&format!("{p}.block.{}", j + 2), cout, dil))
                .collect::<Result<Vec<_>, _>>()?,
        });
        cin = cout;
    }
    let nd = cfg.decoder_rates.len();
    let dec_snake = s.snake(&format!("decoder.model.{}", nd + 1), cin)?;
    let dec_out = s.conv(&format!("decoder.model.{}.conv", nd + 2), cin, 1, 7, 1, 1)?;

    Ok(Inner {
        cfg,
        enc_in,
        enc_blocks,
        enc_snake,
        enc_out,
        semantic,
        residual,
        down,
        pre,
        post,
        up,
        dec_in,
        dec_blocks,
        dec_snake,
        dec_out,
    })
}
