//! Continuous batching on the GPU: the `small` checkpoint's sequences decoded together against
//! each decoded alone on the GPU. Skips, saying why, without a CUDA GPU.

mod batch_support;
mod support;

use batch_support::*;
use engine::Device;
use engine::scheduler::SeqId;

/// Greedy ids of the GPU's batch against the GPU alone: equal, except that after the first
/// step where they differ nothing more is compared (the batch kernels differ from the
/// single-row ones by rounding, and random weights have near-ties).
#[test]
fn sequences_decoded_together_on_the_gpu_give_the_tokens_each_gives_alone() {
    // test_gpu prints why it skips.
    if !gpu_present() {
        return;
    }
    let dev = Device::Cuda(0);
    let reqs = prompts();
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| alone(dev, r)).collect();
    let mut s = scheduler(dev, 0, false);
    let mut ids: Vec<SeqId> = reqs[..4].iter().map(|r| s.add(r.clone())).collect();
    let mut out = Outcome::default();
    for _ in 0..6 {
        out.take(s.step());
    }
    ids.push(s.add(reqs[4].clone()));
    out.take(s.run_to_completion());
    let mut equal_prefix = 0;
    let mut total = 0;
    for (k, id) in ids.iter().enumerate() {
        let got = out.of(*id);
        let same = got.iter().zip(&solo[k]).take_while(|(a, b)| a == b).count();
        equal_prefix += same;
        total += solo[k].len();
        assert_eq!(got.len(), solo[k].len(), "sequence {k}");
    }
    // Rounding may flip a near-tie; most of the tokens must agree.
    assert!(
        equal_prefix * 10 >= total * 9,
        "only {equal_prefix} of {total} tokens agree before the first difference"
    );
    assert_eq!(s.pool().available(), s.pool().total());
}
