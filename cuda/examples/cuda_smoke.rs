//! Prints the GPU's facts and runs the CUDA layer's smoke checks on real hardware: NVRTC
//! compile and disk-cache hit, a checked kernel, eager vs graph-replayed launches, a bf16 GEMM,
//! and a 2 GiB device-to-device copy. Exits non-zero when a check fails.
//!
//! `cargo run --release -p cuda --example cuda_smoke [ordinal]`

use std::error::Error;
use std::time::Instant;

use cuda::{Blas, Device, KernelCache, KernelCacheConfig, Timer};
use half::bf16;

type Res<T> = Result<T, Box<dyn Error>>;

const SRC: &str = r#"
#include <cuda_bf16.h>
extern "C" __global__ void vadd(const float* a, const float* b, float* c, unsigned n) {
    PDL_ENTER();
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) c[i] = a[i] + b[i];
}
extern "C" __global__ void add_one(float* x, unsigned n) {
    PDL_ENTER();
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += 1.0f;
}
extern "C" __global__ void fill_u32(unsigned* p, unsigned long long n) {
    PDL_ENTER();
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride)
        p[i] = (unsigned)(i * 2654435761ull);
}
extern "C" __global__ void to_bf16(const float* x, __nv_bfloat16* y, unsigned n) {
    PDL_ENTER();
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}
"#;

fn check(name: &str, ok: bool) -> Res<()> {
    println!("  {name}: {}", if ok { "PASS" } else { "FAIL" });
    if ok {
        Ok(())
    } else {
        Err(format!("check failed: {name}").into())
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Res<()> {
    let ordinal: usize = match std::env::args().nth(1) {
        Some(s) => s
            .parse()
            .map_err(|_| format!("ordinal `{s}` is not a number"))?,
        None => 0,
    };
    println!("== device");
    println!("  CUDA devices visible: {}", Device::available()?);
    let device = Device::open(ordinal)?;
    let info = device.info();
    println!(
        "  {}: {} SMs, compute capability {}.{} ({}), {:.1} GiB, L2 {} MiB, {} KiB opt-in shared memory per block, driver CUDA {}.{}",
        info.name,
        info.sm_count,
        info.compute_capability.0,
        info.compute_capability.1,
        device.arch(),
        info.total_memory as f64 / (1u64 << 30) as f64,
        info.l2_cache_bytes >> 20,
        info.max_shared_mem_per_block_optin >> 10,
        info.driver_version.0,
        info.driver_version.1
    );
    let (free, total) = device.mem_get_info()?;
    println!(
        "  memory free/total: {:.1} / {:.1} GiB",
        free as f64 / (1u64 << 30) as f64,
        total as f64 / (1u64 << 30) as f64
    );
    check("mem_get_info free <= total", free > 0 && free <= total)?;

    println!("== NVRTC and the kernel cache");
    let tmp = std::env::temp_dir().join(format!("xing4-cuda-smoke-{}", std::process::id()));
    let fresh = KernelCache::with_config(
        &device,
        KernelCacheConfig {
            dir: Some(tmp.clone()),
            ..Default::default()
        },
    )?;
    println!(
        "  NVRTC {}.{}, options: {}",
        fresh.nvrtc_version().0,
        fresh.nvrtc_version().1,
        fresh.options().join(" ")
    );
    let t = Instant::now();
    fresh.get("smoke.cu", SRC, &["vadd"])?;
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    let again = KernelCache::with_config(
        &device,
        KernelCacheConfig {
            dir: Some(tmp.clone()),
            ..Default::default()
        },
    )?;
    let t = Instant::now();
    let module = again.get("smoke.cu", SRC, &["vadd", "add_one", "fill_u32", "to_bf16"])?;
    let disk_ms = t.elapsed().as_secs_f64() * 1e3;
    println!("  compile {compile_ms:.1} ms, load from disk cache {disk_ms:.2} ms");
    check(
        "second cache instance hit the disk",
        again.stats().disk_hits == 1 && again.stats().compiled == 0,
    )?;
    let _ = std::fs::remove_dir_all(&tmp);
    let default_cache = KernelCache::new(&device)?;
    println!("  default cache directory: {:?}", default_cache.dir());

    println!("== kernels");
    let (vadd, add_one, fill, to_bf16) = (
        module.kernel("vadd")?,
        module.kernel("add_one")?,
        module.kernel("fill_u32")?,
        module.kernel("to_bf16")?,
    );
    let n = 1usize << 20;
    let a: Vec<f32> = (0..n).map(|i| (i as f32 * 0.001).sin() * 100.0).collect();
    let b: Vec<f32> = (0..n).map(|i| (i as f32 * 0.003).cos()).collect();
    let (da, db, dc) = (
        device.upload(&a)?,
        device.upload(&b)?,
        device.alloc_zeros::<f32>(n)?,
    );
    // SAFETY: vadd(const float*, const float*, float*, unsigned) on n-element buffers.
    unsafe {
        device
            .launch(&vadd)
            .grid((n as u32).div_ceil(256))
            .block(256)
            .arg(&da)
            .arg(&db)
            .arg(&dc)
            .arg(n as u32)
            .enqueue()?
    };
    let c = dc.to_vec()?;
    check(
        "vadd bit-exact vs CPU",
        c.iter()
            .zip(a.iter().zip(&b))
            .all(|(&c, (&a, &b))| c.to_bits() == (a + b).to_bits()),
    )?;
    let dh = device.alloc_zeros::<bf16>(n)?;
    // SAFETY: to_bf16(const float*, __nv_bfloat16*, unsigned).
    unsafe {
        device
            .launch(&to_bf16)
            .grid((n as u32).div_ceil(256))
            .block(256)
            .arg(&da)
            .arg(&dh)
            .arg(n as u32)
            .enqueue()?
    };
    check(
        "__float2bfloat16_rn matches the half crate",
        dh.to_vec()?
            .iter()
            .zip(&a)
            .all(|(h, &x)| h.to_bits() == bf16::from_f32(x).to_bits()),
    )?;

    println!("== 2000 tiny launches: eager vs one CUDA graph");
    let launches = 2000usize;
    let x = device.alloc_zeros::<f32>(256)?;
    let enqueue_all = |d: &Device| -> Result<(), cuda::CudaError> {
        for _ in 0..launches {
            // SAFETY: add_one(float*, unsigned) on a 256-element buffer.
            unsafe {
                d.launch(&add_one)
                    .block(256)
                    .arg(&x)
                    .arg(256u32)
                    .enqueue()?
            };
        }
        Ok(())
    };
    enqueue_all(&device)?;
    device.synchronize()?;
    let timer = Timer::new(&device)?;
    let mut eager = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        enqueue_all(&device)?;
        device.synchronize()?;
        eager.push(t.elapsed().as_secs_f64());
    }
    let t = Instant::now();
    let graph = device.capture(enqueue_all)?;
    let capture_ms = t.elapsed().as_secs_f64() * 1e3;
    graph.upload()?;
    graph.launch()?;
    device.synchronize()?;
    let (mut replay, mut replay_gpu) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        let t = Instant::now();
        timer.start()?;
        graph.launch()?;
        replay_gpu.push(timer.stop()? as f64 * 1e-3);
        replay.push(t.elapsed().as_secs_f64());
    }
    let total = (1 + 5 + 1 + 5) * launches;
    check(
        "graph replays add like eager launches",
        x.to_vec()?.iter().all(|&v| v == total as f32),
    )?;
    let us = |s: f64| s * 1e6 / launches as f64;
    println!(
        "  capture+instantiate {capture_ms:.1} ms; eager {:.2} us/launch; graph {:.2} us/kernel (wall), {:.2} us/kernel (events)",
        us(median(eager)),
        us(median(replay)),
        us(median(replay_gpu))
    );

    println!("== cuBLAS bf16 GEMM (row-major C = A*B^T, f32 accumulate)");
    let blas = Blas::new(&device)?;
    for size in [4096usize, 8192] {
        let elems = size * size;
        let ga = device.upload(
            &(0..elems)
                .map(|i| bf16::from_f32(((i * 7919) % 1000) as f32 / 1000.0 - 0.5))
                .collect::<Vec<_>>(),
        )?;
        let gb = device.upload(
            &(0..elems)
                .map(|i| bf16::from_f32(((i * 104729) % 1000) as f32 / 1000.0 - 0.5))
                .collect::<Vec<_>>(),
        )?;
        let gc = device.alloc_zeros::<bf16>(elems)?;
        let mut times = Vec::new();
        for rep in 0..13 {
            timer.start()?;
            // SAFETY: all three buffers are size×size and alive.
            unsafe { blas.gemm_bf16(size, size, size, ga.view(), gb.view(), gc.view(), 1.0, 0.0)? };
            let ms = timer.stop()? as f64;
            if rep >= 3 {
                times.push(ms);
            }
        }
        let ms = median(times);
        println!(
            "  {size}^3: {ms:.3} ms, {:.0} TFLOP/s",
            2.0 * (size as f64).powi(3) / (ms * 1e-3) / 1e12
        );
    }

    println!("== device-to-device copy, 2 GiB");
    let bytes = 2usize << 30;
    let words = bytes / 4;
    let src = device.alloc_zeros::<u32>(words)?;
    let mut dst = device.alloc_zeros::<u32>(words)?;
    let grid = info.sm_count * 8;
    // SAFETY: fill_u32(unsigned*, unsigned long long) over `words` elements.
    unsafe {
        device
            .launch(&fill)
            .grid(grid)
            .block(512)
            .arg(&src)
            .arg(words as u64)
            .enqueue()?
    };
    dst.copy_from_device(&src)?;
    let mut times = Vec::new();
    for _ in 0..10 {
        timer.start()?;
        dst.copy_from_device(&src)?;
        times.push(timer.stop()? as f64 * 1e-3);
    }
    let s = median(times);
    println!(
        "  median {:.3} ms: {:.0} GB/s copied, {:.0} GB/s read+write",
        s * 1e3,
        bytes as f64 / s / 1e9,
        2.0 * bytes as f64 / s / 1e9
    );
    let host = dst.download_range(words - 4096..words)?;
    check(
        "copied contents",
        host.iter()
            .enumerate()
            .all(|(i, &v)| v == ((words - 4096 + i) as u64).wrapping_mul(2654435761) as u32),
    )?;
    println!("all smoke checks passed");
    Ok(())
}
