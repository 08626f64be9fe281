//! Which CUDA path a linear takes for its shape, weight type and addresses, with the tile
//! plans and scratch those paths need.

use super::GEMV_ROWS_LIMIT;
use super::LinearKernel;
use crate::tensor::DType;

/// How `iq4g_tile` (dequant/dequant.cuh) splits an IQ4_NL product of 256·`nch` inputs: `rt`
/// row slots a block (for SwiGLU half gate rows, half the same up rows), `kp` K parts of
/// whole 256-value chunks (at most `cw` each), one thread a (row, part): `threads` = rt·kp
/// rounded up to whole warps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RowsPlan {
    pub rt: usize,
    pub kp: usize,
    pub threads: usize,
    pub(super) cw: usize,
}

impl RowsPlan {
    /// The split that spreads `slots` matrices of `n_out` rows best over `sms` multiprocessors.
    /// Cost model: the busiest multiprocessor's thread-chunks, ⌈blocks/sms⌉·threads·cw (the
    /// products are bandwidth- and issue-bound, so that is its time); ties go to more resident
    /// warps up to 12 a multiprocessor (latency hiding), then to two chunks a thread (the
    /// second lands while the first is decoded), then to smaller blocks. None when the K
    /// parts would not fit a block (more than 256 threads or ~110 KB of shared memory).
    pub(crate) fn choose(
        nch: usize,
        n_out: usize,
        slots: usize,
        swiglu: bool,
        sms: usize,
    ) -> Option<RowsPlan> {
        let sms = sms.max(1);
        let mut best: Option<((usize, usize, usize, usize), RowsPlan)> = None;
        for rt in [32usize, 16, 8, 4] {
            let outs = if swiglu { rt / 2 } else { rt };
            let blocks = n_out.div_ceil(outs) * slots;
            for kp in 1..=nch {
                let cw = nch.div_ceil(kp);
                let threads = (rt * kp).next_multiple_of(32);
                let plan = RowsPlan {
                    rt,
                    kp,
                    threads,
                    cw,
                };
                if threads > 256 || plan.smem_bytes(8) > 110 * 1024 {
                    continue;
                }
                let per_sm = blocks.div_ceil(sms);
                let cost = per_sm * threads * cw;
                let warps = (per_sm * threads / 32).min(12);
                let key = (cost, 12 - warps, cw.abs_diff(2), threads);
                if best.as_ref().is_none_or(|(k, _)| key < *k) {
                    best = Some((key, plan));
                }
            }
        }
        best.map(|(_, p)| p)
    }

    /// Dynamic shared memory for `nr` inputs at once: each thread's chunks (an odd number of
    /// 16-byte units, so a quarter-warp's reads hit distinct banks), then the K parts' sums.
    pub(crate) fn smem_bytes(&self, nr: usize) -> usize {
        let units = 9 * self.cw + usize::from(self.cw.is_multiple_of(2));
        self.threads * (units * 16 + nr * 4)
    }
}

/// (units a lane, rows a block, warps a block) of `gemv_bf16_dec_<JU>_<R>` for one token of a
/// BF16 weight with K = 8·u: short rows take four at a time; long ones are split over up to 8
/// warps until about 16 warps a multiprocessor are in flight (the small attention projections
/// are latency-bound), keeping at least 4 loads a lane. None past 32768 inputs.
pub(super) fn bf16_dec_plan(k: usize, o: usize, sms: usize) -> Option<(usize, usize, usize)> {
    let u = k / 8;
    let per_lane = u.div_ceil(32);
    if per_lane <= 4 {
        return Some((per_lane.next_power_of_two(), 4, 1));
    }
    let mut s = 1;
    while u.div_ceil(32 * s) > 16 {
        s *= 2;
        if s > 8 {
            return None;
        }
    }
    while s < 8 && o * s < sms * 16 && u.div_ceil(64 * s) >= 4 {
        s *= 2;
    }
    Some((u.div_ceil(32 * s).next_power_of_two().max(4), 1, s))
}

/// How `linear_skinny_bf16_<nt>` (linear/linear.cu) covers a BF16 product of `n` rows over
/// `tiles` 32-row weight tiles (both matrices of a pair) of `k` inputs: `nt` n8 tiles a warp
/// (8·nt tokens a grid row), K split `splits` ways of `per` 32-value chunks each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bf16SkinnyPlan {
    pub nt: usize,
    pub token_tiles: usize,
    pub splits: usize,
    pub per: usize,
}

/// Warps a skinny BF16 block has (`SKB_WARPS`), each a 32-row weight tile.
pub(crate) const BF16_SKINNY_BLOCK_WARPS: usize = 4;
/// Stages of a block's cp.async ring (`SKB_STAGES`).
const BF16_SKINNY_STAGES: usize = 4;
/// Multiprocessors a plan fills (an H200's 132) and the blocks of each it aims for: two
/// blocks, 8 warps with three chunks of 32 rows in flight each, keep ~48 KB a multiprocessor
/// in flight, about what the memory's latency asks at its full rate.
const BF16_SKINNY_SMS: usize = 132;
const BF16_SKINNY_BLOCKS_PER_SM: usize = 2;
/// The share of that wave a plan's K split fills before it stops splitting.
const BF16_SKINNY_FILL: f64 = 0.85;

impl Bf16SkinnyPlan {
    /// The plan for `n` rows, `k` inputs (a multiple of 32) and `outs` output columns in all
    /// over `tiles` tiles. K is split as little as fills [`BF16_SKINNY_FILL`] of
    /// [`BF16_SKINNY_BLOCKS_PER_SM`] blocks a multiprocessor (fewer, longer warps keep their
    /// rings streaming, and the partial sums cost traffic), and never so far that the partial
    /// sums' traffic (written and read once, mostly in L2) passes the weight's bytes or that a
    /// split has fewer than two chunks.
    pub(crate) fn choose(n: usize, k: usize, outs: usize, tiles: usize) -> Bf16SkinnyPlan {
        let nt = n.div_ceil(8).next_power_of_two().clamp(1, 8);
        let token_tiles = n.div_ceil(8 * nt).max(1);
        let nch = (k / 32).max(1);
        let groups = tiles.div_ceil(BF16_SKINNY_BLOCK_WARPS).max(1);
        let weight_bytes = 2 * k * outs;
        let by_traffic = weight_bytes / (2 * 4 * n.max(1) * outs.max(1));
        let most = by_traffic.min(nch / 2).max(1);
        let wave = BF16_SKINNY_FILL * (BF16_SKINNY_SMS * BF16_SKINNY_BLOCKS_PER_SM) as f64;
        let want = (1..=most)
            .find(|&s| (s * groups * token_tiles) as f64 >= wave)
            .unwrap_or(most);
        let per = nch.div_ceil(want);
        Bf16SkinnyPlan {
            nt,
            token_tiles,
            splits: nch.div_ceil(per),
            per,
        }
    }

    /// Dynamic shared memory of a block: its ring, a stage one chunk of every warp's 32 rows
    /// and of the block's 8·nt x rows (64 bytes each).
    pub(crate) fn shared_bytes(&self) -> usize {
        BF16_SKINNY_STAGES * (BF16_SKINNY_BLOCK_WARPS * 32 + 8 * self.nt) * 64
    }

    /// Scratch: x narrowed to bf16 (n·k), then the partial sums when K is split, each at a
    /// 256-byte boundary (256 spare bytes align the start).
    pub(crate) fn scratch_bytes(&self, n: usize, k: usize, outs: usize) -> usize {
        let xb = (n * k * 2).next_multiple_of(256);
        if self.splits <= 1 {
            256 + xb
        } else {
            256 + xb + self.splits * n * outs * 4
        }
    }
}

/// Whether the skinny BF16 product takes a weight of `k` inputs.
pub(crate) fn bf16_skinny_takes(k: usize) -> bool {
    k > 0 && k.is_multiple_of(32)
}

/// cuBLAS's workspace for the BF16 prefill GEMM, inside the op's scratch (NVIDIA's
/// recommendation for Hopper). Handing it over keeps a captured graph free of allocations.
pub(super) const CUBLAS_WORKSPACE: usize = 32 << 20;

/// Scratch of the prefill paths (n > 8, K % 32 == 0): x narrowed to bf16, then for BF16
/// weights cuBLAS's workspace, for the others the tiles' partial sums when K is split
/// ([`TqSplit`], sized for the most multiprocessors a launch plans with), each at a 256-byte
/// boundary (256 spare bytes align the start).
pub(super) fn prefill_scratch(dtype: DType, n: usize, k: usize, o: usize) -> usize {
    let ws = if dtype == DType::BF16 {
        CUBLAS_WORKSPACE
    } else {
        let fit = TqFit::choose(dtype, n, o, TQ_SPLIT_MAX_SMS);
        TqSplit::choose(fit, n, k, o, TQ_SPLIT_MAX_SMS).partial_bytes(n, o)
    };
    256 + (n * k * 2).next_multiple_of(256) + ws
}

/// Inputs a `linear_tq` K slice covers (`BK` in linear.cu).
pub(super) const TQ_BK: usize = 64;

/// The fewest K slices a split takes: the tiles' pipeline is three slices deep.
const TQ_SPLIT_MIN_SLICES: usize = 4;

/// Multiprocessors a split is planned for at most (the scratch is sized for this many; a card
/// with more plans as if it had these).
pub(super) const TQ_SPLIT_MAX_SMS: usize = 256;

/// How `linear_tq` splits K when its tiles leave multiprocessors idle: `splits` parts of
/// `per` K slices each, as many as the resident blocks' slots the tiles leave empty
/// ([`TqFit`]: two a multiprocessor, one for `One`), each at least [`TQ_SPLIT_MIN_SLICES`]
/// slices. The shared expert's gate (3584 → 1024) at a mixed step of 256 rows is 16 tiles:
/// unsplit it ran 16 blocks over the whole K on a 132-multiprocessor card.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct TqSplit {
    pub splits: usize,
    pub per: usize,
}

impl TqSplit {
    pub(super) fn choose(fit: TqFit, n: usize, k: usize, o: usize, sms: usize) -> TqSplit {
        let slices = k.div_ceil(TQ_BK).max(1);
        if fit == TqFit::Two {
            // More tiles than multiprocessors (and `linear_tq_*_x2` takes no split).
            return TqSplit {
                splits: 1,
                per: slices,
            };
        }
        let blocks = (o.div_ceil(128) * n.div_ceil(fit.tokens())).max(1);
        let resident = if fit == TqFit::One { 1 } else { 2 };
        let slots = resident * sms.min(TQ_SPLIT_MAX_SMS);
        let want = (slots / blocks).min(slices / TQ_SPLIT_MIN_SLICES).max(1);
        let per = slices.div_ceil(want);
        TqSplit {
            splits: slices.div_ceil(per),
            per,
        }
    }

    /// The partial sums' bytes in the scratch (none unsplit), with 256 bytes of alignment.
    pub(super) fn partial_bytes(&self, n: usize, o: usize) -> usize {
        if self.splits <= 1 {
            0
        } else {
            256 + self.splits * n * o * 4
        }
    }
}

/// Which `linear_tq_<type>_<fit>` (linear/linear.cu, 128 weight rows a block) runs: 128
/// tokens a block, one or two blocks a multiprocessor, or 32 / 64 tokens for a decode step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum TqFit {
    /// Two blocks a multiprocessor (128 registers a thread).
    Two,
    /// One block a multiprocessor, no register cap.
    One,
    /// Tiles of 32 tokens (at most 32 rows; two blocks a multiprocessor).
    Short32,
    /// Tiles of 64 tokens (33..=64 rows; two blocks a multiprocessor).
    Short64,
}

impl TqFit {
    pub(super) fn name(self) -> &'static str {
        match self {
            TqFit::Two => "x2",
            TqFit::One => "x1",
            TqFit::Short32 => "m32",
            TqFit::Short64 => "m64",
        }
    }

    /// Tokens a tile covers.
    pub(super) fn tokens(self) -> usize {
        match self {
            TqFit::Two | TqFit::One => 128,
            TqFit::Short32 => 32,
            TqFit::Short64 => 64,
        }
    }

    /// Three x stages of the tile's tokens and two decoded weight tiles of 128 rows, 72 bf16
    /// a row.
    pub(super) fn smem_bytes(self) -> u32 {
        ((3 * self.tokens() + 2 * 128) * 72 * 2) as u32
    }

    /// One block a multiprocessor when the grid gives each at most one anyway (measured on
    /// the H200: the shared expert's 3584->1024 at 1024 tokens 71 µs against 111 µs for
    /// two-a-multiprocessor blocks), and for F32 weights, whose raw registers do not fit
    /// 128; two otherwise (IQ4_NL 3584->9216, 1024 tokens: 287 µs against 353 µs).
    /// A decode step's few rows (F32 aside) take the short tiles: a 128-token tile at 8 rows
    /// is 94% padding, multiplied.
    pub(super) fn choose(dtype: DType, n: usize, o: usize, sms: usize) -> TqFit {
        if dtype != DType::F32 && n <= 32 {
            TqFit::Short32
        } else if dtype != DType::F32 && n <= 64 {
            TqFit::Short64
        } else if dtype == DType::F32 || o.div_ceil(128) * n.div_ceil(128) <= sms {
            TqFit::One
        } else {
            TqFit::Two
        }
    }
}

/// Warps a `gemv_q6_k_mma` block has (`Q6M_WARPS`), each streaming 16-row tiles.
const Q6M_WARPS: usize = 8;
/// Bytes a ring slot holds: 16 rows of one staged Q6_K block (`Q6M_STAGE`).
const Q6M_STAGE: usize = 16 * 240;
/// The most dynamic shared memory a block may have (227 KiB on compute capability 9.0).
const Q6M_SMEM_LIMIT: usize = 227 * 1024;

/// How `gemv_q6_k_mma_<tiles>` (linear/linear.cu) covers a Q6_K product of n ≤ 8 tokens:
/// `tiles` n8 column tiles (two tokens each: a token is four signed-byte limbs), `stages`
/// ring slots a warp, `blocks` blocks of [`Q6M_WARPS`] warps (one a multiprocessor, no more
/// than the 16-row tiles need).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Q6kMmaPlan {
    pub tiles: usize,
    pub stages: usize,
    pub blocks: usize,
}

impl Q6kMmaPlan {
    /// None past 8 tokens, for K not whole Q6_K blocks, or when x's fragments and the rings
    /// would not fit a block's shared memory (K past 13,568 inputs at one tile, 4,352 at four).
    pub(crate) fn choose(n: usize, k: usize, o: usize, sms: usize) -> Option<Q6kMmaPlan> {
        if n == 0 || n > 8 || k == 0 || !k.is_multiple_of(256) || o == 0 {
            return None;
        }
        let tiles = n.div_ceil(2).next_power_of_two();
        let plan = Q6kMmaPlan {
            tiles,
            // The kernels' template arguments (GEMV_Q6M in linear.cu).
            stages: if tiles == 1 { 4 } else { 3 },
            blocks: o.div_ceil(16).div_ceil(Q6M_WARPS).clamp(1, sms.max(1)),
        };
        (plan.smem_bytes(k) <= Q6M_SMEM_LIMIT).then_some(plan)
    }

    /// Dynamic shared memory: x's fragments (128 bytes a 16-value group and tile), then the
    /// warps' rings.
    pub(crate) fn smem_bytes(&self, k: usize) -> usize {
        (k / 16) * self.tiles * 128 + Q6M_WARPS * self.stages * Q6M_STAGE
    }

    pub(crate) fn threads(&self) -> usize {
        32 * Q6M_WARPS
    }
}

pub(super) enum LinearPath {
    /// IQ4_NL, n ≤ 8, K a multiple of 256: `gemv_iq4_nl_rows_<nr>` split as planned.
    Iq4Rows(usize, RowsPlan),
    /// BF16, n = 1: `gemv_bf16_dec_<JU>_<R>` with S warps a block.
    Bf16Dec(usize, usize, usize),
    /// Q6_K, n ≤ 8, K a multiple of 256: `gemv_q6_k_mma_<tiles>` ([`Q6kMmaPlan`]).
    Q6kMma(Q6kMmaPlan),
    Gemv(usize),
    /// BF16, n > 8: x narrowed to bf16, then one cuBLAS GEMM.
    Cublas,
    /// Other types, n > 8: x narrowed to bf16, then `linear_tq_<type>_<fit>`.
    Tiles(TqFit),
    /// IQ4_NL with whole 256-value k-tiles: the skinny product, the matrix as one expert.
    Skinny,
    /// BF16, K a multiple of 32: `linear_skinny_bf16_<nt>` as planned.
    Bf16Skinny(Bf16SkinnyPlan),
    Generic,
}

/// Which kernel a call takes within its family. GEMV: the IQ4_NL row GEMV when K is whole
/// 256-value chunks, the BF16 decode GEMV for one token, otherwise the GEMV when K is whole
/// units of the weight's 16-byte decode group (4 F32, 8 F16/BF16, 32 Q8_0/IQ4_NL, 256 Q6_K).
/// Tensor cores: when K % 32 == 0, cuBLAS for BF16 and the bf16 tiles for the other types.
/// Otherwise (and for views not 16-byte aligned) the element-wise fallback.
pub(super) fn linear_path(
    kernel: LinearKernel,
    dtype: DType,
    (n, k, o): (usize, usize, usize),
    x_ptr: u64,
    w_ptr: u64,
    sms: usize,
) -> LinearPath {
    let unit = match dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 8,
        DType::Q8_0 | DType::IQ4_NL => 32,
        DType::Q6_K => 256,
        DType::I32 => return LinearPath::Generic,
    };
    if k == 0 || !x_ptr.is_multiple_of(16) || !w_ptr.is_multiple_of(16) {
        return LinearPath::Generic;
    }
    if kernel == LinearKernel::Skinny && super::skinny_takes(dtype, k) {
        if dtype == DType::BF16 {
            return LinearPath::Bf16Skinny(Bf16SkinnyPlan::choose(n, k, o, o.div_ceil(32)));
        }
        return LinearPath::Skinny;
    }
    let gemv = matches!(kernel, LinearKernel::Gemv { .. }) && n <= GEMV_ROWS_LIMIT;
    if gemv
        && dtype == DType::IQ4_NL
        && k.is_multiple_of(256)
        && let Some(plan) = RowsPlan::choose(k / 256, o, 1, false, sms)
    {
        return LinearPath::Iq4Rows(n.next_power_of_two(), plan);
    }
    if gemv
        && n == 1
        && dtype == DType::BF16
        && k.is_multiple_of(8)
        && let Some((ju, r, s)) = bf16_dec_plan(k, o, sms)
    {
        return LinearPath::Bf16Dec(ju, r, s);
    }
    if gemv
        && dtype == DType::Q6_K
        && let Some(plan) = Q6kMmaPlan::choose(n, k, o, sms)
    {
        return LinearPath::Q6kMma(plan);
    }
    if gemv && k.is_multiple_of(unit) {
        LinearPath::Gemv(n.next_power_of_two())
    } else if matches!(kernel, LinearKernel::TensorCore | LinearKernel::Skinny)
        && k.is_multiple_of(32)
    {
        if dtype == DType::BF16 {
            LinearPath::Cublas
        } else {
            LinearPath::Tiles(TqFit::choose(dtype, n, o, sms))
        }
    } else {
        LinearPath::Generic
    }
}
