//! The harness the op tests share: for the CPU tests, tensors in 4-byte-aligned storage, ops
//! run through the `Op` trait with NaN-poisoned outputs (the generator is `ops::parity::Rng`);
//! for the GPU tests, the kernel variant the graph's lowering would give an op of a given size;
//! for the attention tests of both, sequences laid out in a paged cache pool ([`PagedPool`]).

#![allow(dead_code)]

use ops::hc::{HcPre, HcPreKernel};
use ops::linear::{GEMV_ROWS_LIMIT, LinearKernel};
use ops::mla::{AttentionPath, HEAD_GEMV_ROWS_LIMIT, HeadKernel, MlaAttention};
use ops::moe::{ExpertKernel, GEMV_ROUTES_LIMIT, RouterKernel, TopKKernel};
use ops::moe_prefill::TcKernel;
use ops::parity::Rng;
use ops::{DType, HostTensor, HostTensorMut, Op, OpError, TensorMeta};

#[derive(Clone, Debug)]
pub struct Buf {
    pub meta: TensorMeta,
    pub words: Vec<u32>,
}

impl Buf {
    pub fn f32(shape: &[usize], v: &[f32]) -> Buf {
        assert_eq!(shape.iter().product::<usize>(), v.len());
        Buf {
            meta: TensorMeta::f32(shape),
            words: v.iter().map(|x| x.to_bits()).collect(),
        }
    }

    pub fn i32(shape: &[usize], v: &[i32]) -> Buf {
        Buf {
            meta: TensorMeta::i32(shape),
            words: v.iter().map(|&x| x as u32).collect(),
        }
    }

    pub fn raw(meta: TensorMeta, bytes: &[u8]) -> Buf {
        let words = bytes
            .chunks(4)
            .map(|c| {
                let mut w = [0u8; 4];
                w[..c.len()].copy_from_slice(c);
                u32::from_le_bytes(w)
            })
            .collect();
        Buf { meta, words }
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: u32 storage viewed as its bytes; u8 has no alignment or validity needs.
        unsafe {
            std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.words.len() * 4)
        }
    }

    pub fn f32s(&self) -> Vec<f32> {
        self.words.iter().map(|&w| f32::from_bits(w)).collect()
    }
}

pub fn bytes_mut(w: &mut [u32]) -> &mut [u8] {
    // SAFETY: as `Buf::bytes`, exclusively borrowed.
    unsafe { std::slice::from_raw_parts_mut(w.as_mut_ptr() as *mut u8, w.len() * 4) }
}

/// Runs `op` into the given output buffers.
pub fn run_into(op: &dyn Op, inputs: &[&Buf], mut outs: Vec<Buf>) -> Result<Vec<Buf>, OpError> {
    let ins: Vec<HostTensor<'_>> = inputs
        .iter()
        .map(|b| HostTensor::new(&b.meta, b.bytes()))
        .collect();
    let mut views: Vec<HostTensorMut<'_>> = outs
        .iter_mut()
        .map(|b| HostTensorMut::new(&b.meta, bytes_mut(&mut b.words)))
        .collect();
    op.cpu(&ins, &mut views)?;
    drop(views);
    Ok(outs)
}

/// Runs `op` into fresh outputs poisoned with NaN, so an unwritten element shows.
pub fn run(op: &dyn Op, inputs: &[&Buf]) -> Result<Vec<Buf>, OpError> {
    let metas: Vec<&TensorMeta> = inputs.iter().map(|b| &b.meta).collect();
    let outs = op
        .infer(&metas)?
        .into_iter()
        .map(|m| Buf {
            words: vec![f32::NAN.to_bits(); m.numel()],
            meta: m,
        })
        .collect();
    run_into(op, inputs, outs)
}

// ---- kernel variants ----------------------------------------------------------------------
//
// A test-side mirror of what `graph::lower` picks with `LoweringOptions::default()`
// (graph/src/lower.rs): no op chooses its own CUDA kernel, so a GPU test that runs an op over a
// range of sizes gives it the variant a lowered plan would carry at that size. `ops` cannot
// depend on `graph`, so the rules are restated here, one function a family; keep them in step
// with lower.rs's defaults. Tests that pin one path on purpose name the variant themselves.

/// `LoweringOptions::default().router_tiled_min_rows`.
pub const ROUTER_TILED_MIN_ROWS: usize = 512;
/// `LoweringOptions::default().topk_inverse_min_rows`.
pub const TOPK_INVERSE_MIN_ROWS: usize = 132;
/// `LoweringOptions::default().hc_rows_min_rows`.
pub const HC_ROWS_MIN_ROWS: usize = 64;
/// `LoweringOptions::default().hc_rows_chunks_per_warp`.
pub const HC_ROWS_CHUNKS_PER_WARP: usize = 1;
/// `LoweringOptions::default().attention_flash_min_rows`.
pub const ATTENTION_FLASH_MIN_ROWS: usize = 256;

/// `Linear`, `LinearPair`, `NormLinear` and `GateUpSwiGlu` over `rows` rows: the GEMV (weights
/// first) up to [`GEMV_ROWS_LIMIT`] rows, the tensor cores beyond.
pub fn linear_for(rows: usize) -> LinearKernel {
    if rows <= GEMV_ROWS_LIMIT {
        LinearKernel::Gemv {
            weights_first: true,
        }
    } else {
        LinearKernel::TensorCore
    }
}

/// `MlaQuery`'s and `MlaValueOut`'s per-head products over `tokens` tokens: the GEMV up to
/// [`HEAD_GEMV_ROWS_LIMIT`], the tensor cores beyond.
pub fn head_for(tokens: usize) -> HeadKernel {
    if tokens <= HEAD_GEMV_ROWS_LIMIT {
        HeadKernel::Gemv
    } else {
        HeadKernel::TensorCore
    }
}

/// `ExpertSwiGlu` and `ExpertDown` over `routes` routes on a device of `compute_capability`: the
/// GEMV up to [`GEMV_ROUTES_LIMIT`], beyond it the grouped GEMM (warpgroup MMAs on 9.0,
/// `mma.sync` elsewhere).
pub fn expert_for(routes: usize, compute_capability: (u32, u32)) -> ExpertKernel {
    if routes <= GEMV_ROUTES_LIMIT {
        return ExpertKernel::Gemv;
    }
    ExpertKernel::Grouped(TcKernel::fastest_on(compute_capability))
}

/// `Router` over `tokens` tokens: the tiled logits from [`ROUTER_TILED_MIN_ROWS`], the split-K
/// slices below.
pub fn router_for(tokens: usize) -> RouterKernel {
    if tokens >= ROUTER_TILED_MIN_ROWS {
        RouterKernel::Tiled
    } else {
        RouterKernel::Slices
    }
}

/// `TopKSum` over `tokens` tokens: the inverse route table from [`TOPK_INVERSE_MIN_ROWS`], the
/// scan below.
pub fn topk_for(tokens: usize) -> TopKKernel {
    if tokens >= TOPK_INVERSE_MIN_ROWS {
        TopKKernel::InverseTable
    } else {
        TopKKernel::Scan
    }
}

/// `pre`'s partial pass (alone or inside `HcPreNorm` / `HcPostPreNorm`) over `tokens` tokens
/// of streams `d` wide and an `fn` of `fn_dtype`: the tensor-core rows pass from
/// [`HC_ROWS_MIN_ROWS`] where [`HcPre::rows_supports`] the shape, split-K otherwise.
pub fn hc_pre_for(pre: &HcPre, tokens: usize, d: usize, fn_dtype: DType) -> HcPreKernel {
    if tokens >= HC_ROWS_MIN_ROWS && pre.rows_supports(d, fn_dtype) {
        HcPreKernel::Rows {
            chunks_per_warp: HC_ROWS_CHUNKS_PER_WARP,
        }
    } else {
        HcPreKernel::SplitK
    }
}

/// `att` over `tokens` tokens and cache rows `width` wide: the flash kernel from
/// [`ATTENTION_FLASH_MIN_ROWS`] where [`MlaAttention::flash_supports`] the width, split-K
/// otherwise.
pub fn attention_for(att: &MlaAttention, tokens: usize, width: usize) -> AttentionPath {
    if tokens >= ATTENTION_FLASH_MIN_ROWS && att.flash_supports(width) {
        AttentionPath::Flash
    } else {
        AttentionPath::SplitK
    }
}

// ---- paged latent caches ------------------------------------------------------------------

/// Several sequences' positions in a pool of cache blocks, the table the attention reads them
/// through: each sequence's blocks are drawn from a shuffled (or, with `shuffle` off, the
/// natural) order of the pool, every table is `width` entries wide (entries past a sequence's
/// last block name a spare block), and the pool has blocks no sequence owns.
#[derive(Clone, Debug)]
pub struct PagedPool {
    pub block_size: usize,
    /// Table entries a sequence: its attention may reach `width · block_size` positions.
    pub width: usize,
    pub pool_blocks: usize,
    /// `seqs × width` block ids.
    pub table: Vec<i32>,
    /// The positions each sequence holds.
    pub lens: Vec<usize>,
}

impl PagedPool {
    /// Sequences of `lens` positions (each at least 1) in blocks of `block_size`, tables
    /// `extra_width` entries wider than the longest needs, two blocks of the pool owned by none.
    pub fn new(
        r: &mut Rng,
        lens: &[usize],
        block_size: usize,
        extra_width: usize,
        shuffle: bool,
    ) -> PagedPool {
        assert!(
            !lens.is_empty() && lens.iter().all(|&l| l > 0) && block_size > 0,
            "sequences {lens:?} in blocks of {block_size}"
        );
        let need: Vec<usize> = lens.iter().map(|&l| l.div_ceil(block_size)).collect();
        let width = need.iter().copied().max().unwrap_or(0) + extra_width;
        let pool_blocks = need.iter().sum::<usize>() + 2;
        let mut order: Vec<i32> = (0..pool_blocks as i32).collect();
        if shuffle {
            // Fisher–Yates.
            for i in (1..order.len()).rev() {
                order.swap(i, r.below(i + 1));
            }
        }
        let spare = order[pool_blocks - 1];
        let mut table = vec![spare; lens.len() * width];
        let mut next = 0;
        for (s, &k) in need.iter().enumerate() {
            for b in 0..k {
                table[s * width + b] = order[next];
                next += 1;
            }
        }
        PagedPool {
            block_size,
            width,
            pool_blocks,
            table,
            lens: lens.to_vec(),
        }
    }

    pub fn seqs(&self) -> usize {
        self.lens.len()
    }

    /// The positions a sequence's table reaches (what the attention's split is sized by).
    pub fn reach(&self) -> usize {
        self.width * self.block_size
    }

    pub fn pool_rows(&self) -> usize {
        self.pool_blocks * self.block_size
    }

    /// The pool row of position `p` of sequence `s`.
    pub fn row(&self, s: usize, p: usize) -> usize {
        self.table[s * self.width + p / self.block_size] as usize * self.block_size
            + p % self.block_size
    }

    /// The pool (`pool_rows × w`) holding `seqs[s]` (`lens[s] × w` values) at each sequence's
    /// rows, NaN in every row no sequence holds.
    pub fn scatter(&self, seqs: &[Vec<f32>], w: usize) -> Vec<f32> {
        let mut pool = vec![f32::NAN; self.pool_rows() * w];
        for (s, rows) in seqs.iter().enumerate() {
            assert_eq!(rows.len(), self.lens[s] * w, "sequence {s}");
            for (p, row) in rows.chunks_exact(w).enumerate() {
                let at = self.row(s, p);
                pool[at * w..(at + 1) * w].copy_from_slice(row);
            }
        }
        pool
    }

    /// `rows` (one sequence's `len × w` values) as a cache of its own over the same reach
    /// (`reach() × w`, blocks in order), NaN past its positions.
    pub fn contiguous(&self, rows: &[f32], w: usize) -> Vec<f32> {
        let mut cache = vec![f32::NAN; self.reach() * w];
        cache[..rows.len()].copy_from_slice(rows);
        cache
    }

    /// The identity table of [`PagedPool::contiguous`]'s cache: one sequence, blocks in order.
    pub fn contiguous_table(&self) -> Vec<i32> {
        (0..self.width as i32).collect()
    }
}

/// The rows of sequence `s` in a step of several: their indices, their queries (`width` values
/// a row, in order) and their positions, to run that sequence alone.
pub fn sequence_rows(
    s: usize,
    q: &[f32],
    width: usize,
    pos: &[i32],
    row_seq: &[i32],
) -> (Vec<usize>, Vec<f32>, Vec<i32>) {
    let mine: Vec<usize> = (0..pos.len())
        .filter(|&i| row_seq[i] as usize == s)
        .collect();
    let qs = mine
        .iter()
        .flat_map(|&i| q[i * width..(i + 1) * width].iter().copied())
        .collect();
    let ps = mine.iter().map(|&i| pos[i]).collect();
    (mine, qs, ps)
}
