//! YaRN rotary embedding in llama.cpp's NORM mode (adjacent pairs, in place), spec §3.5.
//!
//! Everything is f32 and follows ggml's order of operations (`ggml_rope_yarn_corr_dims`,
//! `ggml_rope_cache_init`, `rope_yarn`), so angles and magnitudes match llama.cpp to f32
//! rounding: the angle of pair `i` is built by `i` repeated f32 multiplications, not by `powf`.

use std::fmt;

/// The rope parameters as ggml's `rope_ext` receives them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeParams {
    /// Rotated dimensions (an even number; `qk_rope_head_dim`).
    pub n_rot: usize,
    pub freq_base: f32,
    /// `1 / factor`.
    pub freq_scale: f32,
    /// 1 for YaRN, 0 for plain (linear) scaling.
    pub ext_factor: f32,
    /// The context's attention factor, already divided by the magnitude ggml multiplies back in.
    pub attn_factor: f32,
    pub beta_fast: f32,
    pub beta_slow: f32,
    pub n_ctx_orig: usize,
}

/// YaRN hyper-parameters as the checkpoint states them.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Yarn {
    /// `rope.scaling.factor`; 0 means no scaling (llama.cpp's convention).
    pub factor: f32,
    /// `rope.scaling.original_context_length`.
    pub n_ctx_orig: usize,
    pub beta_fast: f32,
    pub beta_slow: f32,
    /// HF `rope_scaling.mscale` (llama.cpp assumes 1).
    pub mscale: f32,
    /// HF `rope_scaling.mscale_all_dim` = llama.cpp `rope_yarn_log_mul` (the GGUF key ÷ 0.1).
    pub mscale_all_dim: f32,
}

/// HF / llama.cpp `get_mscale`, in f32 as llama.cpp evaluates it.
fn get_mscale(scale: f32, mscale: f32) -> f32 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1f32 * mscale * scale.ln() + 1.0
    }
}

/// `corr_dim(n) = n_rot·ln(n_ctx_orig / (2π·n)) / (2·ln base)` (ggml `ggml_rope_yarn_corr_dim`).
fn corr_dim(n_rot: usize, n_ctx_orig: usize, n: f32, base: f32) -> f32 {
    n_rot as f32 * (n_ctx_orig as f32 / (n * 2.0 * std::f32::consts::PI)).ln() / (2.0 * base.ln())
}

/// YaRN correction range `[low, high]` in pair indices (ggml `ggml_rope_yarn_corr_dims`).
pub fn corr_dims(
    n_rot: usize,
    n_ctx_orig: usize,
    freq_base: f32,
    beta_fast: f32,
    beta_slow: f32,
) -> [f32; 2] {
    let start = corr_dim(n_rot, n_ctx_orig, beta_fast, freq_base).floor();
    let end = corr_dim(n_rot, n_ctx_orig, beta_slow, freq_base).ceil();
    [start.max(0.0), end.min(n_rot as f32 - 1.0)]
}

impl RopeParams {
    /// The parameters llama.cpp derives from YaRN hyper-parameters (llama-context ctor):
    /// `freq_scale = 1/factor`, `ext_factor = 1`, and an attention factor of
    /// `get_mscale(f, mscale)/get_mscale(f, mscale_all_dim) / (1 + 0.1·ln f)`, the divisor
    /// cancelling the magnitude `rope_yarn` multiplies back in. For this model the two
    /// cancel, so cos/sin are scaled by 1.0 up to f32 rounding.
    pub fn yarn(n_rot: usize, freq_base: f32, y: &Yarn) -> RopeParams {
        let freq_scale = if y.factor == 0.0 { 1.0 } else { 1.0 / y.factor };
        let factor = 1.0 / freq_scale;
        let mut attn_factor = if y.mscale_all_dim != 0.0 {
            get_mscale(factor, y.mscale) / get_mscale(factor, y.mscale_all_dim)
        } else {
            get_mscale(factor, 1.0)
        };
        attn_factor *= 1.0 / (1.0 + 0.1 * factor.ln());
        RopeParams {
            n_rot,
            freq_base,
            freq_scale,
            ext_factor: 1.0,
            attn_factor,
            beta_fast: y.beta_fast,
            beta_slow: y.beta_slow,
            n_ctx_orig: y.n_ctx_orig,
        }
    }

    pub fn corr_dims(&self) -> [f32; 2] {
        corr_dims(
            self.n_rot,
            self.n_ctx_orig,
            self.freq_base,
            self.beta_fast,
            self.beta_slow,
        )
    }

    /// The factor cos and sin are multiplied by (ggml `rope_yarn`'s `mscale`).
    pub fn magnitude(&self) -> f32 {
        let mut m = self.attn_factor;
        if self.ext_factor != 0.0 {
            m *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
        }
        m
    }

    /// The position-independent constants of the angles, computed once on the host; the
    /// CUDA rope receives exactly these, so its angles round like [`RopeParams::cos_sin`]'s.
    pub fn consts(&self) -> RopeConsts {
        RopeConsts {
            theta_scale: self.freq_base.powf(-2.0 / self.n_rot as f32),
            freq_scale: self.freq_scale,
            ext_factor: self.ext_factor,
            corr: self.corr_dims(),
            mscale: self.magnitude(),
        }
    }

    /// Writes `[cos θ_0, sin θ_0, cos θ_1, sin θ_1, …]` (times the magnitude) for position
    /// `pos` into `cache` (the first `n_rot` entries; a shorter cache gets the pairs that fit).
    pub fn cos_sin(&self, pos: i32, cache: &mut [f32]) {
        let k = self.consts();
        let mut theta_extrap = pos as f32;
        for (i, cs) in cache.chunks_exact_mut(2).take(self.n_rot / 2).enumerate() {
            let theta_interp = k.freq_scale * theta_extrap;
            let mut theta = theta_interp;
            if k.ext_factor != 0.0 {
                let ramp_mix = ramp(k.corr[0], k.corr[1], i) * k.ext_factor;
                theta = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
            }
            cs[0] = theta.cos() * k.mscale;
            cs[1] = theta.sin() * k.mscale;
            theta_extrap *= k.theta_scale;
        }
    }
}

/// What the rope angles need besides the position and the pair index (see
/// [`RopeParams::consts`]): `θ_extrap(i) = pos·theta_scale^i` by repeated multiplication,
/// blended over the correction range `corr`, cos/sin times `mscale`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConsts {
    pub theta_scale: f32,
    pub freq_scale: f32,
    pub ext_factor: f32,
    pub corr: [f32; 2],
    pub mscale: f32,
}

impl fmt::Display for RopeParams {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rope(n_rot={} freq_base={:?} freq_scale={:?} ext_factor={:?} attn_factor={:?} \
             beta_fast={:?} beta_slow={:?} n_ctx_orig={})",
            self.n_rot,
            self.freq_base,
            self.freq_scale,
            self.ext_factor,
            self.attn_factor,
            self.beta_fast,
            self.beta_slow,
            self.n_ctx_orig
        )
    }
}

/// 1 below the correction range (keep the original frequency), 0 above it (interpolate),
/// linear between; over the pair index.
fn ramp(low: f32, high: f32, pair: usize) -> f32 {
    let y = (pair as f32 - low) / (high - low).max(0.001);
    1.0 - y.clamp(0.0, 1.0)
}

/// Rotates adjacent pairs `(v[2i], v[2i+1])` of the first `n_rot` values of `v` in place
/// with a cache from [`RopeParams::cos_sin`]. Values past `n_rot` are untouched.
pub fn rope_norm_cached(v: &mut [f32], cache: &[f32]) {
    for (x, cs) in v.chunks_exact_mut(2).zip(cache.chunks_exact(2)) {
        let (x0, x1) = (x[0], x[1]);
        x[0] = x0 * cs[0] - x1 * cs[1];
        x[1] = x0 * cs[1] + x1 * cs[0];
    }
}

/// NORM-mode rope of `v` (its first `p.n_rot` values) at absolute position `pos`, in place.
pub fn rope_norm_in_place(v: &mut [f32], pos: i32, p: &RopeParams) {
    let mut cache = vec![0f32; p.n_rot];
    p.cos_sin(pos, &mut cache);
    rope_norm_cached(v, &cache);
}

/// The attention score scale llama.cpp's deepseek2/xing4 graph uses:
/// `mscale²/√qk_head_dim` with `mscale = attn_factor_org·(1 + 0.1·mscale_all_dim·ln factor)`,
/// where `attn_factor_org` undoes the cancelling divisor in `p.attn_factor` (≈1 here).
/// `qk_head_dim` is `qk_nope + qk_rope` (192), not the absorbed width (576).
pub fn kq_scale(p: &RopeParams, mscale_all_dim: f32, qk_head_dim: usize) -> f32 {
    let ln_factor = (1.0 / p.freq_scale).ln();
    let attn_factor_org = p.attn_factor * (1.0 + 0.1 * ln_factor);
    let mscale = attn_factor_org * (1.0 + 0.1 * mscale_all_dim * ln_factor);
    mscale * mscale / (qk_head_dim as f32).sqrt()
}
