//! Continuous batching on the `tiny` checkpoint on the CPU: sequences decoded together give
//! the tokens each gives alone (exactly: the CPU kernels compute every row the same way at any
//! batch size), a sequence that joins mid-decode or is cancelled disturbs nobody, a pool too
//! small for two sequences preempts and recomputes without changing an answer, and shared
//! prefix blocks survive one sharer diverging. `gpu_batching.rs` runs the batch on the GPU.

mod batch_support;
mod support;

use batch_support::*;
use engine::scheduler::{Scheduler, SchedulerConfig, SeqId};
use engine::{Device, Engine, EngineConfig, FinishReason};

#[test]
fn sequences_decoded_together_give_the_tokens_each_gives_alone_on_the_cpu() {
    let reqs = prompts();
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| alone(Device::Cpu, r)).collect();
    let mut s = scheduler(Device::Cpu, 0, false);
    let mut out = Outcome::default();
    // Four start together; the fifth joins while they are mid-decode.
    let mut ids: Vec<SeqId> = reqs[..4].iter().map(|r| s.add(r.clone())).collect();
    for _ in 0..6 {
        out.take(s.step());
    }
    assert!(
        s.stats().running > 1,
        "the first four should be running together"
    );
    ids.push(s.add(reqs[4].clone()));
    out.take(s.run_to_completion());
    for (k, id) in ids.iter().enumerate() {
        assert_eq!(out.of(*id), solo[k], "sequence {k}");
        assert_eq!(out.finished[id].0, FinishReason::Length, "sequence {k}");
    }
    // The 70-token prompt joined in chunks of 24 beside the others' decode rows.
    assert!(s.stats().mixed_steps > 0, "no mixed step ran");
    assert_eq!(s.pool().available(), s.pool().total());
}

#[test]
fn the_single_sequence_engine_and_a_scheduler_of_one_agree() {
    let req = request(prompt(33, 7), 16);
    let config = EngineConfig {
        max_model_len: 128,
        prefill_chunk: 24,
        block_size: 16,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(tiny(), config).unwrap();
    let g = e
        .generate(&req, None, |_| std::ops::ControlFlow::Continue(()))
        .unwrap();
    assert_eq!(g.tokens, alone(Device::Cpu, &req));
}

#[test]
fn a_cancelled_sequence_leaves_at_the_next_step_and_the_others_are_undisturbed() {
    let reqs = prompts();
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| alone(Device::Cpu, r)).collect();
    let mut s = scheduler(Device::Cpu, 0, false);
    let ids: Vec<SeqId> = reqs.iter().map(|r| s.add(r.clone())).collect();
    let mut out = Outcome::default();
    for _ in 0..8 {
        out.take(s.step());
    }
    assert!(s.cancel(ids[2]));
    let before = out.of(ids[2]).len();
    out.take(s.step());
    assert_eq!(out.finished[&ids[2]].0, FinishReason::Cancelled);
    assert_eq!(out.of(ids[2]).len(), before, "no token after the cancel");
    assert_eq!(out.of(ids[2])[..], solo[2][..before]);
    out.take(s.run_to_completion());
    for k in [0, 1, 3, 4] {
        assert_eq!(out.of(ids[k]), solo[k], "sequence {k}");
    }
    assert_eq!(s.pool().available(), s.pool().total());
}

#[test]
fn a_pool_too_small_for_two_sequences_preempts_and_both_get_their_tokens_alone() {
    // 128 positions a sequence = 8 blocks of 16; the pool holds 10, and each sequence grows
    // to 40 + 60 = 100 positions (7 blocks): the two cannot run side by side to the end.
    let reqs = [request(prompt(40, 8), 60), request(prompt(40, 9), 60)];
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| alone(Device::Cpu, r)).collect();
    let mut s = scheduler(Device::Cpu, 10, false);
    assert_eq!(s.pool().total(), 10);
    let ids: Vec<SeqId> = reqs.iter().map(|r| s.add(r.clone())).collect();
    let mut out = Outcome::default();
    out.take(s.run_to_completion());
    assert!(s.stats().preemptions > 0, "the pool should have run out");
    let preempted: usize = ids.iter().map(|id| out.finished[id].1.preemptions).sum();
    assert!(preempted > 0);
    for (k, id) in ids.iter().enumerate() {
        assert_eq!(out.of(*id), solo[k], "sequence {k}");
    }
    assert_eq!(s.pool().available(), s.pool().total());
}

#[test]
fn prefix_blocks_shared_by_two_sequences_survive_one_of_them_diverging() {
    // 40 shared tokens = two full blocks of 16, then different tails.
    let head = prompt(40, 12);
    let with_tail = |salt| {
        let mut p = head.clone();
        p.extend(prompt(9, salt));
        request(p, 20)
    };
    let (a, b) = (with_tail(1), with_tail(2));
    let solo = [alone(Device::Cpu, &a), alone(Device::Cpu, &b)];
    let mut s = scheduler(Device::Cpu, 0, true);
    // The first run registers the head's blocks; then both run together on them.
    let warm = s.add(a.clone());
    let mut out = Outcome::default();
    out.take(s.run_to_completion());
    assert_eq!(out.of(warm), solo[0]);
    let ids = [s.add(a.clone()), s.add(b.clone())];
    out.take(s.run_to_completion());
    for (k, id) in ids.iter().enumerate() {
        assert_eq!(out.of(*id), solo[k], "sequence {k}");
        assert!(
            out.finished[id].1.cached_tokens >= 32,
            "sequence {k} should reuse the two shared blocks: {:?}",
            out.finished[id].1
        );
    }
    assert_eq!(s.pool().in_use(), 0);
}

#[test]
fn a_request_for_no_tokens_finishes_at_once_with_none() {
    let mut s = scheduler(Device::Cpu, 0, false);
    let id = s.add(request(prompt(10, 1), 0));
    let mut out = Outcome::default();
    out.take(s.run_to_completion());
    assert!(out.of(id).is_empty());
    assert_eq!(out.finished[&id].0, FinishReason::Length);
    assert_eq!(s.stats().steps, 1);
}

#[test]
fn a_constrained_sequence_takes_only_masked_tokens_and_its_neighbours_are_undisturbed() {
    let reqs = prompts();
    let solo: Vec<Vec<u32>> = reqs.iter().map(|r| alone(Device::Cpu, r)).collect();
    let vocab = tiny().decl.n_vocab();
    let mut s = scheduler(Device::Cpu, 0, false);
    let mut out = Outcome::default();
    let ids: Vec<SeqId> = reqs[..3].iter().map(|r| s.add(r.clone())).collect();
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let allowed = vec![300, 301, 7];
    assert!(s.constrain(
        ids[1],
        Box::new(Cycle {
            allowed: allowed.clone(),
            vocab,
            seen: seen.clone(),
        })
    ));
    out.take(s.run_to_completion());
    let got = out.of(ids[1]);
    let want: Vec<u32> = (0..got.len()).map(|n| allowed[n % 3]).collect();
    assert_eq!(got, want, "the constrained sequence left its mask");
    assert_eq!(
        *seen.lock().unwrap(),
        got,
        "the constraint was not told each token once"
    );
    assert_eq!(got.len(), reqs[1].max_tokens);
    for k in [0, 2] {
        assert_eq!(out.of(ids[k]), solo[k], "sequence {k} was disturbed");
    }
}

struct Empty;

impl engine::TokenConstraint for Empty {
    fn next_mask(&mut self) -> Result<Option<engine::TokenMask>, String> {
        Ok(Some(engine::TokenMask::of(8, &[])))
    }

    fn commit(&mut self, _: u32) -> Result<(), String> {
        Ok(())
    }
}

#[test]
fn a_constraint_that_allows_nothing_fails_its_sequence_alone() {
    let reqs = prompts();
    let solo = alone(Device::Cpu, &reqs[0]);
    let mut s = scheduler(Device::Cpu, 0, false);
    let mut out = Outcome::default();
    let a = s.add(reqs[0].clone());
    let b = s.add(reqs[1].clone());
    assert!(s.constrain(b, Box::new(Empty)));
    let events = s.run_to_completion();
    let failed: Vec<&String> = events
        .iter()
        .filter_map(|e| match e {
            engine::scheduler::SeqEvent::Failed { seq, error } if *seq == b => Some(error),
            _ => None,
        })
        .collect();
    assert_eq!(failed.len(), 1, "{events:?}");
    assert!(failed[0].contains("allows no token"), "{}", failed[0]);
    out.take(
        events
            .into_iter()
            .filter(|e| !matches!(e, engine::scheduler::SeqEvent::Failed { .. }))
            .collect(),
    );
    assert_eq!(out.of(a), solo);
    assert_eq!(s.pool().available(), s.pool().total());
}

#[test]
fn sampled_sequences_draw_the_same_tokens_chosen_in_the_step_or_on_the_host() {
    // Every cut, each sequence its own seed, two with a repetition penalty (applied in the
    // step); one with a logit bias always takes the host's path, beside the others.
    let reqs: Vec<engine::GenerateRequest> = prompts()
        .into_iter()
        .enumerate()
        .map(|(k, mut r)| {
            r.sampling = engine::SamplingParams {
                temperature: [0.7, 1.0, 1.3, 0.9, 1.1][k],
                top_k: [0, 40, 0, 7, 0][k],
                top_p: [1.0, 1.0, 0.9, 0.8, 1.0][k],
                min_p: [0.0, 0.0, 0.0, 0.05, 0.1][k],
                repetition_penalty: [1.0, 1.0, 1.3, 1.0, 1.2][k],
                logit_bias: if k == 4 { vec![(5, 2.0)] } else { Vec::new() },
                seed: 100 + k as u64,
            };
            r
        })
        .collect();
    let run = |on_host: bool| -> Vec<Vec<u32>> {
        let mut s = small_step_scheduler(SchedulerConfig {
            sample_on_host: on_host,
            ..SchedulerConfig::default()
        });
        let ids: Vec<SeqId> = reqs.iter().map(|r| s.add(r.clone())).collect();
        let mut out = Outcome::default();
        out.take(s.run_to_completion());
        ids.iter().map(|&id| out.of(id)).collect()
    };
    let in_step = run(false);
    assert_eq!(in_step, run(true));
    // Drawn, not greedy: at least one sequence parts from its greedy tokens.
    let greedy: Vec<Vec<u32>> = prompts().iter().map(|r| alone(Device::Cpu, r)).collect();
    assert_ne!(in_step, greedy);
}

#[test]
fn an_engine_keeps_a_bounded_number_of_chunk_plans_and_rebuilds_an_evicted_one() {
    let config = EngineConfig {
        max_model_len: 512,
        prefill_chunk: 512,
        block_size: 16,
        ..EngineConfig::default()
    };
    let mut e = Engine::new(tiny(), config).unwrap();
    let first = e.forward_argmax(&prompt(3, 9)).unwrap();
    // Every prompt length is a plan of its own.
    for len in 1..=engine::MAX_CHUNK_PLANS + 20 {
        e.reset();
        e.forward_argmax(&prompt(len, 1)).unwrap();
    }
    assert!(
        e.plan_count() <= engine::MAX_CHUNK_PLANS + 2,
        "{} plans held",
        e.plan_count()
    );
    // The first length's plan was evicted: built again, same answer.
    e.reset();
    assert_eq!(e.forward_argmax(&prompt(3, 9)).unwrap(), first);
}

/// A CPU scheduler of 8 sequences and 64 tokens a step without a prefix cache, the rest of
/// its limits from `limits`.
fn small_step_scheduler(limits: SchedulerConfig) -> Scheduler {
    scheduler_with(
        Device::Cpu,
        0,
        SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            prefix_caching: false,
            ..limits
        },
    )
}

/// Four of `prompts()` decode; after six steps the fifth (70 tokens) joins them under
/// `small_step_scheduler(limits)`: every sequence's tokens and the run's mixed steps.
fn joined_under(limits: SchedulerConfig) -> (Vec<Vec<u32>>, u64) {
    let reqs = prompts();
    let mut s = small_step_scheduler(limits);
    let mut out = Outcome::default();
    let mut ids: Vec<SeqId> = reqs[..4].iter().map(|r| s.add(r.clone())).collect();
    for _ in 0..6 {
        out.take(s.step());
    }
    ids.push(s.add(reqs[4].clone()));
    out.take(s.run_to_completion());
    let tokens: Vec<Vec<u32>> = ids.iter().map(|id| out.of(*id)).collect();
    (tokens, s.stats().mixed_steps)
}

#[test]
fn a_prompt_joining_under_a_step_limit_takes_more_shorter_chunks_and_the_same_tokens() {
    let run = |attention: usize, cap: usize| {
        joined_under(SchedulerConfig {
            mixed_attention_budget: attention,
            mixed_chunk_tokens: cap,
            ..SchedulerConfig::default()
        })
    };
    // The 70-token prompt beside decode rows: chunks of 24, 24 and 22 unbounded.
    let (free, free_mixed) = run(0, 0);
    // Within 1,280 query-key pairs the third is cut to a block of 16 (16·64 ≤ 1,280 < 22·70).
    let (bound, bound_mixed) = run(1280, 0);
    assert_eq!(
        free, bound,
        "the attention budget changed a sequence's tokens"
    );
    assert_eq!(bound_mixed, free_mixed + 1);
    // Held to 16 tokens, five chunks (16, 16, 16, 16, 6); the first prompts' chunks beside
    // the first decode rows are cut too (10 mixed steps against 7).
    let (capped, capped_mixed) = run(0, 16);
    assert_eq!(
        free, capped,
        "the mixed chunk cap changed a sequence's tokens"
    );
    assert!(
        capped_mixed >= free_mixed + 2,
        "{capped_mixed} mixed steps capped, {free_mixed} free"
    );
}
