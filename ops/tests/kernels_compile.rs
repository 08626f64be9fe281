//! Every CUDA source compiles for the H200's architecture with NVRTC alone: no card or driver is
//! needed, so a kernel that does not build fails here rather than on the device. Where NVRTC is
//! not installed the test says so and passes. With `XING4_CUBIN_DIR` set, each source's CUBIN
//! is written there (for `cuobjdump --dump-sass`).

use cuda::{CudaError, compile_offline};

const ARCH: &str = "sm_90a";

/// One line per kernel from ptxas's verbose log: registers, spills, shared memory.
fn resource_lines(log: &str) -> Vec<&str> {
    log.lines()
        .filter(|l| l.contains("Used") || l.contains("spill") || l.contains("Compiling entry"))
        .collect()
}

#[test]
fn every_kernel_source_compiles_for_sm_90a_without_spilling() {
    let mut spilled = Vec::new();
    let sources = ops::kernel_sources()
        .into_iter()
        .chain([("stall.cu", cuda::STALL_CU)]);
    for (name, source) in sources {
        let build = match compile_offline(name, source, ARCH, &["--ptxas-options=-v".into()]) {
            Ok(b) => b,
            Err(CudaError::NvrtcNotLoaded { tried }) => {
                // CI installs NVRTC from PyPI (.ci/run), so there a missing library is a failure.
                assert!(
                    std::env::var_os("CI").is_none(),
                    "CI must provide NVRTC (tried {tried})"
                );
                println!("skipped: NVRTC is not installed here (tried {tried})");
                return;
            }
            Err(e) => panic!("{name} does not compile for {ARCH}: {e}"),
        };
        assert!(build.cubin.starts_with(b"\x7fELF"), "{name}: not a CUBIN");
        // For reading the machine code (cuobjdump --dump-sass) without a card.
        if let Some(dir) = std::env::var_os("XING4_CUBIN_DIR") {
            let path = std::path::Path::new(&dir).join(format!("{name}.cubin"));
            std::fs::write(&path, &build.cubin)
                .unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
        }
        let mut entry = String::new();
        for line in resource_lines(&build.log) {
            println!("{name}: {}", line.trim());
            if line.contains("Compiling entry") {
                entry = line.trim().to_string();
            }
            if line.contains("spill") && !line.contains(" 0 bytes spill stores") {
                spilled.push(format!("{name}: {entry}: {}", line.trim()));
            }
        }
    }
    assert!(
        spilled.is_empty(),
        "kernels spill registers:\n{}",
        spilled.join("\n")
    );
}

/// The name of each kernel (`extern "C" __global__` function) whose body does not start with
/// `PDL_ENTER();` (or `PDL_WEIGHTS_FIRST();` in a source that has a `PDL_WAIT();`). Macro-made
/// kernels are checked in their macro's text.
fn kernels_without_pdl_enter(source: &str) -> Vec<String> {
    let mut missing = Vec::new();
    let mut rest = source;
    while let Some(at) = rest.find("extern \"C\" __global__") {
        rest = &rest[at..];
        let Some(open) = rest.find('{') else { break };
        let mut signature = rest[..open].to_string();
        if let Some(lb) = signature.find("__launch_bounds__(")
            && let Some(close) = signature[lb..].find(')')
        {
            signature.replace_range(lb..lb + close + 1, "");
        }
        let name = signature
            .split('(')
            .next()
            .and_then(|head| head.split_whitespace().last())
            .unwrap_or("?")
            .to_string();
        let body = rest[open + 1..].trim_start_matches(|c: char| c.is_whitespace() || c == '\\');
        // The exception (cuda::PRELUDE): weight loads first, then PDL_WAIT() in the body.
        let weights_first =
            body.starts_with("PDL_WEIGHTS_FIRST();") && source.contains("PDL_WAIT();");
        if !body.starts_with("PDL_ENTER();") && !weights_first {
            missing.push(name);
        }
        rest = &rest[open + 1..];
    }
    missing
}

/// Launches carry the programmatic-serialization attribute on Hopper, so a kernel that touched
/// memory before `griddepcontrol.wait` could read its predecessor's inputs half-written.
#[test]
fn every_kernel_waits_for_its_predecessor_before_anything_else() {
    let sources = ops::kernel_sources()
        .into_iter()
        .chain([("stall.cu", cuda::STALL_CU)]);
    let mut missing = Vec::new();
    for (name, source) in sources {
        for kernel in kernels_without_pdl_enter(source) {
            missing.push(format!("{name}: {kernel}"));
        }
    }
    assert!(
        missing.is_empty(),
        "kernels not starting with PDL_ENTER();\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_pdl_check_sees_plain_and_macro_kernels() {
    let src = "extern \"C\" __global__ void a(int* x) {\n    PDL_ENTER();\n}\n\
               #define K(N) extern \"C\" __global__ void b_##N(int* x) { \\\n    x[0] = 1; }\n\
               extern \"C\" __global__ void __launch_bounds__(128) c(int* x) { x[0] = 2; }\n";
    assert_eq!(kernels_without_pdl_enter(src), vec!["b_##N", "c"]);
    let early = "extern \"C\" __global__ void d(int* x) {\n    PDL_WEIGHTS_FIRST();\n}\n";
    assert_eq!(
        kernels_without_pdl_enter(early),
        vec!["d"],
        "weights first without a wait"
    );
    let waits = format!("{early}__device__ void e() {{ PDL_WAIT(); }}\n");
    assert!(kernels_without_pdl_enter(&waits).is_empty());
}
