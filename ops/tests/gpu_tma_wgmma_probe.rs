//! Probes for a warp-specialised split attention, before any op uses them: a 64-row tile of an
//! F16 latent cache (576 values a row) staged by the tensor memory accelerator in nine boxes of
//! 64 columns with the 128-byte swizzle, and warpgroup MMAs reading it straight from shared
//! memory: the scores as the tile (K-major A) times Q, the values as the tile read transposed
//! (MN-major A) times the weights. Each is held to the CPU; the values probe also pins which
//! descriptor field of a transposed swizzled A carries the stride between its 8-row K groups.

use cuda::{CudaError, compile_offline, tensor_map_f16_2d_swizzle128};
use half::f16;
use ops::gpu::GpuCtx;
use ops::parity::{Rng, test_gpu};

const SOURCE: &str = include_str!("tma_wgmma_probe.cu");
const W: usize = 576;
/// Pool rows: the tile starts at row 64 (a cache page past the first) of 256.
const POOL_ROWS: usize = 256;
const ROW0: usize = 64;
/// The nine 8 KB boxes of a tile, plus 1024 bytes to align them, plus a B operand (Q: 36 KB).
const SMEM: u32 = (9 * 8192 + 1024 + 9 * 4096) as u32;

#[test]
fn the_probe_source_compiles_for_sm_90a() {
    match compile_offline("tma_wgmma_probe.cu", SOURCE, "sm_90a", &[]) {
        Ok(b) => assert!(b.cubin.starts_with(b"\x7fELF"), "not a CUBIN"),
        Err(CudaError::NvrtcNotLoaded { tried }) => {
            assert!(
                std::env::var_os("CI").is_none(),
                "CI must provide NVRTC (tried {tried})"
            );
            println!("skipped: NVRTC is not installed here (tried {tried})");
        }
        Err(e) => panic!("the probe does not compile: {e}"),
    }
}

/// f16 values in [-1, 1] and the same values as f32.
fn halves(r: &mut Rng, n: usize) -> (Vec<u16>, Vec<f32>) {
    let h: Vec<f16> = (0..n)
        .map(|_| f16::from_f32(r.uniform(-1.0, 1.0)))
        .collect();
    (
        h.iter().map(|v| v.to_bits()).collect(),
        h.iter().map(|v| v.to_f32()).collect(),
    )
}

struct Pool {
    bits: cuda::DeviceBuffer<u16>,
    vals: Vec<f32>,
    map: cuda::TensorMap,
}

fn pool(gpu: &GpuCtx, r: &mut Rng) -> Pool {
    let (h, vals) = halves(r, POOL_ROWS * W);
    let bits = gpu.device.upload(&h).expect("upload the pool");
    let map = tensor_map_f16_2d_swizzle128(
        bits.device_ptr(),
        W as u64,
        POOL_ROWS as u64,
        (W * 2) as u64,
        64,
        64,
    )
    .expect("tensor map");
    Pool { bits, vals, map }
}

fn launch(
    gpu: &GpuCtx,
    name: &str,
    build: impl FnOnce(cuda::Launch<'_>) -> cuda::Launch<'_>,
) -> Result<(), String> {
    let k = gpu
        .kernel("tma_wgmma_probe.cu", SOURCE, name)
        .map_err(|e| e.to_string())?;
    let l = gpu.device.launch(&k).grid(1).block(128).shared_mem(SMEM);
    // SAFETY: each caller passes the kernel's parameters in order (the tensor map, the tile's
    // first row, device buffers of the sizes the kernel reads and writes).
    unsafe { build(l).enqueue() }.map_err(|e| e.to_string())?;
    gpu.device.synchronize().map_err(|e| e.to_string())
}

#[test]
fn tma_boxes_land_in_the_128_byte_swizzle_layout() {
    let Some(gpu) = test_gpu() else { return };
    let mut r = Rng::new(11);
    let p = pool(&gpu, &mut r);
    let out = gpu
        .device
        .upload(&vec![0u16; 9 * 8192 / 2])
        .expect("output");
    launch(&gpu, "probe_tma_tile", |l| {
        l.arg(p.map).arg(ROW0 as i32).arg(&out)
    })
    .expect("probe_tma_tile");
    let got = out.to_vec().expect("download");
    let host: Vec<u16> = p.vals.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
    let mut wrong = 0;
    for row in 0..64 {
        for col in 0..W {
            let (b, c) = (col / 64, col % 64);
            let byte = 8192 * b + 128 * row + 16 * ((c / 8) ^ (row % 8)) + 2 * (c % 8);
            if got[byte / 2] != host[(ROW0 + row) * W + col] {
                wrong += 1;
            }
        }
    }
    assert_eq!(
        wrong,
        0,
        "{wrong} of {} values not where the layout says",
        64 * W
    );
    drop(p.bits);
}

/// Worst |gpu − cpu| over `got` against `want`.
fn worst(got: &[f32], want: &[f32]) -> f32 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max)
}

#[test]
fn wgmma_scores_over_a_tma_tile_match_the_cpu() {
    let Some(gpu) = test_gpu() else { return };
    let mut r = Rng::new(12);
    let p = pool(&gpu, &mut r);
    let (qh, qv) = halves(&mut r, 32 * W);
    let q = gpu.device.upload(&qh).expect("q");
    let s = gpu.device.upload(&vec![0f32; 64 * 32]).expect("s");
    launch(&gpu, "probe_wgmma_scores", |l| {
        l.arg(p.map).arg(ROW0 as i32).arg(&q).arg(&s)
    })
    .expect("probe_wgmma_scores");
    let got = s.to_vec().expect("download");
    let want: Vec<f32> = (0..64 * 32)
        .map(|i| {
            let (row, h) = (i / 32, i % 32);
            (0..W)
                .map(|d| p.vals[(ROW0 + row) * W + d] * qv[h * W + d])
                .sum::<f32>()
        })
        .collect();
    let e = worst(&got, &want);
    println!("probe scores: worst |Δ| {e:.3e}");
    assert!(e < 1e-3, "scores off by {e}");
}

#[test]
fn wgmma_values_with_the_tile_as_transposed_a_match_the_cpu() {
    let Some(gpu) = test_gpu() else { return };
    let mut r = Rng::new(13);
    let p = pool(&gpu, &mut r);
    let (ph, pv) = halves(&mut r, 32 * 64);
    let pw = gpu.device.upload(&ph).expect("p");
    let o = gpu.device.upload(&vec![0f32; 64 * 32]).expect("o");
    // O^T[c][h] = Σ_row V[row][c] · P[h][row], V = the tile's columns 0..63.
    let want: Vec<f32> = (0..64 * 32)
        .map(|i| {
            let (c, h) = (i / 32, i % 32);
            (0..64)
                .map(|row| p.vals[(ROW0 + row) * W + c] * pv[h * 64 + row])
                .sum::<f32>()
        })
        .collect();
    let run = |lbo: i32, sbo: i32| {
        launch(&gpu, "probe_wgmma_values", |l| {
            l.arg(p.map)
                .arg(ROW0 as i32)
                .arg(&pw)
                .arg(&o)
                .arg(lbo)
                .arg(sbo)
        })
        .expect("probe_wgmma_values");
        let e = worst(&o.to_vec().expect("download"), &want);
        println!("probe values: LBO {lbo} SBO {sbo}: worst |Δ| {e:.3e}");
        e
    };
    // The stride between 8-row K groups (1024 bytes) is the stride offset; the leading offset
    // (between 64-column atoms along M) is unused at M = 64. H100, 2026-12-06: LBO 16 / 1024
    // / 8192 with SBO 1024 all matched; LBO 1024 with SBO 16 or 8192 gave errors near 9.
    let e = run(16, 1024);
    assert!(
        e < 1e-3,
        "the transposed product with SBO = 1024 is off by {e}"
    );
    let swapped = run(1024, 16);
    assert!(
        swapped > 1e-1,
        "the swapped offsets gave the product too (|Δ| {swapped}): the probe no longer tells \
         which field is the K-group stride"
    );
}
