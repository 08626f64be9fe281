//! Each architecture's tensor table against what its declaration reads and against the
//! released inventory (spec §2).

use std::collections::BTreeSet;
use std::fs;

use graph::{Bucket, GraphBuilder, LogitRows, StepShape, ValueKind};
use loader::GgmlType;
use loader::hparams::{Arch, HParams};
use models::synth::{Dims, Preset, SynthOptions, write_checkpoint};

fn in_trunk(h: &HParams, name: &str) -> bool {
    let block = name.strip_prefix("blk.").and_then(|s| s.split('.').next());
    block.is_none_or(|b| b.parse::<usize>().is_ok_and(|b| b < h.n_layer))
}

/// The names a declaration asks `b.weight` for are written apart from the table, so this is
/// what keeps them one list.
#[test]
fn each_declaration_reads_exactly_the_trunk_tensors_of_its_table() {
    for arch in [Arch::Xing4_0, Arch::Deepseek2] {
        let dir = std::env::temp_dir().join(format!("tensor_tables_{arch}_{}", std::process::id()));
        write_checkpoint(&SynthOptions {
            arch,
            dims: Dims::preset(Preset::Tiny),
            seed: 1,
            out: dir.clone(),
            force: true,
            progress: false,
        })
        .unwrap_or_else(|e| panic!("{e:#}"));
        let model = models::load(&dir.join("model.gguf"), Some(&dir), false)
            .unwrap()
            .model;
        let shape = StepShape::single(Bucket::Prefill { chunk: 8, kv: 64 }, LogitRows::All);
        let mut b = GraphBuilder::new(&*model);
        model.decl.declare(&mut b, &shape).unwrap();
        let read: BTreeSet<String> = b
            .finish()
            .of_kind(ValueKind::Weight)
            .map(|(_, v)| v.name.clone())
            .collect();
        let h = &model.hparams;
        let listed: BTreeSet<String> = models::tensors(h)
            .into_iter()
            .map(|r| r.name)
            .filter(|n| in_trunk(h, n))
            .collect();
        assert_eq!(read, listed, "{arch}");
        fs::remove_dir_all(&dir).unwrap();
    }
}

#[test]
fn the_full_preset_table_is_the_release_inventory_of_spec_section_2() {
    let h = Dims::preset(Preset::Full).hparams(Arch::Xing4_0).unwrap();
    let rules = models::tensors(&h);
    // 40 trunk blocks (2 dense of 19 tensors, 38 MoE of 24), the NextN block's 24, 3 globals.
    assert_eq!(rules.len(), 2 * 19 + 38 * 24 + 24 + 3);
    assert_eq!(rules.len(), 977);
    let count = |ty| rules.iter().filter(|r| r.release == ty).count();
    let per_type = [
        GgmlType::IQ4_NL,
        GgmlType::BF16,
        GgmlType::F32,
        GgmlType::Q6_K,
    ]
    .map(count);
    assert_eq!(per_type, [243, 327, 406, 1]);
    assert!(rules.iter().all(|r| r.allowed.contains(&r.release)));
    let find = |n: &str| rules.iter().find(|r| r.name == n).unwrap().ne.clone();
    assert_eq!(find("blk.0.hc_attn_fn.weight"), [14336, 24]);
    assert_eq!(find("blk.5.attn_k_b.weight"), [128, 512, 32]);
    assert_eq!(find("blk.5.attn_v_b.weight"), [512, 128, 32]);
    assert_eq!(find("blk.5.attn_q_b.weight"), [768, 6144]);
    assert_eq!(find("blk.5.attn_kv_a_mqa.weight"), [3584, 576]);
    assert_eq!(find("blk.5.attn_output.weight"), [4096, 3584]);
    assert_eq!(find("blk.1.ffn_down.weight"), [9216, 3584]);
    assert_eq!(find("blk.39.ffn_down_exps.weight"), [1024, 3584, 64]);
    assert_eq!(find("blk.40.nextn.eh_proj.weight"), [7168, 3584]);
    assert_eq!(find("output.weight"), [3584, 131072]);
    let nextn: Vec<_> = rules
        .iter()
        .filter(|r| r.name.starts_with("blk.40."))
        .collect();
    assert_eq!(nextn.len(), 24);
    assert!(nextn.iter().all(|r| !r.name.contains(".hc_")));
}
