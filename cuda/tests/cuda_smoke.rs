//! Smoke tests of the CUDA layer. Tests that need a GPU print "skipped: …" and return when the
//! driver or a GPU is missing; any other failure to open the device fails the test.

use std::path::PathBuf;
use std::time::Instant;

use cuda::{Blas, CudaError, Device, DeviceView, KernelCache, KernelCacheConfig, Timer};
use half::bf16;

const VECTOR_SRC: &str = r#"
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
"#;

// Block 0 dawdles before writing its range, and each thread reads the mirrored element, so the
// successor's last block reads what block 0 wrote: without the wait it would read it early.
const CHAIN_SRC: &str = r#"
extern "C" __global__ void slow_copy_plus_one(const float* src, float* dst, unsigned n) {
    PDL_ENTER();
    if (blockIdx.x == 0) __nanosleep(20000);
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = src[n - 1 - i] + 1.0f;
}
"#;

// Needs the toolkit headers, so it checks that the include path is passed to NVRTC.
const BF16_SRC: &str = r#"
#include <cuda_bf16.h>
extern "C" __global__ void to_bf16(const float* x, __nv_bfloat16* y, unsigned n) {
    PDL_ENTER();
    unsigned i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = __float2bfloat16_rn(x[i]);
}
"#;

// Reverses n floats through dynamic shared memory in one block.
const SMEM_SRC: &str = r#"
extern "C" __global__ void reverse_in_smem(const float* x, float* y, unsigned n) {
    PDL_ENTER();
    extern __shared__ float s[];
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) s[i] = x[i];
    __syncthreads();
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) y[i] = s[n - 1 - i];
}
"#;

// 40 KiB of static shared memory beside n floats of dynamic: past 48 KiB together from
// n = 2,049 on, which the driver refuses unless the kernel opted in for its dynamic bytes.
const SMEM_STATIC_SRC: &str = r#"
extern "C" __global__ void reverse_beside_static(const float* x, float* y, unsigned n) {
    PDL_ENTER();
    __shared__ float twice[10240];
    extern __shared__ float s[];
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) {
        s[i] = x[i];
        twice[i] = 2.0f * x[i];
    }
    __syncthreads();
    for (unsigned i = threadIdx.x; i < n; i += blockDim.x) y[i] = s[n - 1 - i] + twice[i];
}
"#;

/// The device, or `None` after printing why the test is skipped. Only a missing driver or GPU
/// skips; any other error is a failure.
fn gpu() -> Option<Device> {
    match Device::open(0) {
        Ok(d) => Some(d),
        Err(e @ (CudaError::DriverNotLoaded { .. } | CudaError::NoDevice { .. })) => {
            println!("skipped: no CUDA driver/GPU ({e})");
            None
        }
        Err(e) => panic!("opening CUDA device 0 failed: {e}"),
    }
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> TempDir {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos();
        TempDir(
            std::env::temp_dir().join(format!("xing4-cuda-{tag}-{}-{nanos}", std::process::id())),
        )
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A kernel cache in its own directory, or `None` (printed) when NVRTC is missing.
fn kernel_cache(device: &Device, dir: &TempDir) -> Option<KernelCache> {
    let config = KernelCacheConfig {
        dir: Some(dir.0.clone()),
        ..Default::default()
    };
    match KernelCache::with_config(device, config) {
        Ok(c) => Some(c),
        Err(e @ CudaError::NvrtcNotLoaded { .. }) => {
            println!("skipped: NVRTC is not available ({e})");
            None
        }
        Err(e) => panic!("creating the kernel cache failed: {e}"),
    }
}

fn ramp(n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|i| (i as f32 * 0.37).sin() * scale).collect()
}

/// Launches `add_one` on `x` (n elements) through the given device.
fn add_one(device: &Device, k: &cuda::Kernel, x: DeviceView<f32>) -> Result<(), CudaError> {
    let n = x.len() as u32;
    // SAFETY: add_one(float*, unsigned); x is alive for the whole test.
    unsafe {
        device
            .launch(k)
            .grid(n.div_ceil(256))
            .block(256)
            .arg(x)
            .arg(n)
            .enqueue()
    }
}

#[test]
fn opening_a_device_is_an_error_not_a_panic_and_says_what_is_missing() {
    let driver_present = unsafe { cuda::cudarc::driver::sys::is_culib_present() };
    if driver_present {
        let count = Device::available().expect("the driver is present, so counting works");
        let err = Device::open(count + 3).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, CudaError::OrdinalOutOfRange { ordinal, count: c } if ordinal == count + 3 && c == count),
            "{msg}"
        );
        assert!(msg.contains(&format!("{count} device(s)")), "{msg}");
    } else {
        let err = Device::open(0).unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, CudaError::DriverNotLoaded { .. }), "{msg}");
        assert!(
            msg.contains("the CUDA driver library could not be loaded"),
            "{msg}"
        );
        assert!(
            msg.contains("libcuda.so"),
            "the message lists the names tried: {msg}"
        );
        let count_err = Device::available().unwrap_err();
        assert!(
            matches!(count_err, CudaError::DriverNotLoaded { .. }),
            "{count_err}"
        );
    }
}

#[test]
fn device_facts_are_plausible_and_mem_get_info_is_sane() {
    let Some(device) = gpu() else { return };
    let info = device.info();
    println!("{info:?}");
    assert!(!info.name.is_empty());
    assert!(info.compute_capability.0 >= 5, "{info:?}");
    assert!(info.sm_count > 0 && info.total_memory > 0, "{info:?}");
    assert!(device.arch().starts_with("sm_"));
    let (free, total) = device.mem_get_info().unwrap();
    assert!(free > 0 && free <= total, "free {free} total {total}");
    // Both come from the driver; allow for a carve-out differing between the two queries.
    let diff = total.abs_diff(info.total_memory);
    assert!(
        diff <= info.total_memory / 50,
        "cuMemGetInfo total {total} vs {}",
        info.total_memory
    );
    device.synchronize().unwrap();
}

#[test]
fn vector_add_compiled_by_nvrtc_matches_the_cpu_sum() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("vadd");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let module = cache.get("vector.cu", VECTOR_SRC, &["vadd"]).unwrap();
    let vadd = module.kernel("vadd").unwrap();
    let n = 100_003usize;
    let a = ramp(n, 3.0);
    let b = ramp(n, -1.5).iter().map(|v| v + 0.25).collect::<Vec<_>>();
    let da = device.upload(&a).unwrap();
    let db = device.upload(&b).unwrap();
    let dc = device.alloc_zeros::<f32>(n).unwrap();
    // SAFETY: vadd(const float*, const float*, float*, unsigned) with n-element buffers.
    unsafe {
        device
            .launch(&vadd)
            .grid((n as u32).div_ceil(256))
            .block(256)
            .arg(&da)
            .arg(&db)
            .arg(&dc)
            .arg(n as u32)
            .enqueue()
            .unwrap();
    }
    let c = dc.to_vec().unwrap();
    for i in 0..n {
        // One f32 addition on each side: the results are bit-identical.
        assert_eq!(c[i].to_bits(), (a[i] + b[i]).to_bits(), "element {i}");
    }
}

#[test]
fn a_source_using_cuda_bf16_h_compiles_and_rounds_like_the_half_crate() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("bf16");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let k = cache
        .get("bf16.cu", BF16_SRC, &["to_bf16"])
        .unwrap()
        .kernel("to_bf16")
        .unwrap();
    let x: Vec<f32> = ramp(4096, 1000.0);
    let dx = device.upload(&x).unwrap();
    let dy = device.alloc_zeros::<bf16>(x.len()).unwrap();
    // SAFETY: to_bf16(const float*, __nv_bfloat16*, unsigned).
    unsafe {
        device
            .launch(&k)
            .grid(16)
            .block(256)
            .arg(&dx)
            .arg(&dy)
            .arg(x.len() as u32)
            .enqueue()
            .unwrap();
    }
    let y = dy.to_vec().unwrap();
    for (i, (&got, &xi)) in y.iter().zip(&x).enumerate() {
        assert_eq!(
            got.to_bits(),
            bf16::from_f32(xi).to_bits(),
            "element {i} ({xi})"
        );
    }
}

#[test]
fn a_second_cache_loads_the_kernel_from_disk_without_compiling() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("disk");
    let Some(first) = kernel_cache(&device, &dir) else {
        return;
    };
    let t = Instant::now();
    first
        .get("vector.cu", VECTOR_SRC, &["vadd", "add_one"])
        .unwrap();
    let compile_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(first.stats().compiled, 1);
    assert_eq!(first.stats().disk_hits, 0);
    let files: Vec<_> = std::fs::read_dir(&dir.0)
        .unwrap()
        .filter_map(|e| e.ok())
        .collect();
    assert_eq!(files.len(), 1, "one CUBIN written");
    assert!(files[0].file_name().to_string_lossy().ends_with(".cubin"));

    first.get("vector.cu", VECTOR_SRC, &["vadd"]).unwrap();
    assert_eq!(first.stats().memory_hits, 1);
    assert_eq!(
        first.stats().compiled,
        1,
        "the same cache does not compile twice"
    );

    let second = kernel_cache(&device, &dir).unwrap();
    let t = Instant::now();
    let m = second.get("vector.cu", VECTOR_SRC, &["vadd"]).unwrap();
    let disk_ms = t.elapsed().as_secs_f64() * 1e3;
    assert_eq!(second.stats().compiled, 0);
    assert_eq!(second.stats().disk_hits, 1);
    assert!(m.kernel("add_one").is_ok());
    println!("compile {compile_ms:.1} ms, disk hit {disk_ms:.2} ms");
}

#[test]
fn a_corrupt_cache_file_is_recompiled_and_replaced() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("corrupt");
    let Some(first) = kernel_cache(&device, &dir) else {
        return;
    };
    first.get("vector.cu", VECTOR_SRC, &[]).unwrap();
    let path = std::fs::read_dir(&dir.0)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    std::fs::write(&path, b"not a cubin").unwrap();
    let second = kernel_cache(&device, &dir).unwrap();
    second.get("vector.cu", VECTOR_SRC, &["vadd"]).unwrap();
    assert_eq!(second.stats().compiled, 1);
    assert!(std::fs::read(&path).unwrap().starts_with(b"\x7fELF"));
}

#[test]
fn a_compile_error_names_the_source_and_carries_the_nvrtc_log() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("bad");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let bad = "extern \"C\" __global__ void k(float* x) { x[0] = undeclared_name; }";
    let err = cache.get("broken_kernel.cu", bad, &["k"]).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, CudaError::Compile { .. }), "{msg}");
    assert!(msg.contains("broken_kernel.cu"), "{msg}");
    assert!(
        msg.contains("undeclared_name"),
        "the NVRTC log is included: {msg}"
    );
}

#[test]
fn asking_for_a_kernel_the_source_lacks_is_an_error_naming_it() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("missing");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let err = cache
        .get("vector.cu", VECTOR_SRC, &["vadd", "no_such_kernel"])
        .unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, CudaError::MissingKernel { .. }), "{msg}");
    assert!(
        msg.contains("no_such_kernel") && msg.contains("vector.cu"),
        "{msg}"
    );
}

#[test]
fn a_captured_graph_of_n_launches_replays_to_the_eager_result() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("graph");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let k = cache
        .get("vector.cu", VECTOR_SRC, &["add_one"])
        .unwrap()
        .kernel("add_one")
        .unwrap();
    let n = 4096usize;
    let launches = 50;
    let eager = device.alloc_zeros::<f32>(n).unwrap();
    for _ in 0..launches {
        add_one(&device, &k, eager.view()).unwrap();
    }
    let graphed = device.alloc_zeros::<f32>(n).unwrap();
    let graph = device
        .capture(|d| {
            for _ in 0..launches {
                add_one(d, &k, graphed.view())?;
            }
            Ok(())
        })
        .unwrap();
    assert!(
        graphed.to_vec().unwrap().iter().all(|&v| v == 0.0),
        "capturing must not run the work"
    );
    graph.upload().unwrap();
    graph.launch().unwrap();
    assert_eq!(graphed.to_vec().unwrap(), eager.to_vec().unwrap());
    graph.launch().unwrap();
    graph.launch().unwrap();
    assert!(
        graphed
            .to_vec()
            .unwrap()
            .iter()
            .all(|&v| v == 3.0 * launches as f32)
    );
}

#[test]
fn a_failing_capture_returns_the_closures_error_and_leaves_the_stream_usable() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("capfail");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let k = cache
        .get("vector.cu", VECTOR_SRC, &["add_one"])
        .unwrap()
        .kernel("add_one")
        .unwrap();
    let x = device.alloc_zeros::<f32>(256).unwrap();
    let err = device
        .capture(|d| {
            add_one(d, &k, x.view())?;
            Err(CudaError::InvalidArgument {
                what: "test",
                detail: "stop here".into(),
            })
        })
        .unwrap_err();
    assert!(err.to_string().contains("stop here"), "{err}");
    add_one(&device, &k, x.view()).unwrap();
    assert!(x.to_vec().unwrap().iter().all(|&v| v == 1.0));
}

#[test]
fn a_launch_above_48_kib_of_shared_memory_opts_in_automatically() {
    let Some(device) = gpu() else { return };
    if device.info().max_shared_mem_per_block_optin < 100 * 1024 {
        println!("skipped: this GPU allows less than 100 KiB of shared memory per block");
        return;
    }
    let dir = TempDir::new("smem");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let k = cache
        .get("smem.cu", SMEM_SRC, &["reverse_in_smem"])
        .unwrap()
        .kernel("reverse_in_smem")
        .unwrap();
    let n = 25_000usize; // 100 000 bytes of shared memory
    let x = ramp(n, 1.0);
    let y = run_with_shared_floats(&device, &k, &x, 1024);
    let expected: Vec<f32> = x.iter().rev().copied().collect();
    assert_eq!(y, expected);
}

/// Launches `k(const float* x, float* y, unsigned n)`, one block of `block` threads with
/// x.len() floats of dynamic shared memory, and returns y.
fn run_with_shared_floats(device: &Device, k: &cuda::Kernel, x: &[f32], block: u32) -> Vec<f32> {
    let n = x.len();
    let dx = device.upload(x).unwrap();
    let dy = device.alloc_zeros::<f32>(n).unwrap();
    // SAFETY: the callers' kernels take (const float*, float*, unsigned) and use n floats of
    // dynamic shared memory.
    unsafe {
        device
            .launch(k)
            .block(block)
            .shared_mem((n * 4) as u32)
            .arg(&dx)
            .arg(&dy)
            .arg(n as u32)
            .enqueue()
            .unwrap();
    }
    dy.to_vec().unwrap()
}

/// A kernel's static shared memory counts against the 48 KiB a block has without opting in:
/// 16 KiB of dynamic shared memory beside 40 KiB of static must opt in, though 16 KiB alone
/// would not.
#[test]
fn dynamic_shared_memory_beside_static_past_48_kib_opts_in_too() {
    let Some(device) = gpu() else { return };
    if device.info().max_shared_mem_per_block_optin < 64 * 1024 {
        println!("skipped: this GPU allows less than 64 KiB of shared memory per block");
        return;
    }
    let dir = TempDir::new("smem-static");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let k = cache
        .get(
            "smem_static.cu",
            SMEM_STATIC_SRC,
            &["reverse_beside_static"],
        )
        .unwrap()
        .kernel("reverse_beside_static")
        .unwrap();
    for n in [1024usize, 4096] {
        let x = ramp(n, 1.0);
        let y = run_with_shared_floats(&device, &k, &x, 256);
        let expected: Vec<f32> = (0..n).map(|i| x[n - 1 - i] + 2.0 * x[i]).collect();
        assert_eq!(y, expected, "{n} floats of dynamic shared memory");
    }
}

#[test]
fn arena_views_round_trip_feed_kernels_and_reject_bad_ranges() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("arena");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let vadd = cache
        .get("vector.cu", VECTOR_SRC, &["vadd"])
        .unwrap()
        .kernel("vadd")
        .unwrap();
    let mut arena = device.arena(1 << 20).unwrap();
    let n = 1000usize;
    let a = arena.view::<f32>(0, n).unwrap();
    let b = arena.view::<f32>(4096, n).unwrap();
    let c = arena.view::<f32>(8192, n).unwrap();
    assert_eq!(b.device_ptr() - a.device_ptr(), 4096);
    let (ha, hb) = (ramp(n, 2.0), ramp(n, 5.0));
    arena.upload(a, &ha).unwrap();
    arena.upload(b, &hb).unwrap();
    assert_eq!(arena.download(a).unwrap(), ha);
    // SAFETY: vadd(const float*, const float*, float*, unsigned); the arena outlives the launch.
    unsafe {
        device
            .launch(&vadd)
            .grid(4)
            .block(256)
            .arg(a)
            .arg(b)
            .arg(c)
            .arg(n as u32)
            .enqueue()
            .unwrap();
    }
    let hc = arena.download(c).unwrap();
    assert!(
        hc.iter()
            .zip(ha.iter().zip(&hb))
            .all(|(&c, (&a, &b))| c == a + b)
    );
    arena.zero(c).unwrap();
    assert!(arena.download(c).unwrap().iter().all(|&v| v == 0.0));

    assert!(matches!(
        arena.view::<f32>((1 << 20) - 8, 3),
        Err(CudaError::OutOfBounds { .. })
    ));
    assert!(matches!(
        arena.view::<f32>(2, 1),
        Err(CudaError::Misaligned { .. })
    ));
    assert!(matches!(
        arena.upload(a, &ha[..10]),
        Err(CudaError::LengthMismatch { .. })
    ));
    let other = device.alloc_zeros::<f32>(n).unwrap();
    assert!(matches!(
        arena.download(other.view()),
        Err(CudaError::OutOfBounds { .. })
    ));
}

#[test]
fn buffer_copies_check_lengths_and_round_trip() {
    let Some(device) = gpu() else { return };
    let mut buf = device.alloc_zeros::<i32>(10).unwrap();
    let data: Vec<i32> = (0..10).map(|i| i * i - 7).collect();
    buf.copy_from_host(&data).unwrap();
    assert_eq!(buf.to_vec().unwrap(), data);
    assert!(matches!(
        buf.copy_from_host(&data[..9]),
        Err(CudaError::LengthMismatch {
            expected: 10,
            got: 9,
            ..
        })
    ));
    let mut copy = device.alloc_zeros::<i32>(10).unwrap();
    copy.copy_from_device(&buf).unwrap();
    assert_eq!(copy.to_vec().unwrap(), data);
    let tail = buf.slice(7..10).unwrap();
    assert_eq!(tail.device_ptr(), buf.device_ptr() + 28);
    assert!(buf.slice(7..11).is_err());
    copy.zero().unwrap();
    assert_eq!(copy.to_vec().unwrap(), vec![0; 10]);
}

fn lcg_values(n: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            bf16::from_f32(((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

#[test]
fn gemm_bf16_computes_row_major_a_times_b_transposed() {
    let Some(device) = gpu() else { return };
    let blas = match Blas::new(&device) {
        Ok(b) => b,
        Err(e @ CudaError::CublasNotLoaded { .. }) => {
            println!("skipped: cuBLAS is not available ({e})");
            return;
        }
        Err(e) => panic!("{e}"),
    };
    let (m, n, k) = (37usize, 29usize, 64usize);
    let a = lcg_values(m * k, 1);
    let b = lcg_values(n * k, 2);
    let reference: Vec<f64> = (0..m * n)
        .map(|idx| {
            let (i, j) = (idx / n, idx % n);
            (0..k)
                .map(|l| a[i * k + l].to_f64() * b[j * k + l].to_f64())
                .sum()
        })
        .collect();
    let da = device.upload(&a).unwrap();
    let db = device.upload(&b).unwrap();
    let c32 = device.upload(&vec![1.0f32; m * n]).unwrap();
    let c16 = device.alloc_zeros::<bf16>(m * n).unwrap();
    // SAFETY: all buffers are alive and sized m×k, n×k, m×n.
    unsafe {
        blas.gemm_bf16(m, n, k, da.view(), db.view(), c32.view(), 1.0, 1.0)
            .unwrap();
        blas.gemm_bf16(m, n, k, da.view(), db.view(), c16.view(), 2.0, 0.0)
            .unwrap();
    }
    let got32 = c32.to_vec().unwrap();
    let got16 = c16.to_vec().unwrap();
    for idx in 0..m * n {
        let r = reference[idx];
        // Products of bf16 values are exact in f32; only the 64-term f32 sum rounds.
        assert!(
            (got32[idx] as f64 - (1.0 + r)).abs() <= 1e-4,
            "C32[{idx}] {} vs {}",
            got32[idx],
            1.0 + r
        );
        let r2 = 2.0 * r;
        assert!(
            (got16[idx].to_f64() - r2).abs() <= r2.abs() / 128.0 + 1e-4,
            "C16[{idx}] {} vs {r2}",
            got16[idx]
        );
    }
    // SAFETY: as above; the call must fail before touching memory.
    let short = unsafe { blas.gemm_bf16(m + 1, n, k, da.view(), db.view(), c32.view(), 1.0, 0.0) };
    assert!(matches!(short, Err(CudaError::LengthMismatch { .. })));
}

#[test]
fn device_to_device_copy_bandwidth_is_measured() {
    let Some(device) = gpu() else { return };
    let bytes = 256usize << 20;
    let n = bytes / 4;
    let src_host: Vec<u32> = (0..n as u32).map(|i| i.wrapping_mul(2654435761)).collect();
    let src = device.upload(&src_host).unwrap();
    let mut dst = device.alloc_zeros::<u32>(n).unwrap();
    dst.copy_from_device(&src).unwrap();
    let timer = Timer::new(&device).unwrap();
    let reps = 10;
    timer.start().unwrap();
    for _ in 0..reps {
        dst.copy_from_device(&src).unwrap();
    }
    let ms = timer.stop().unwrap();
    assert!(ms > 0.0 && ms.is_finite(), "{ms} ms");
    let gbps = (bytes * reps) as f64 / (ms as f64 * 1e-3) / 1e9;
    println!(
        "device-to-device copy, {} MiB x {reps}: {ms:.3} ms, {gbps:.0} GB/s copied ({:.0} GB/s read+write)",
        bytes >> 20,
        2.0 * gbps
    );
    assert_eq!(dst.to_vec().unwrap(), src_host);
}

#[test]
fn programmatic_launches_still_see_every_predecessors_writes() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("pdl");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let k = cache
        .get("chain.cu", CHAIN_SRC, &["slow_copy_plus_one"])
        .unwrap()
        .kernel("slow_copy_plus_one")
        .unwrap();
    let n = 64 * 256;
    let steps = 64;
    for on in [true, false] {
        device.set_programmatic_launch(on);
        let a = device.alloc_zeros::<f32>(n).unwrap();
        let b = device.alloc_zeros::<f32>(n).unwrap();
        let step = |d: &Device, i: usize| -> Result<(), CudaError> {
            let (src, dst) = if i.is_multiple_of(2) {
                (&a, &b)
            } else {
                (&b, &a)
            };
            // SAFETY: slow_copy_plus_one(const float*, float*, unsigned) over n elements.
            unsafe {
                d.launch(&k)
                    .grid(64u32)
                    .block(256u32)
                    .arg(src)
                    .arg(dst)
                    .arg(n as u32)
                    .enqueue()
            }
        };
        for i in 0..steps {
            step(&device, i).unwrap();
        }
        let last = if steps % 2 == 0 { &a } else { &b };
        assert!(
            last.to_vec().unwrap().iter().all(|&v| v == steps as f32),
            "eager chain, programmatic launch {on}"
        );
        let graph = device
            .capture(|d| (0..steps).try_for_each(|i| step(d, i)))
            .unwrap();
        graph.launch().unwrap();
        assert!(
            last.to_vec()
                .unwrap()
                .iter()
                .all(|&v| v == 2.0 * steps as f32),
            "replayed chain, programmatic launch {on}"
        );
    }
    device.set_programmatic_launch(true);
}

#[test]
fn preloading_compiles_each_source_once_and_later_lookups_need_no_compile() {
    let Some(device) = gpu() else { return };
    let dir = TempDir::new("preload");
    let Some(cache) = kernel_cache(&device, &dir) else {
        return;
    };
    let sources = [("vector.cu", VECTOR_SRC), ("smem.cu", SMEM_SRC)];
    assert_eq!(cache.preload(&sources).expect("preload"), 2);
    assert_eq!(cache.stats().compiled, 2);
    // Loaded: a second preload and a lookup compile nothing.
    assert_eq!(cache.preload(&sources).expect("preload again"), 0);
    cache
        .get("vector.cu", VECTOR_SRC, &["vadd", "add_one"])
        .expect("vector module");
    let stats = cache.stats();
    assert_eq!((stats.compiled, stats.memory_hits), (2, 1));
    // A new process (a new cache over the same directory) finds both on disk.
    let Some(again) = kernel_cache(&device, &dir) else {
        return;
    };
    assert_eq!(again.preload(&sources).expect("preload from disk"), 0);
    assert_eq!((again.stats().compiled, again.stats().disk_hits), (0, 2));
    // A source that does not compile is an error naming it, not a panic.
    let err = again
        .preload(&[("broken.cu", "extern \"C\" __global__ void f() { nope; }")])
        .unwrap_err();
    assert!(err.to_string().contains("broken.cu"), "{err}");
}
