use std::collections::HashMap;
use std::ffi::{CStr, CString, OsString};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::{Ptx, result as nvrtc_result, sys as nvrtc_sys};

use crate::device::Device;
use crate::error::{CudaError, guarded, lib_candidates};

/// FNV-1a, 64-bit. Written here because the disk cache key must not change between Rust
/// releases (std's `DefaultHasher` may).
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_extend(0xcbf2_9ce4_8422_2325, bytes)
}

fn fnv1a64_extend(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// The disk-cache key of a compiled kernel source. Each field is length-prefixed so that
/// moving bytes between fields changes the key.
pub fn cache_key(source: &str, arch: &str, options: &[String], nvrtc_version: (i32, i32)) -> u64 {
    let mut h = fnv1a64(b"xing4-rt kernel cache v2");
    h = fnv1a64_extend(h, PRELUDE.as_bytes());
    let mut field = |bytes: &[u8]| {
        h = fnv1a64_extend(h, &(bytes.len() as u64).to_le_bytes());
        h = fnv1a64_extend(h, bytes);
    };
    field(source.as_bytes());
    field(arch.as_bytes());
    field(&(options.len() as u64).to_le_bytes());
    for o in options {
        field(o.as_bytes());
    }
    field(&nvrtc_version.0.to_le_bytes());
    field(&nvrtc_version.1.to_le_bytes());
    h
}

/// The NVRTC `--gpu-architecture` for a compute capability. 9.0 gets the arch-specific `sm_90a`
/// (wgmma, setmaxnreg); the CUBIN only has to run on the card it was compiled for.
pub fn arch_for(major: u32, minor: u32) -> String {
    if (major, minor) == (9, 0) {
        "sm_90a".to_string()
    } else {
        format!("sm_{major}{minor}")
    }
}

/// Where compiled kernels are kept: `$XING4_KERNEL_CACHE`, else
/// `$XDG_CACHE_HOME/xing4-rt/kernels`, else `~/.cache/xing4-rt/kernels`; `None` when none of
/// these variables is set.
pub fn default_cache_dir() -> Option<PathBuf> {
    resolve_cache_dir(|k| std::env::var_os(k))
}

fn resolve_cache_dir(var: impl Fn(&str) -> Option<OsString>) -> Option<PathBuf> {
    let set = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    if let Some(dir) = set("XING4_KERNEL_CACHE") {
        return Some(dir);
    }
    // The XDG spec says relative values are to be ignored.
    if let Some(xdg) = set("XDG_CACHE_HOME").filter(|p| p.is_absolute()) {
        return Some(xdg.join("xing4-rt").join("kernels"));
    }
    set("HOME").map(|home| home.join(".cache").join("xing4-rt").join("kernels"))
}

/// Directories holding `cuda_fp16.h`, which NVRTC 13 does not find by itself.
fn cuda_include_dirs() -> Vec<String> {
    let mut candidates = Vec::new();
    if let Some(home) = std::env::var_os("CUDA_HOME").filter(|v| !v.is_empty()) {
        candidates.push(PathBuf::from(home).join("include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    // The first toolkit include folder with the fp16 header, and its `cccl` folder (CUDA 13
    // keeps libcu++/CUB there; cooperative_groups needs `cuda/std`).
    let Some(dir) = candidates
        .into_iter()
        .find(|d| d.join("cuda_fp16.h").is_file())
    else {
        return Vec::new();
    };
    let mut dirs = vec![dir.to_string_lossy().into_owned()];
    let cccl = dir.join("cccl");
    if cccl.join("cuda").is_dir() {
        dirs.push(cccl.to_string_lossy().into_owned());
    }
    dirs
}

fn file_stem_for(source_name: &str) -> String {
    let mut s: String = source_name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.' {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    if s.is_empty() || s.starts_with('.') {
        s.insert(0, 'k');
    }
    s
}

/// How a [`KernelCache`] compiles.
#[derive(Debug, Clone, Default)]
pub struct KernelCacheConfig {
    /// On-disk cache directory; `None` uses [`default_cache_dir`].
    pub dir: Option<PathBuf>,
    /// `--use_fast_math`: off by default, since it changes division, sqrt and exp results.
    pub fast_math: bool,
    /// Further NVRTC options (e.g. `-lineinfo`, `-DNAME=VALUE`); part of the cache key.
    pub extra_options: Vec<String>,
}

/// Counters of where [`KernelCache::get`] found its modules.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Sources compiled by NVRTC.
    pub compiled: usize,
    /// Sources whose CUBIN was loaded from the disk cache.
    pub disk_hits: usize,
    /// Requests answered from this cache's loaded modules.
    pub memory_hits: usize,
    /// Failures to write a compiled CUBIN to disk (the module is still used).
    pub disk_write_errors: usize,
}

/// A kernel function of a loaded [`Module`]. Cheap to clone; clones share the opt-in shared
/// memory limit that [`crate::Launch`] raises on demand.
#[derive(Clone)]
pub struct Kernel {
    name: Arc<str>,
    source_name: Arc<str>,
    func: CudaFunction,
    dynamic_smem_limit: Arc<AtomicU32>,
    /// Whether the preferred carveout was already set to the most shared memory.
    carveout_max_shared: Arc<AtomicBool>,
    /// The function's static shared memory in bytes (read once, when it is loaded).
    static_smem: u32,
}

impl std::fmt::Debug for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Kernel({} in {})", self.name, self.source_name)
    }
}

/// Shared memory (static and dynamic together) a block may use without opting in.
const DEFAULT_SMEM: u32 = 48 * 1024;

impl Kernel {
    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    pub(crate) fn function(&self) -> &CudaFunction {
        &self.func
    }

    /// Raises the kernel's dynamic shared memory limit to at least `bytes`: needed where its
    /// static shared memory and `bytes` together pass 48 KiB (without the opt-in the driver
    /// allows 48 KiB less the static bytes, and refuses the launch with an invalid value).
    /// Not a stream operation, so it is allowed during capture.
    pub fn ensure_dynamic_shared_mem(&self, bytes: u32) -> Result<(), CudaError> {
        if bytes <= self.dynamic_smem_limit.load(Ordering::Relaxed) {
            return Ok(());
        }
        if self.static_smem.saturating_add(bytes) <= DEFAULT_SMEM {
            self.dynamic_smem_limit.fetch_max(bytes, Ordering::Relaxed);
            return Ok(());
        }
        let value = i32::try_from(bytes).map_err(|_| CudaError::InvalidArgument {
            what: "dynamic shared memory",
            detail: format!(
                "{bytes} bytes for kernel `{}` does not fit in i32",
                self.name
            ),
        })?;
        self.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            value,
            bytes,
        )?;
        self.dynamic_smem_limit.fetch_max(bytes, Ordering::Relaxed);
        Ok(())
    }

    /// Asks the driver to give shared memory the whole unified L1/shared array when it runs
    /// this kernel. Without the hint the driver sizes the carveout for the blocks that other
    /// limits (registers) let in, so a kernel planned for two large blocks a multiprocessor
    /// may get room for one. Once per kernel; not a stream operation (allowed in capture).
    pub fn prefer_most_shared_memory(&self) -> Result<(), CudaError> {
        if self.carveout_max_shared.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100,
            0,
        )?;
        self.carveout_max_shared.store(true, Ordering::Relaxed);
        Ok(())
    }

    /// Sets a function attribute; a refusal is reported as this kernel's launch error with
    /// the shared memory that asked for it.
    fn set_attribute(
        &self,
        attribute: CUfunction_attribute,
        value: i32,
        shared_mem: u32,
    ) -> Result<(), CudaError> {
        // SAFETY: the function handle is alive (held by self.func's module).
        unsafe {
            cudarc::driver::result::function::set_function_attribute(
                self.func.cu_function(),
                attribute,
                value,
            )
        }
        .map_err(|source| CudaError::Launch {
            kernel: self.name.to_string(),
            grid: (0, 0, 0),
            block: (0, 0, 0),
            shared_mem,
            source,
        })
    }
}

/// A compiled and loaded kernel source; hands out its [`Kernel`]s by name.
pub struct Module {
    source_name: Arc<str>,
    module: Arc<CudaModule>,
    kernels: Mutex<HashMap<String, Kernel>>,
}

impl std::fmt::Debug for Module {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Module({})", self.source_name)
    }
}

impl Module {
    pub fn source_name(&self) -> &str {
        &self.source_name
    }

    /// The `extern "C" __global__` function `name` of this module.
    pub fn kernel(&self, name: &str) -> Result<Kernel, CudaError> {
        let mut kernels = self.kernels.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(k) = kernels.get(name) {
            return Ok(k.clone());
        }
        let missing = |source| CudaError::MissingKernel {
            source_name: self.source_name.to_string(),
            kernel: name.to_string(),
            source,
        };
        if name.contains('\0') {
            return Err(missing(cudarc::driver::DriverError(
                cudarc::driver::sys::CUresult::CUDA_ERROR_INVALID_VALUE,
            )));
        }
        let func = guarded("loading a kernel function", || {
            self.module.load_function(name)
        })?
        .map_err(missing)?;
        // SAFETY: the function handle was just loaded and its module is held by `func`.
        let static_smem = unsafe {
            cudarc::driver::result::function::get_function_attribute(
                func.cu_function(),
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES,
            )
        }
        .map_err(missing)?;
        let kernel = Kernel {
            name: name.into(),
            source_name: self.source_name.clone(),
            func,
            dynamic_smem_limit: Arc::new(AtomicU32::new(0)),
            carveout_max_shared: Arc::new(AtomicBool::new(false)),
            static_smem: u32::try_from(static_smem).unwrap_or(0),
        };
        kernels.insert(name.to_string(), kernel.clone());
        Ok(kernel)
    }
}

/// Compiles CUDA C sources with NVRTC for one device, once per cache instance (keep one per
/// device for the whole process) and once per machine through the on-disk CUBIN cache.
pub struct KernelCache {
    device: Device,
    arch: String,
    options: Vec<String>,
    nvrtc_version: (i32, i32),
    dir: Option<PathBuf>,
    modules: Mutex<HashMap<(String, u64), Arc<Module>>>,
    compiled: AtomicUsize,
    disk_hits: AtomicUsize,
    memory_hits: AtomicUsize,
    disk_write_errors: AtomicUsize,
}

impl std::fmt::Debug for KernelCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KernelCache")
            .field("arch", &self.arch)
            .field("options", &self.options)
            .field("nvrtc_version", &self.nvrtc_version)
            .field("dir", &self.dir)
            .finish()
    }
}

fn nvrtc_version() -> Result<(i32, i32), CudaError> {
    let present = guarded("looking for the NVRTC library", || unsafe {
        nvrtc_sys::is_culib_present()
    })?;
    if !present {
        return Err(CudaError::NvrtcNotLoaded {
            tried: lib_candidates("nvrtc"),
        });
    }
    let (mut major, mut minor) = (0, 0);
    guarded("querying the NVRTC version", || unsafe {
        nvrtc_sys::nvrtcVersion(&mut major, &mut minor)
    })?
    .result()
    .map_err(|error| CudaError::Nvrtc {
        call: "nvrtcVersion",
        source_name: String::new(),
        error,
    })?;
    Ok((major, minor))
}

impl KernelCache {
    /// A cache with the default options and directory.
    pub fn new(device: &Device) -> Result<KernelCache, CudaError> {
        KernelCache::with_config(device, KernelCacheConfig::default())
    }

    pub fn with_config(
        device: &Device,
        config: KernelCacheConfig,
    ) -> Result<KernelCache, CudaError> {
        let nvrtc_version = nvrtc_version()?;
        let arch = device.arch();
        let mut options = vec![
            format!("--gpu-architecture={arch}"),
            "-std=c++17".to_string(),
        ];
        for dir in cuda_include_dirs() {
            options.push(format!("--include-path={dir}"));
        }
        if config.fast_math {
            options.push("--use_fast_math".to_string());
        }
        options.extend(config.extra_options);
        Ok(KernelCache {
            device: device.clone(),
            arch,
            options,
            nvrtc_version,
            dir: config.dir.or_else(default_cache_dir),
            modules: Mutex::new(HashMap::new()),
            compiled: AtomicUsize::new(0),
            disk_hits: AtomicUsize::new(0),
            memory_hits: AtomicUsize::new(0),
            disk_write_errors: AtomicUsize::new(0),
        })
    }

    /// The NVRTC options every source is compiled with.
    pub fn options(&self) -> &[String] {
        &self.options
    }

    pub fn arch(&self) -> &str {
        &self.arch
    }

    /// (major, minor) of the loaded NVRTC.
    pub fn nvrtc_version(&self) -> (i32, i32) {
        self.nvrtc_version
    }

    /// The on-disk cache directory, if any.
    pub fn dir(&self) -> Option<&Path> {
        self.dir.as_deref()
    }

    pub fn stats(&self) -> CacheStats {
        CacheStats {
            compiled: self.compiled.load(Ordering::Relaxed),
            disk_hits: self.disk_hits.load(Ordering::Relaxed),
            memory_hits: self.memory_hits.load(Ordering::Relaxed),
            disk_write_errors: self.disk_write_errors.load(Ordering::Relaxed),
        }
    }

    /// The module compiled from `source` (named `source_name` in diagnostics and cache file
    /// names), with each of `kernels` checked to exist in it.
    pub fn get(
        &self,
        source_name: &str,
        source: &str,
        kernels: &[&str],
    ) -> Result<Arc<Module>, CudaError> {
        let key = self.key_of(source);
        // Held while compiling so concurrent requests for one source compile it once.
        let mut modules = self.modules.lock().unwrap_or_else(PoisonError::into_inner);
        let module = match modules.get(&(source_name.to_string(), key)) {
            Some(m) => {
                self.memory_hits.fetch_add(1, Ordering::Relaxed);
                m.clone()
            }
            None => {
                let m = Arc::new(self.load_or_compile(source_name, source, key)?);
                modules.insert((source_name.to_string(), key), m.clone());
                m
            }
        };
        drop(modules);
        for name in kernels {
            module.kernel(name)?;
        }
        Ok(module)
    }

    /// Loads every one of `sources` (name, source) not loaded yet, reading the disk cache or
    /// compiling on one thread a source, so that a process pays its compiles before its first
    /// request rather than in it (a cold H200 host compiled the prefill kernels inside the
    /// first prompt's step: 38 s). The modules are loaded on the calling thread, where the
    /// device's context is. Returns how many sources NVRTC compiled.
    pub fn preload(&self, sources: &[(&str, &str)]) -> Result<usize, CudaError> {
        let missing: Vec<(&str, &str, u64)> = {
            let modules = self.modules.lock().unwrap_or_else(PoisonError::into_inner);
            sources
                .iter()
                .map(|&(name, src)| (name, src, self.key_of(src)))
                .filter(|&(name, _, key)| !modules.contains_key(&(name.to_string(), key)))
                .collect()
        };
        let images: Vec<Result<(Vec<u8>, bool), CudaError>> = std::thread::scope(|scope| {
            let handles: Vec<_> = missing
                .iter()
                .map(|&(name, src, key)| scope.spawn(move || self.cubin_for(name, src, key)))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(CudaError::Panicked {
                            during: "preloading a kernel source",
                            message: "the compile thread panicked".to_string(),
                        })
                    })
                })
                .collect()
        });
        let before = self.compiled.load(Ordering::Relaxed);
        for (&(name, source, key), image) in missing.iter().zip(images) {
            let (cubin, fresh) = image?;
            let module = Arc::new(self.module_from(name, source, key, cubin, fresh)?);
            self.modules
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .entry((name.to_string(), key))
                .or_insert(module);
        }
        Ok(self.compiled.load(Ordering::Relaxed) - before)
    }

    /// The cache key of `source` under this cache's architecture, options and NVRTC.
    fn key_of(&self, source: &str) -> u64 {
        cache_key(source, &self.arch, &self.options, self.nvrtc_version)
    }

    fn cache_path(&self, source_name: &str, key: u64) -> Option<PathBuf> {
        self.dir
            .as_ref()
            .map(|d| d.join(format!("{}-{key:016x}.cubin", file_stem_for(source_name))))
    }

    fn load_or_compile(
        &self,
        source_name: &str,
        source: &str,
        key: u64,
    ) -> Result<Module, CudaError> {
        let (cubin, fresh) = self.cubin_for(source_name, source, key)?;
        self.module_from(source_name, source, key, cubin, fresh)
    }

    /// The CUBIN of `source`: the disk cache's (false) or compiled and written there (true).
    /// Needs no device, so sources can be prepared on several threads.
    fn cubin_for(
        &self,
        source_name: &str,
        source: &str,
        key: u64,
    ) -> Result<(Vec<u8>, bool), CudaError> {
        if let Some(path) = self.cache_path(source_name, key)
            && let Ok(bytes) = std::fs::read(path)
            && bytes.starts_with(b"\x7fELF")
        {
            return Ok((bytes, false));
        }
        Ok((self.compile_and_store(source_name, source, key)?, true))
    }

    fn compile_and_store(
        &self,
        source_name: &str,
        source: &str,
        key: u64,
    ) -> Result<Vec<u8>, CudaError> {
        let (cubin, _log) = compile_cubin(source_name, source, &self.arch, &self.options)?;
        if let Some(path) = self.cache_path(source_name, key)
            && write_atomically(&path, &cubin).is_err()
        {
            self.disk_write_errors.fetch_add(1, Ordering::Relaxed);
        }
        Ok(cubin)
    }

    /// The module of `cubin` (`fresh`: just compiled). A disk image that does not load is a
    /// miss like a missing or corrupt file: compiled again and overwritten.
    fn module_from(
        &self,
        source_name: &str,
        source: &str,
        key: u64,
        cubin: Vec<u8>,
        fresh: bool,
    ) -> Result<Module, CudaError> {
        if !fresh {
            if let Ok(m) = self.load_image(source_name, cubin) {
                self.disk_hits.fetch_add(1, Ordering::Relaxed);
                return Ok(m);
            }
            let cubin = self.compile_and_store(source_name, source, key)?;
            self.compiled.fetch_add(1, Ordering::Relaxed);
            return self.load_image(source_name, cubin);
        }
        self.compiled.fetch_add(1, Ordering::Relaxed);
        self.load_image(source_name, cubin)
    }

    fn load_image(&self, source_name: &str, image: Vec<u8>) -> Result<Module, CudaError> {
        let ctx = self.device.context();
        let module = guarded("loading a CUBIN module", || {
            ctx.load_module(Ptx::from_binary(image))
        })?
        .map_err(CudaError::driver("cuModuleLoadData"))?;
        Ok(Module {
            source_name: source_name.into(),
            module,
            kernels: Mutex::new(HashMap::new()),
        })
    }
}

/// Writes through a temporary file and a rename so a concurrent reader never sees half a CUBIN.
fn write_atomically(path: &Path, bytes: &[u8]) -> Result<(), CudaError> {
    let io = |source| CudaError::CacheIo {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(io)?;
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    let tmp = path.with_extension(format!("tmp.{}.{nanos}", std::process::id()));
    std::fs::write(&tmp, bytes).map_err(io)?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        io(e)
    })
}

fn c_string_lossy(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().map(|&c| c as u8).collect();
    match CStr::from_bytes_until_nul(&bytes) {
        Ok(s) => s.to_string_lossy().into_owned(),
        Err(_) => String::from_utf8_lossy(&bytes).into_owned(),
    }
}

/// Prepended to every kernel source. `PDL_ENTER();` must be the first statement of every
/// kernel: launched with programmatic stream serialization (see
/// [`crate::Device::programmatic_launch`]) a kernel may start while its predecessor still runs,
/// so it first waits for the predecessor's completion and the visibility of its writes, then
/// lets its own successor be scheduled. Without the attribute both instructions are no-ops.
///
/// The one exception, `PDL_WEIGHTS_FIRST();` then `PDL_WAIT();`: a kernel whose first reads
/// are of weights (constant for the whole run, written by no kernel) may issue them before it
/// waits, so their latency overlaps its predecessor's tail; it touches nothing else before
/// `PDL_WAIT();`.
pub const PRELUDE: &str = "#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define PDL_ENTER() asm volatile(\"griddepcontrol.wait;\\n\\tgriddepcontrol.launch_dependents;\" ::: \"memory\")
#define PDL_WEIGHTS_FIRST() asm volatile(\"griddepcontrol.launch_dependents;\" ::: \"memory\")
#define PDL_WAIT() asm volatile(\"griddepcontrol.wait;\" ::: \"memory\")
#else
#define PDL_ENTER() do { } while (0)
#define PDL_WEIGHTS_FIRST() do { } while (0)
#define PDL_WAIT() do { } while (0)
#endif
";

/// What an offline compile produced: the CUBIN and NVRTC's log (with `--ptxas-options=-v`
/// among the options, the log lists each kernel's registers, spills and shared memory).
#[derive(Debug, Clone)]
pub struct OfflineBuild {
    pub cubin: Vec<u8>,
    pub log: String,
}

/// Compiles `source` for `arch` with the options a [`KernelCache`] would use, plus `extra`,
/// without a GPU or driver: only NVRTC is needed. Lets a machine without a card check that every
/// kernel compiles and read its register and spill counts.
pub fn compile_offline(
    source_name: &str,
    source: &str,
    arch: &str,
    extra: &[String],
) -> Result<OfflineBuild, CudaError> {
    nvrtc_version()?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "-std=c++17".to_string(),
    ];
    for dir in cuda_include_dirs() {
        options.push(format!("--include-path={dir}"));
    }
    options.extend(extra.iter().cloned());
    let (cubin, log) = compile_cubin(source_name, source, arch, &options)?;
    Ok(OfflineBuild { cubin, log })
}

/// Compiles `source` to a CUBIN for `arch` (a real `sm_*` target) with NVRTC; returns it with
/// the compiler's log.
fn compile_cubin(
    source_name: &str,
    source: &str,
    arch: &str,
    options: &[String],
) -> Result<(Vec<u8>, String), CudaError> {
    let invalid = |reason: &str| CudaError::InvalidSource {
        source_name: source_name.to_string(),
        reason: reason.to_string(),
    };
    let with_prelude = format!("{PRELUDE}#line 1 \"{source_name}\"\n{source}");
    let csrc = CString::new(with_prelude).map_err(|_| invalid("the source contains a NUL byte"))?;
    let cname = CString::new(source_name).map_err(|_| invalid("the name contains a NUL byte"))?;
    let nvrtc_err = |call: &'static str| {
        move |error| CudaError::Nvrtc {
            call,
            source_name: source_name.to_string(),
            error,
        }
    };
    guarded("compiling with NVRTC", || {
        let prog = nvrtc_result::create_program(&csrc, Some(&cname))
            .map_err(nvrtc_err("nvrtcCreateProgram"))?;
        // SAFETY: prog is a live program until destroy_program below, and csrc/cname outlive it.
        let out = unsafe {
            let compiled = nvrtc_result::compile_program(prog, options);
            let log = nvrtc_result::get_program_log(prog)
                .map(|l| c_string_lossy(&l))
                .unwrap_or_default();
            match compiled {
                Err(_) => Err(CudaError::Compile {
                    source_name: source_name.to_string(),
                    arch: arch.to_string(),
                    options: options.join(" "),
                    log: log.trim_end().to_string(),
                }),
                Ok(()) => {
                    let mut size = 0usize;
                    nvrtc_sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .map_err(nvrtc_err("nvrtcGetCUBINSize"))
                        .and_then(|()| {
                            let mut cubin = vec![0u8; size];
                            nvrtc_sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr().cast())
                                .result()
                                .map_err(nvrtc_err("nvrtcGetCUBIN"))
                                .map(|()| (cubin, log))
                        })
                }
            }
        };
        // SAFETY: prog was created above and is destroyed once.
        let _ = unsafe { nvrtc_result::destroy_program(prog) };
        out
    })?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a64_matches_the_published_test_vectors() {
        // Test vectors from the FNV reference (Fowler/Noll/Vo, "FNV-1a 64-bit").
        assert_eq!(fnv1a64(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a64(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a64(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn the_cache_key_changes_with_source_arch_options_and_nvrtc_version() {
        let opts = vec!["-std=c++17".to_string()];
        let base = cache_key("k()", "sm_90a", &opts, (13, 0));
        assert_eq!(base, cache_key("k()", "sm_90a", &opts, (13, 0)));
        assert_ne!(base, cache_key("k() ", "sm_90a", &opts, (13, 0)));
        assert_ne!(base, cache_key("k()", "sm_90", &opts, (13, 0)));
        assert_ne!(base, cache_key("k()", "sm_90a", &[], (13, 0)));
        let fast = vec!["-std=c++17".to_string(), "--use_fast_math".to_string()];
        assert_ne!(base, cache_key("k()", "sm_90a", &fast, (13, 0)));
        assert_ne!(base, cache_key("k()", "sm_90a", &opts, (13, 1)));
        assert_ne!(base, cache_key("k()", "sm_90a", &opts, (12, 0)));
    }

    #[test]
    fn moving_bytes_between_key_fields_changes_the_key() {
        let a = cache_key("ab", "c", &[], (13, 0));
        let b = cache_key("a", "bc", &[], (13, 0));
        assert_ne!(a, b);
        let split = cache_key("s", "a", &["-x".into(), "y".into()], (13, 0));
        let joined = cache_key("s", "a", &["-xy".into()], (13, 0));
        assert_ne!(split, joined);
    }

    #[test]
    fn hopper_gets_the_arch_specific_target_and_others_the_plain_one() {
        assert_eq!(arch_for(9, 0), "sm_90a");
        assert_eq!(arch_for(8, 9), "sm_89");
        assert_eq!(arch_for(8, 0), "sm_80");
        assert_eq!(arch_for(10, 0), "sm_100");
    }

    #[test]
    fn the_cache_dir_prefers_the_override_then_xdg_then_home() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| OsString::from(v))
            }
        };
        let all = env(&[
            ("XING4_KERNEL_CACHE", "/o"),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(resolve_cache_dir(all), Some(PathBuf::from("/o")));
        let xdg = env(&[
            ("XING4_KERNEL_CACHE", ""),
            ("XDG_CACHE_HOME", "/x"),
            ("HOME", "/h"),
        ]);
        assert_eq!(
            resolve_cache_dir(xdg),
            Some(PathBuf::from("/x/xing4-rt/kernels"))
        );
        let relative_xdg = env(&[("XDG_CACHE_HOME", "rel"), ("HOME", "/h")]);
        assert_eq!(
            resolve_cache_dir(relative_xdg),
            Some(PathBuf::from("/h/.cache/xing4-rt/kernels"))
        );
        assert_eq!(resolve_cache_dir(env(&[])), None);
    }

    #[test]
    fn cache_file_names_keep_only_safe_characters() {
        assert_eq!(file_stem_for("ops/rmsnorm.cu"), "ops_rmsnorm.cu");
        assert_eq!(file_stem_for("../../etc"), "k.._.._etc");
        assert_eq!(file_stem_for(""), "k");
        assert_eq!(file_stem_for(&"x".repeat(100)).len(), 64);
    }

    #[test]
    fn an_atomic_write_leaves_the_file_and_no_temporary_behind() {
        let dir = std::env::temp_dir().join(format!("xing4-cuda-write-{}", std::process::id()));
        let path = dir.join("a-0000000000000001.cubin");
        write_atomically(&path, b"\x7fELFabc").unwrap();
        assert_eq!(std::fs::read(&path).unwrap(), b"\x7fELFabc");
        let leftovers: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains(".tmp."))
            .collect();
        assert!(leftovers.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_nvrtc_log_is_read_up_to_its_terminating_nul() {
        let raw: Vec<std::ffi::c_char> = b"err: x\0junk"
            .iter()
            .map(|&b| b as std::ffi::c_char)
            .collect();
        assert_eq!(c_string_lossy(&raw), "err: x");
    }
}
