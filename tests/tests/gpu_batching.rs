//! Continuous batching on the GPU: the `small` checkpoint's sequences decoded together against
//! each decoded alone on the GPU. Skips, saying why, without a CUDA GPU.

mod batch_support;
mod support;

use batch_support::*;
use engine::scheduler::{Scheduler, SchedulerConfig, SeqId};
use engine::{Device, Engine, EngineConfig, GenerateRequest};

/// Where a batched sequence first leaves its alone run, and how close that choice was.
struct Parting {
    step: usize,
    /// The alone run's logit of its token minus its logit of the batch's token.
    gap: f32,
    /// The largest |batch − alone| logit difference of that row.
    diff: f32,
}

/// Compares each sequence's batched greedy ids with its alone ids step by step. A batch step
/// computes its rows on other kernels than a one-row step (the skinny and tensor-core products
/// narrow to f16/bf16 where the one-token GEMVs sum in f32), so a near-tie may flip; a flip
/// is accepted only where the alone run's gap between the two tokens is within twice the
/// largest logit difference between the two runs' rows (no rounding that small could flip a
/// clear choice). Nothing is compared after a sequence's first difference. Returns the
/// partings and the largest logit difference seen where the tokens agreed.
fn compare(
    batch_ids: &[Vec<u32>],
    batch_logits: &[Vec<Vec<f32>>],
    solo: &[(Vec<u32>, Vec<Vec<f32>>)],
) -> (Vec<Parting>, f32) {
    let mut partings = Vec::new();
    let mut worst = 0f32;
    for (k, (ids, (solo_ids, solo_logits))) in batch_ids.iter().zip(solo).enumerate() {
        assert_eq!(ids.len(), solo_ids.len(), "sequence {k}: token count");
        for (step, (a, b)) in ids.iter().zip(solo_ids).enumerate() {
            let (rb, ra) = (&batch_logits[k][step], &solo_logits[step]);
            let diff = rb
                .iter()
                .zip(ra)
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            if a == b {
                worst = worst.max(diff);
                continue;
            }
            let gap = ra[*b as usize] - ra[*a as usize];
            assert!(
                gap <= 2.0 * diff,
                "sequence {k} step {step}: the batch chose {a} where alone chose {b} by a gap of \
                 {gap:.4e}, more than twice the rows' largest difference {diff:.4e}"
            );
            partings.push(Parting { step, gap, diff });
            break;
        }
    }
    (partings, worst)
}

fn with_logits(mut r: GenerateRequest) -> GenerateRequest {
    r.want_logits = true;
    r
}

/// Five sequences, one joining mid-decode (mixed steps), against each alone.
#[test]
fn sequences_decoded_together_on_the_gpu_part_from_their_alone_tokens_only_at_near_ties() {
    // test_gpu prints why it skips.
    if !gpu_present() {
        return;
    }
    let dev = Device::Cuda(0);
    let reqs: Vec<GenerateRequest> = prompts().into_iter().map(with_logits).collect();
    let solo: Vec<_> = reqs.iter().map(|r| alone_with_logits(dev, r)).collect();
    let mut s = scheduler(dev, 0, false);
    let mut ids: Vec<SeqId> = reqs[..4].iter().map(|r| s.add(r.clone())).collect();
    let mut out = Outcome::default();
    for _ in 0..6 {
        out.take(s.step());
    }
    ids.push(s.add(reqs[4].clone()));
    out.take(s.run_to_completion());
    let batch_ids: Vec<_> = ids.iter().map(|id| out.of(*id)).collect();
    let batch_logits: Vec<_> = ids.iter().map(|id| out.logits_of(*id)).collect();
    let (partings, worst) = compare(&batch_ids, &batch_logits, &solo);
    for p in &partings {
        eprintln!(
            "parted at step {}: alone's gap {:.3e}, rows differ by {:.3e}",
            p.step, p.gap, p.diff
        );
    }
    eprintln!("largest logit difference where the tokens agree: {worst:.3e}");
    assert_eq!(s.pool().available(), s.pool().total());
}

/// 32 sequences decoding together (the skinny kernels' shapes) against each alone.
#[test]
fn thirty_two_sequences_on_the_gpu_part_from_their_alone_tokens_only_at_near_ties() {
    if !gpu_present() {
        return;
    }
    let dev = Device::Cuda(0);
    let config = EngineConfig {
        max_model_len: 128,
        device: dev,
        max_num_seqs: 32,
        block_size: 16,
        ..EngineConfig::default()
    };
    let reqs: Vec<GenerateRequest> = (0..32)
        .map(|i| with_logits(request(prompt(5 + 3 * i, 40 + i as u32), 24)))
        .collect();
    let solo: Vec<_> = reqs.iter().map(|r| alone_with_logits(dev, r)).collect();
    let engine = Engine::new(model_for(dev), config).expect("engine");
    let mut s = Scheduler::new(
        engine,
        SchedulerConfig {
            max_num_seqs: 32,
            max_num_batched_tokens: 4096,
            prefix_caching: false,
            sample_on_host: false,
            ..SchedulerConfig::default()
        },
        None,
    );
    let ids: Vec<SeqId> = reqs.iter().map(|r| s.add(r.clone())).collect();
    let mut out = Outcome::default();
    out.take(s.run_to_completion());
    let batch_ids: Vec<_> = ids.iter().map(|id| out.of(*id)).collect();
    let batch_logits: Vec<_> = ids.iter().map(|id| out.logits_of(*id)).collect();
    let (partings, worst) = compare(&batch_ids, &batch_logits, &solo);
    let agreed: usize = batch_ids
        .iter()
        .zip(&solo)
        .map(|(a, (b, _))| a.iter().zip(b).take_while(|(x, y)| x == y).count())
        .sum();
    eprintln!(
        "32 sequences: {agreed} of {} tokens agree before a parting; {} partings; largest logit \
         difference where the tokens agree {worst:.3e}",
        32 * 24,
        partings.len()
    );
    for p in &partings {
        eprintln!(
            "parted at step {}: alone's gap {:.3e}, rows differ by {:.3e}",
            p.step, p.gap, p.diff
        );
    }
    assert_eq!(s.pool().available(), s.pool().total());
}

/// A constrained sequence turns its batch's steps to logits read-back (no on-card argmax) and
/// takes only its mask's tokens; the others still decode to their length.
#[test]
fn a_constrained_sequence_on_the_gpu_takes_only_masked_tokens_beside_greedy_ones() {
    if !gpu_present() {
        return;
    }
    let dev = Device::Cuda(0);
    let reqs = prompts();
    let vocab = model_for(dev).decl.n_vocab();
    let mut s = scheduler(dev, 0, false);
    let ids: Vec<SeqId> = reqs[..4].iter().map(|r| s.add(r.clone())).collect();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let allowed = vec![400, 401, 9];
    assert!(s.constrain(
        ids[2],
        Box::new(Cycle {
            allowed: allowed.clone(),
            vocab,
            seen: seen.clone(),
        })
    ));
    let mut out = Outcome::default();
    out.take(s.run_to_completion());
    let got = out.of(ids[2]);
    let want: Vec<u32> = (0..got.len()).map(|n| allowed[n % 3]).collect();
    assert_eq!(got, want);
    assert_eq!(*seen.lock().unwrap(), got);
    for (k, id) in ids.iter().enumerate() {
        assert_eq!(out.of(*id).len(), reqs[k].max_tokens, "sequence {k}");
    }
}
