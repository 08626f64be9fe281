//! The planner and the CPU executor on a toy graph whose ops are defined here.

use std::collections::HashMap;

use graph::{Bucket, CpuExecutor, GraphBuilder, HostState, LogitRows, Plan, StepShape};
use ops::{HostTensor, HostTensorMut, Op, OpError, TensorMeta};

/// y = x · factor + bias-weight (broadcast over rows).
#[derive(Debug)]
struct ScaleAdd {
    factor: f32,
}

impl Op for ScaleAdd {
    fn name(&self) -> &'static str {
        "scale_add"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        match inputs {
            [x, b] if x.inner() == b.inner() => Ok(vec![(*x).clone()]),
            _ => Err(OpError::shape("scale_add", "x [n, d] and b [d]")),
        }
    }
    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        let x = inputs[0].f32()?;
        let b = inputs[1].f32()?;
        let y = outputs[0].f32_mut()?;
        for (i, v) in y.iter_mut().enumerate() {
            *v = x[i] * self.factor + b[i % b.len()];
        }
        Ok(())
    }
    fn describe(&self) -> String {
        format!("scale_add(factor={})", self.factor)
    }
}

/// Writes rows of x into a state at the positions given; output aliases the state.
#[derive(Debug)]
struct Append;

impl Op for Append {
    fn name(&self) -> &'static str {
        "append"
    }
    fn infer(&self, inputs: &[&TensorMeta]) -> Result<Vec<TensorMeta>, OpError> {
        Ok(vec![inputs[0].clone()])
    }
    fn cpu(
        &self,
        inputs: &[HostTensor<'_>],
        outputs: &mut [HostTensorMut<'_>],
    ) -> Result<(), OpError> {
        assert!(
            inputs[0].data.is_empty(),
            "an aliased input is not handed to the op"
        );
        let x = inputs[1].f32()?;
        let pos = inputs[2].i32()?;
        let d = inputs[1].meta.inner();
        let st = outputs[0].f32_mut()?;
        for (r, &p) in pos.iter().enumerate() {
            st[p as usize * d..(p as usize + 1) * d].copy_from_slice(&x[r * d..(r + 1) * d]);
        }
        Ok(())
    }
    fn describe(&self) -> String {
        "append".into()
    }
    fn aliases(&self) -> &'static [(usize, usize)] {
        &[(0, 0)]
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn toy_plan(weights: &HashMap<String, TensorMeta>, n: usize) -> Plan {
    let mut b = GraphBuilder::new(weights);
    let x = b.input("x", TensorMeta::f32([n, 4]));
    let pos = b.input("positions", TensorMeta::i32([n]));
    let st = b.state("cache", TensorMeta::f32([8, 4]));
    let bias = b.weight("bias").unwrap();
    let mut h = x;
    for l in 0..4 {
        h = b
            .scope(&format!("blk.{l}"), |b| {
                b.op1("h", ScaleAdd { factor: 2.0 }, &[h, bias])
            })
            .unwrap();
    }
    let st2 = b.op1("cache_write", Append, &[st, h, pos]).unwrap();
    let y = b.op1("y", ScaleAdd { factor: 1.0 }, &[h, bias]).unwrap();
    b.output("y", y);
    b.output("cache", st2);
    Plan::new(
        b.finish(),
        StepShape::single(Bucket::Prefill { chunk: n, kv: 8 }, LogitRows::All),
    )
    .unwrap()
}

#[test]
fn values_whose_lifetimes_do_not_overlap_share_arena_bytes() {
    let weights = HashMap::from([("bias".to_string(), TensorMeta::f32([4]))]);
    let plan = toy_plan(&weights, 64);
    let per_value = 64 * 4 * 4;
    // Six f32 [64,4] values are produced in a chain plus the input; two at a time are live.
    assert!(
        plan.arena_bytes <= 3 * per_value + 2 * graph::SLOT_ALIGN,
        "{}",
        plan.arena_bytes
    );
    // And no two simultaneously-live values overlap: check every node's inputs vs outputs.
    for node in &plan.graph.nodes {
        for &o in &node.outputs {
            let Some(so) = plan.slot(plan.storage_of(o)) else {
                continue;
            };
            for &i in &node.inputs {
                if let Some(si) = plan.slot(plan.storage_of(i)) {
                    let disjoint =
                        so.offset + so.bytes <= si.offset || si.offset + si.bytes <= so.offset;
                    assert!(disjoint, "{} overlaps its input", node.name);
                }
            }
        }
    }
}

#[test]
fn the_executor_computes_the_chain_and_writes_state_in_place() {
    let weights = HashMap::from([("bias".to_string(), TensorMeta::f32([4]))]);
    let data = HashMap::from([("bias".to_string(), f32_bytes(&[1.0, 0.0, -1.0, 0.5]))]);
    let plan = toy_plan(&weights, 2);
    let mut state = HostState::for_plan(&plan, 8).unwrap();
    let mut exec = CpuExecutor::new();
    let x = f32_bytes(&[1.0, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0]);
    let pos: Vec<u8> = [5i32, 2].iter().flat_map(|p| p.to_le_bytes()).collect();
    exec.run(&plan, &data, &mut state, &[("x", &x), ("positions", &pos)])
        .unwrap();
    let bias = [1.0f32, 0.0, -1.0, 0.5];
    let mut h = [1.0f32, 2.0, 3.0, 4.0, 0.0, 0.0, 0.0, 0.0];
    for _ in 0..4 {
        for (i, v) in h.iter_mut().enumerate() {
            *v = *v * 2.0 + bias[i % 4];
        }
    }
    let y = exec.output_f32(&plan, "y").unwrap();
    for i in 0..8 {
        assert_eq!(y[i], h[i] + bias[i % 4]);
    }
    let cache = state.get("cache").unwrap().f32s();
    assert_eq!(&cache[5 * 4..6 * 4], &h[0..4]);
    assert_eq!(&cache[2 * 4..3 * 4], &h[4..8]);
    assert_eq!(&cache[0..4], &[0.0; 4]);
}

#[test]
fn a_missing_weight_and_a_bad_shape_are_named() {
    let weights: HashMap<String, TensorMeta> =
        HashMap::from([("bias".to_string(), TensorMeta::f32([3]))]);
    let mut b = GraphBuilder::new(&weights);
    assert!(b.weight("nope").unwrap_err().to_string().contains("`nope`"));
    let x = b.input("x", TensorMeta::f32([1, 4]));
    let bias = b.weight("bias").unwrap();
    let e = b
        .scope("blk.7", |b| {
            b.op1("h", ScaleAdd { factor: 1.0 }, &[x, bias])
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("blk.7.h") && e.contains("F32[3]"), "{e}");
}

#[test]
fn a_nodes_bytes_count_its_weights_and_activations_once_and_leave_the_cache_out() {
    let weights = HashMap::from([("bias".to_string(), TensorMeta::f32([4]))]);
    let plan = toy_plan(&weights, 3);
    let g = &plan.graph;
    let node = |name: &str| g.nodes.iter().find(|n| n.name == name).unwrap();
    let rows = 3 * 4 * 4;
    // h = x·2 + bias: x and h (3×4 f32) and the 4-value bias.
    assert_eq!(g.node_bytes(node("blk.1.h")), (2 * rows + 16) as u64);
    // The cache write reads h and the positions; the cache it writes in place is not counted.
    assert_eq!(g.node_bytes(node("cache_write")), (rows + 3 * 4) as u64);
}

#[test]
fn a_routed_products_bytes_count_the_experts_its_step_touched() {
    use ops::moe::{ExpertDown, ExpertKernel};
    let (e, embd, nf) = (8usize, 64usize, 32usize);
    let down = TensorMeta::new([e, embd, nf], ops::DType::IQ4_NL);
    let weights = HashMap::from([("down_exps".to_string(), down.clone())]);
    let mut b = GraphBuilder::new(&weights);
    let act = b.input("act", TensorMeta::f32([3, nf]));
    let offsets = b.input("offsets", TensorMeta::i32([e + 1]));
    let w = b.weight("down_exps").unwrap();
    let op = ExpertDown {
        n_expert: e,
        n_embd: embd,
        kernel: ExpertKernel::Unlowered,
    };
    let y = b.op1("experts_down", op, &[act, w, offsets]).unwrap();
    b.output("y", y);
    let g = b.finish();
    let node = g.nodes.iter().find(|n| n.name == "experts_down").unwrap();
    let whole = g.node_bytes(node);
    let stack = down.bytes().unwrap() as u64;
    // Every expert touched: the whole stack; two of eight: a quarter of it; none: no weight.
    assert_eq!(g.node_bytes_touched(node, e, e), whole);
    assert_eq!(g.node_bytes_touched(node, 2, e), whole - stack * 6 / 8);
    assert_eq!(g.node_bytes_touched(node, 0, e), whole - stack);
    // Three routes to experts 1 and 6 (offsets 0,0,2,2,2,2,2,3,3): two touched.
    assert_eq!(graph::touched_experts(&[0, 0, 2, 2, 2, 2, 2, 3, 3]), 2);
    assert_eq!(graph::touched_experts(&[0; 9]), 0);
}
