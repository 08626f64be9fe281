//! The CUDA executor on a toy graph of element-wise ops (eager, captured replay and
//! the CPU executor agree; skips without a GPU), and the scratch planning every
//! executor relies on (no GPU needed).

use std::collections::HashMap;
use std::sync::Arc;

use graph::{
    Bucket, CpuExecutor, CudaExecutor, GraphBuilder, HostState, LogitRows, Plan, StepShape,
    lowered_launches,
};
use ops::elementwise::{Add, SwiGlu};
use ops::{HostTensor, HostTensorMut, Op, OpError, TensorMeta};

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    let mut s = seed | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s >> 8) as f32 / (1u32 << 24) as f32 * 6.0 - 3.0
        })
        .collect()
}

const ROWS: usize = 3;
const COLS: usize = 1000;

/// y = swiglu(x + w, x) + w, then again over its own output: five element-wise launches.
fn toy_plan(weights: &HashMap<String, TensorMeta>) -> Plan {
    let mut b = GraphBuilder::new(weights);
    let x = b.input("x", TensorMeta::f32([ROWS, COLS]));
    let w = b.weight("w").unwrap();
    let a = b.op1("a", Add, &[x, w]).unwrap();
    let g = b.op1("g", SwiGlu, &[a, x]).unwrap();
    let y = b.op1("y", Add, &[g, w]).unwrap();
    let g2 = b.op1("g2", SwiGlu, &[y, a]).unwrap();
    let z = b.op1("z", Add, &[g2, x]).unwrap();
    b.output("z", z);
    Plan::new(
        b.finish(),
        StepShape::single(Bucket::Prefill { chunk: ROWS, kv: 1 }, LogitRows::All),
    )
    .unwrap()
}

fn cpu_run(plan: &Plan, w: &HashMap<String, Vec<u8>>, x: &[u8]) -> Vec<f32> {
    let mut state = HostState::for_plan(plan, 1).unwrap();
    let mut exec = CpuExecutor::new();
    exec.run(plan, w, &mut state, &[("x", x)]).unwrap();
    exec.output_f32(plan, "z").unwrap().to_vec()
}

fn assert_close(cpu: &[f32], gpu: &[f32]) {
    assert_eq!(cpu.len(), gpu.len());
    for (i, (c, g)) in cpu.iter().zip(gpu).enumerate() {
        // expf on the card and on the host may differ in the last ulp.
        assert!(
            (c - g).abs() <= 1e-5 * c.abs() + 1e-6,
            "element {i}: cpu {c}, gpu {g}"
        );
    }
}

#[test]
fn eager_and_replayed_steps_equal_each_other_and_the_cpu() {
    let Some(ctx) = ops::parity::test_gpu() else {
        return;
    };
    let metas = HashMap::from([("w".to_string(), TensorMeta::f32([ROWS, COLS]))]);
    let plan = toy_plan(&metas);
    let w = HashMap::from([("w".to_string(), f32_bytes(&values(ROWS * COLS, 7)))]);
    let mut exec = CudaExecutor::new(Arc::new(ctx), &plan, &w, 1).unwrap();

    let x1 = f32_bytes(&values(ROWS * COLS, 11));
    let x2 = f32_bytes(&values(ROWS * COLS, 12));
    exec.run_eager(&plan, &[("x", &x1)]).unwrap();
    let eager1 = exec.output_f32(&plan, "z").unwrap();
    assert_close(&cpu_run(&plan, &w, &x1), &eager1);

    exec.capture(&plan).unwrap();
    // The replay must read the step input uploaded now, not the one seen at capture.
    exec.replay(&plan, &[("x", &x2)]).unwrap();
    let replay2 = exec.output_f32(&plan, "z").unwrap();
    assert_close(&cpu_run(&plan, &w, &x2), &replay2);
    exec.run_eager(&plan, &[("x", &x2)]).unwrap();
    let eager2 = exec.output_f32(&plan, "z").unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&eager2), bits(&replay2), "eager and replay differ");
    exec.replay(&plan, &[("x", &x1)]).unwrap();
    assert_eq!(bits(&exec.output_f32(&plan, "z").unwrap()), bits(&eager1));

    exec.set_timing(true).unwrap();
    exec.replay(&plan, &[("x", &x1)]).unwrap();
    let t = exec
        .last_timing()
        .expect("a timed replay records its timing");
    assert!(t.device_s > 0.0 && t.host_submit_s > 0.0, "{t:?}");
}

#[test]
fn capture_before_an_eager_run_is_refused_and_a_wrong_input_size_is_named() {
    let Some(ctx) = ops::parity::test_gpu() else {
        return;
    };
    let metas = HashMap::from([("w".to_string(), TensorMeta::f32([ROWS, COLS]))]);
    let plan = toy_plan(&metas);
    let w = HashMap::from([("w".to_string(), f32_bytes(&values(ROWS * COLS, 7)))]);
    let mut exec = CudaExecutor::new(Arc::new(ctx), &plan, &w, 1).unwrap();
    let e = exec.capture(&plan).unwrap_err().to_string();
    assert!(e.contains("eager run first"), "{e}");
    let e = exec
        .run_eager(&plan, &[("x", &[0u8; 12])])
        .unwrap_err()
        .to_string();
    assert!(e.contains("`x`") && e.contains("12"), "{e}");
    let short = HashMap::from([("w".to_string(), vec![0u8; 8])]);
    let e = CudaExecutor::new(exec.ctx().clone(), &plan, &short, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("`w`") && e.contains("8 bytes"), "{e}");
}

/// x · 2 on the CPU; asks for device scratch proportional to its input.
#[derive(Debug)]
struct Doubler {
    scratch_per_elem: usize,
}

impl Op for Doubler {
    fn name(&self) -> &'static str {
        "doubler"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        Ok(vec![inputs[0].clone()])
    }
    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        let x = inputs[0].f32()?;
        for (o, v) in outputs[0].f32_mut()?.iter_mut().zip(x) {
            *o = v * 2.0;
        }
        Ok(())
    }
    fn describe(&self) -> String {
        format!("doubler(scratch_per_elem={})", self.scratch_per_elem)
    }
    fn cuda_scratch_bytes(&self, inputs: &[&TensorMeta]) -> usize {
        inputs[0].numel() * self.scratch_per_elem
    }
}

fn chain(scratch_per_elem: usize) -> Plan {
    let none: HashMap<String, TensorMeta> = HashMap::new();
    let mut b = GraphBuilder::new(&none);
    let mut h = b.input("x", TensorMeta::f32([16, 64]));
    for l in 0..4 {
        h = b
            .scope(&format!("blk.{l}"), |b| {
                b.op1("d", Doubler { scratch_per_elem }, &[h])
            })
            .unwrap();
    }
    b.output("y", h);
    Plan::new(
        b.finish(),
        StepShape::single(Bucket::Prefill { chunk: 16, kv: 1 }, LogitRows::All),
    )
    .unwrap()
}

#[test]
fn scratch_never_overlaps_a_value_live_at_its_node_and_leaves_the_cpu_layout_alone() {
    let without = chain(0);
    let with = chain(8);
    assert_eq!(with.arena_bytes, without.arena_bytes);
    assert_eq!(with.slots, without.slots);
    assert_eq!(without.device_arena_bytes, without.arena_bytes);
    assert!(without.scratch.iter().all(|s| s.is_none()));
    let value_bytes = 16 * 64 * 4;
    for (n, node) in with.graph.nodes.iter().enumerate() {
        let s = with.scratch[n].expect("every doubler asked for scratch");
        assert!(s.bytes >= 2 * value_bytes);
        assert!(s.offset + s.bytes <= with.device_arena_bytes);
        for &v in node.inputs.iter().chain(&node.outputs) {
            let slot = with.slot(with.storage_of(v)).unwrap();
            let disjoint =
                s.offset + s.bytes <= slot.offset || slot.offset + slot.bytes <= s.offset;
            assert!(disjoint, "{}: scratch {s:?} overlaps {slot:?}", node.name);
        }
    }
    // The CPU executor ignores scratch and still computes the chain.
    let x: Vec<f32> = (0..16 * 64).map(|i| i as f32).collect();
    let mut state = HostState::for_plan(&with, 1).unwrap();
    let mut exec = CpuExecutor::new();
    let none: HashMap<String, Vec<u8>> = HashMap::new();
    exec.run(&with, &none, &mut state, &[("x", &f32_bytes(&x))])
        .unwrap();
    let y = exec.output_f32(&with, "y").unwrap();
    assert_eq!(y[5], 5.0 * 16.0);
}

#[test]
fn the_lowering_lists_every_launch_with_its_views_and_scratch() {
    let plan = chain(8);
    let text = lowered_launches(&plan).unwrap();
    assert_eq!(text.lines().filter(|l| l.contains("doubler(")).count(), 4);
    assert_eq!(
        text.lines().filter(|l| l.contains(" scratch a+")).count(),
        4
    );
    assert!(
        text.starts_with("lowered Prefill { chunk: 16, kv: 1 }"),
        "{text}"
    );
    assert!(text.contains("input x F32[16,64] a+"), "{text}");
}

#[test]
fn two_plans_get_distinct_ids_and_a_clone_keeps_its_own() {
    let a = chain(0);
    let b = chain(0);
    assert_ne!(a.id, b.id);
    assert_eq!(a.clone().id, a.id);
}
