//! The parity harness over the registry (`ops::parity::registry()`, each family's `cases.rs`),
//! in the spirit of ggml's `test-backend-ops`.
//!
//! * `every_registered_case_matches_its_cpu_reference`: each case on the GPU against the CPU
//!   reference, one line per case (name, normalized MSE, bound); fails with the list of failing
//!   cases. Skips without a GPU, saying why.
//! * `registered_case_timings` (ignored; `--include-ignored --nocapture` on the GPU host): a
//!   table of µs per call, GB/s over the bytes the case must move, and the share of the card's
//!   device-to-device copy ceiling.
//! * `every_registered_case_runs_on_the_cpu`: no GPU needed (so CI checks the registry itself):
//!   every case's inputs pass the op's `infer` and its CPU reference gives finite outputs.

use std::collections::HashSet;

use ops::parity::{
    H200_COPY_CEILING_GBS, ParityCase, copy_ceiling_gbs, registry, run_case, test_gpu, time_op_us,
};

/// Whether `case` can run on a device of compute capability `cc`.
fn runs_on(case: &ParityCase, cc: (u32, u32)) -> bool {
    case.needs_cc.is_none_or(|need| need == cc)
}

#[test]
fn every_registered_case_runs_on_the_cpu() {
    let cases = registry();
    let mut names = HashSet::new();
    let mut failed = Vec::new();
    for case in &cases {
        assert!(
            names.insert(case.name.clone()),
            "{}: name registered twice",
            case.name
        );
        assert!(
            case.max_nmse.is_finite() && case.max_nmse >= 0.0,
            "{}: bound {}",
            case.name,
            case.max_nmse
        );
        if let Err(e) = case.check_cpu() {
            failed.push(format!("{} ({}): {e}", case.name, case.op.describe()));
        }
    }
    println!("{} registered parity cases", cases.len());
    assert!(
        failed.is_empty(),
        "{} of {} cases fail on the CPU:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}

#[test]
fn every_registered_case_matches_its_cpu_reference() {
    let Some(gpu) = test_gpu() else { return };
    let cc = gpu.device.compute_capability();
    let cases = registry();
    let mut failed = Vec::new();
    println!("{:<64} {:>11} {:>11}", "case", "nmse", "bound");
    for case in &cases {
        if !runs_on(case, cc) {
            println!(
                "{:<64} skipped: needs compute capability {:?}, the device has {cc:?}",
                case.name, case.needs_cc
            );
            continue;
        }
        match run_case(&gpu, case) {
            Ok(e) => {
                let ok = e <= case.max_nmse; // NaN fails
                println!(
                    "{:<64} {e:>11.3e} {:>11.3e}{}",
                    case.name,
                    case.max_nmse,
                    if ok { "" } else { "  FAIL" }
                );
                if !ok {
                    failed.push(format!(
                        "{}: nmse {e:.3e} over {:.3e}",
                        case.name, case.max_nmse
                    ));
                }
            }
            Err(e) => {
                println!("{:<64} error: {e}", case.name);
                failed.push(format!("{} ({}): {e}", case.name, case.op.describe()));
            }
        }
    }
    assert!(
        failed.is_empty(),
        "{} of {} cases fail:\n{}",
        failed.len(),
        cases.len(),
        failed.join("\n")
    );
}

#[test]
#[ignore = "timing table of the registry: run on the GPU host with --include-ignored --nocapture"]
fn registered_case_timings() {
    let Some(gpu) = test_gpu() else { return };
    let cc = gpu.device.compute_capability();
    let (ceiling, source) = match copy_ceiling_gbs(&gpu) {
        Ok(c) => (c, "measured: 1 GiB device-to-device copy"),
        Err(e) => {
            eprintln!("copy ceiling not measured ({e}); using the H200's");
            (H200_COPY_CEILING_GBS, "H200_COPY_CEILING_GBS")
        }
    };
    println!("copy ceiling {ceiling:.0} GB/s ({source})");
    println!(
        "{:<64} {:>10} {:>11} {:>8} {:>7}",
        "case", "µs", "MB moved", "GB/s", "copy %"
    );
    for case in registry() {
        if !runs_on(&case, cc) {
            continue;
        }
        let inputs = case.inputs();
        let bytes = case.bytes_moved(&inputs).expect("bytes") as f64;
        match time_op_us(&gpu, case.op.as_ref(), &inputs, 20) {
            Ok(us) => {
                let gbs = bytes / us / 1e3;
                // Cases under the 60 MB L2 may be served from it on replay: marked.
                let l2 = if bytes < 50e6 { " (L2)" } else { "" };
                println!(
                    "{:<64} {us:>10.2} {:>11.2} {gbs:>8.0} {:>6.1}%{l2}",
                    case.name,
                    bytes / 1e6,
                    100.0 * gbs / ceiling
                );
            }
            Err(e) => println!("{:<64} error: {e}", case.name),
        }
    }
}
